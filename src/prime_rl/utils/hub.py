"""Whether a command can get its model before it starts loading it: a local path must be a model dir, a hub id
must be in the local Hugging Face cache or the hub must answer. Without this a missing network was found by
transformers' own retries: 37-56 s, then "check your internet connection" (and for a mistyped local path, a
hub error about repo ids). Called at the start of every command that loads a model or tokenizer by name."""

from __future__ import annotations

import os
import threading
import urllib.error
import urllib.request

from prime_rl.configs.shared import local_model_problem, looks_local

PROBE_TIMEOUT = 5.0  # seconds: the hub answers in well under one when it can be reached at all


class ModelUnavailable(RuntimeError):
    pass


def check_model_source(name: str, error: type[Exception] = ModelUnavailable) -> None:
    """Raise `error` with one line when `name` can be neither read locally nor downloaded."""
    if looks_local(name):
        if problem := local_model_problem(name):
            raise error(f"model.name: {problem}")
        return
    if in_cache(name):
        return
    if offline():
        raise error(
            f"{name} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: use a local path or "
            "pre-download it (`hf download`)"
        )
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    if (why := unreachable(endpoint)) is not None:
        raise error(
            f"cannot reach {endpoint} to download {name} ({why}): no network? use a local path or pre-download it"
        )


def offline() -> bool:
    # huggingface_hub's and transformers' own switches, read as they read them
    return any(
        os.environ.get(var, "").upper() in {"1", "ON", "YES", "TRUE"}
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def in_cache(name: str) -> bool:
    """Whether the hub id `name` has its config in the local cache (what loading it reads first)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a valid repo id: loading it says why
        return True


def unreachable(url: str, timeout: float = PROBE_TIMEOUT) -> str | None:
    """Why `url` cannot be reached (one request, proxies honoured), or None when anything answers. In a thread:
    a name lookup has no timeout of its own."""
    outcome: list[str | None] = []

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
            outcome.append(None)
        except urllib.error.HTTPError:  # an answer, even an error status: the host is there
            outcome.append(None)
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            outcome.append(str(reason) or type(reason).__name__)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout + 1)
    return outcome[0] if outcome else f"no answer in {timeout:.0f} s"
