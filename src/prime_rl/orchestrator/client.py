"""The orchestrator's side of the inference HTTP API (DESIGN §4): health, chat sampling, weight updates.

Requests go round-robin over `client.base_url` (each ending in `/v1`; `/health` and `/update_weights`
live at the server root), at most `max_concurrency` at once. Connection errors, 5xx and 429 are retried
with exponential backoff; anything else raises `InferenceError` naming the URL and the server's answer.

Completions come back as token ids (never re-tokenized text): the response's `prompt_token_ids`, each
choice's `token_ids`, and the sampled tokens' logprobs, whose tokens read `token_id:<id>`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import httpx

from prime_rl.orchestrator.config import ClientConfig, SamplingConfig

logger = logging.getLogger("prime_rl")

RETRY_STATUS = {429, 500, 502, 503, 504}
BACKOFF = 0.5  # seconds before the first retry; doubles each time


class InferenceError(RuntimeError):
    """An inference server was unreachable or answered something unusable; the message names the URL."""


@dataclass
class Completion:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    weight_step: int  # the policy step the server held when it sampled this


def server_root(base_url: str) -> str:
    """`http://host:8000/v1` → `http://host:8000` (where /health and /update_weights live)."""
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def parse_token_id(token: str) -> int:
    prefix, _, value = token.partition(":")
    if prefix != "token_id" or not value.lstrip("-").isdigit():
        raise ValueError(f"logprob token {token!r} is not 'token_id:<id>' (was return_tokens_as_token_ids sent?)")
    return int(value)


def parse_chat_response(data: dict) -> list[tuple[list[int], list[int], list[float], str, str]]:
    """(prompt_ids, completion_ids, logprobs, text, finish_reason) per choice of a chat completion."""
    prompt_ids = data.get("prompt_token_ids")
    if not isinstance(prompt_ids, list):
        raise ValueError("response lacks prompt_token_ids (the server must support return_token_ids)")
    out = []
    for choice in sorted(data["choices"], key=lambda c: c["index"]):
        content = (choice.get("logprobs") or {}).get("content")
        if content is None:
            raise ValueError(f"choice {choice['index']} has no logprobs.content")
        logprob_ids = [parse_token_id(t["token"]) for t in content]
        ids = choice.get("token_ids")
        if ids is None:
            ids = logprob_ids
        elif list(ids) != logprob_ids:
            raise ValueError(f"choice {choice['index']}: token_ids disagree with the logprob tokens")
        text = (choice.get("message") or {}).get("content") or ""
        out.append((list(prompt_ids), list(ids), [float(t["logprob"]) for t in content], text, choice["finish_reason"]))
    return out


class InferenceClient:
    """Async client for one or more inference servers. Use as `async with InferenceClient(...) as client:`."""

    def __init__(self, config: ClientConfig, model: str, transport: httpx.AsyncBaseTransport | None = None):
        self.config = config
        self.model = model
        self.base_urls = [url.rstrip("/") for url in config.base_url]
        # The weight step each server holds, from /health and /update_weights; stamped on every completion.
        self.steps: dict[str, int] = {url: 0 for url in self.base_urls}
        headers = {}
        api_key = os.environ.get(config.api_key_var, "") if config.api_key_var else ""
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.AsyncClient(
            timeout=config.timeout,
            headers=headers,
            transport=transport,
            limits=httpx.Limits(max_connections=config.max_concurrency),
        )
        self._slots = asyncio.Semaphore(config.max_concurrency)
        self._turn = itertools.count()

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, url: str, body: dict | None = None) -> dict:
        """One JSON request with retries on transient failures; InferenceError names the URL otherwise."""
        attempts = self.config.max_retries + 1
        problem = ""
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(BACKOFF * 2 ** (attempt - 1))
            try:
                async with self._slots:
                    response = await self._http.request(method, url, json=body)
            except httpx.TimeoutException as e:
                # A server that took longer than `client.timeout` is not transiently down; retrying would
                # only multiply the wait.
                if not isinstance(e, httpx.ConnectTimeout):
                    raise InferenceError(f"{method} {url}: no answer within {self.config.timeout:.0f}s") from None
                problem = f"connect timeout ({e})"
                continue
            except httpx.TransportError as e:
                problem = f"{type(e).__name__}: {e}"
                continue
            if response.status_code in RETRY_STATUS:
                problem = f"HTTP {response.status_code}: {response.text[:300]}"
                continue
            if response.status_code >= 400:
                raise InferenceError(f"{method} {url} failed with HTTP {response.status_code}: {response.text[:500]}")
            try:
                return response.json()
            except ValueError:
                raise InferenceError(f"{method} {url} answered non-JSON: {response.text[:300]!r}") from None
        raise InferenceError(f"{method} {url} failed after {attempts} attempt(s): {problem}")

    async def _health(self, base: str) -> int:
        data = await self._request("GET", f"{server_root(base)}/health")
        self.steps[base] = int(data.get("step", 0))
        return self.steps[base]

    async def wait_for_servers(self, timeout: float) -> dict[str, int]:
        """Poll every server's /health until all answer 200; return the weight step each holds."""
        deadline = time.monotonic() + timeout
        for base in self.base_urls:
            url = f"{server_root(base)}/health"
            delay = 0.2
            while True:
                try:
                    response = await self._http.get(url, timeout=min(10.0, self.config.timeout))
                    if response.status_code == 200:
                        self.steps[base] = int(response.json().get("step", 0))
                        break
                    problem = f"HTTP {response.status_code}"
                except (httpx.TransportError, ValueError) as e:
                    problem = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                if time.monotonic() + delay > deadline:
                    raise InferenceError(
                        f"inference server at {url} not ready after {timeout:.0f}s ({problem}); "
                        f"is it running and is client.base_url right?"
                    )
                await asyncio.sleep(delay)
                delay = min(delay * 1.5, 2.0)
            logger.info(f"inference server {base} is up (weight step {self.steps[base]})")
        return dict(self.steps)

    async def server_step(self) -> int:
        """The oldest weight step any server holds (every server is asked)."""
        steps = await asyncio.gather(*(self._health(base) for base in self.base_urls))
        return min(steps)

    async def chat(self, messages: list[dict[str, str]], n: int, sampling: SamplingConfig) -> list[Completion]:
        """`n` samples for one prompt from the next server in turn."""
        base = self.base_urls[next(self._turn) % len(self.base_urls)]
        url = f"{base}/chat/completions"
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "n": n,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": True,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        }
        weight_step = self.steps[base]
        data = await self._request("POST", url, body)
        try:
            choices = parse_chat_response(data)
        except (KeyError, TypeError, ValueError) as e:
            raise InferenceError(f"POST {url} returned a malformed chat completion: {e}") from None
        if len(choices) != n:
            raise InferenceError(f"POST {url} returned {len(choices)} choices, asked for n={n}")
        return [Completion(*choice, weight_step=weight_step) for choice in choices]

    async def update_weights(self, weight_dir: str) -> int:
        """Load `weight_dir` on every server (all must succeed); return the step they now serve."""

        async def one(base: str) -> int:
            data = await self._request("POST", f"{server_root(base)}/update_weights", {"weight_dir": weight_dir})
            self.steps[base] = int(data["step"])
            return self.steps[base]

        steps = await asyncio.gather(*(one(base) for base in self.base_urls))
        if len(set(steps)) != 1:
            raise InferenceError(f"servers report different steps after loading {weight_dir}: {steps}")
        return steps[0]
