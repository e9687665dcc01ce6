"""The orchestrator's side of the inference HTTP API (docs/design.md §4): requests, retries, sampling and parsing.

`InferenceClient` is the orchestrator's one handle on the servers: what is asked of them and how their answers
are read. Which server answers, what is done when one goes down or answers from weights below the floor
(`set_floor`: the oldest policy the current step may use, policy.oldest_policy), and which weights they serve
is the facade's (`servers.Servers`: the pool, the weight control and the HTTP with its retries, http.py), which
the client sends through. An answer that is not a usable completion (4xx, malformed JSON, the wrong number of
choices) raises `InferenceError` naming the URL and the server's answer.

Every completion is stamped with the weight step the server reports for it (`x-weight-step`), never with the
client's guess of what the server holds. Each
generated token also gets the policy step that sampled it (`Completion.token_steps`): from the
choice's `weight_steps` spans (protocol/spans.py; a server that swapped weights inside the request sends
several), or, where a server sends none (an older server, vLLM), the response's `x-weight-step` for every token.
Malformed spans are an InferenceError naming the server.

With LoRA (`adapter`, the servers' `model.lora.name`), requests name the adapter once the servers hold one
(after `update_weights`) and the base model before it and after `reload_weights`; the name is chosen at each
attempt, so a request retried after its server got the pool's weights again names what that server holds.

Completions come back as token ids (never re-tokenized text): the response's `prompt_token_ids`, each
choice's `token_ids`, and the sampled tokens' logprobs, whose tokens read `token_id:<id>`.

Training with top-p / top-k (`masks=True` and a filter on) also asks for `return_sampling_mask`: each token's
kept set comes back beside its logprob (`sampling_mask`) and goes to the trainer, which scores over it; a
server that answers without them is an InferenceError (the trainer could not score those tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from prime_rl.configs.orchestrator import ClientConfig, SamplingConfig
from prime_rl.orchestrator.servers import Servers
from prime_rl.orchestrator.servers.fleet import FleetFile
from prime_rl.orchestrator.servers.http import InferenceError
from prime_rl.orchestrator.servers.pool import Server, server_url
from prime_rl.protocol.http import WEIGHT_STEP_HEADER
from prime_rl.protocol.spans import steps_of


@dataclass
class Completion:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    weight_step: int  # the policy step the server reported for the response (x-weight-step)
    kept: list[list[int]] | None = None  # per token the ids it was drawn among ([] = all), when masks were asked
    token_steps: list[int] | None = None  # per token the policy step that sampled it (None: weight_step for all)
    server: int = -1  # the server that sampled it: its index in client.base_url (-1: unknown)

    def __post_init__(self) -> None:
        if self.token_steps is None:
            self.token_steps = [self.weight_step] * len(self.completion_ids)
        if len(self.token_steps) != len(self.completion_ids):
            raise ValueError(f"{len(self.token_steps)} token steps for {len(self.completion_ids)} tokens")


class Choice(NamedTuple):
    """One parsed choice of a response (the server's step is added by the client: `Completion`)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    kept: list[list[int]] | None  # the sampling masks, None when the server sent none
    token_steps: list[int] | None  # from the choice's `weight_steps`, None when the server sent none

    def completion(self, weight_step: int, server: int = -1) -> Completion:
        return Completion(
            *self[:5], weight_step=weight_step, kept=self.kept, token_steps=self.token_steps, server=server
        )


def parse_token_id(token: str) -> int:
    prefix, _, value = token.partition(":")
    if prefix != "token_id" or not value.lstrip("-").isdigit():
        raise ValueError(f"logprob token {token!r} is not 'token_id:<id>' (was return_tokens_as_token_ids sent?)")
    return int(value)


def _check_ids(choice: dict, logprob_ids: list[int]) -> list[int]:
    ids = choice.get("token_ids")
    if ids is None:
        return logprob_ids
    if list(ids) != logprob_ids:
        raise ValueError(f"choice {choice['index']}: token_ids disagree with the logprob tokens")
    return list(ids)


def _kept_sets(sets: Any, ids: list[int], index: int) -> list[list[int]] | None:
    """A choice's sampling masks, checked: one list of ints per token (None: the server sent none)."""
    if sets is None:
        return None
    if len(sets) != len(ids) or not all(isinstance(k, list) for k in sets):
        raise ValueError(f"choice {index}: sampling_mask is not one list of token ids per token")
    return [[int(i) for i in k] for k in sets]


def _token_steps(choice: dict, ids: list[int]) -> list[int] | None:
    """A choice's `weight_steps` spans as one policy step per token (None: the server sent none)."""
    spans = choice.get("weight_steps")
    if spans is None:
        return None
    try:
        return steps_of(spans, len(ids))
    except ValueError as e:
        raise ValueError(f"choice {choice['index']}: {e}") from None


def parse_chat_response(data: dict) -> list[Choice]:
    """The choices of a chat completion, in index order."""
    prompt_ids, choices = _prompt_and_choices(data, "the server must support return_token_ids")
    out = []
    for choice in choices:
        content = _content(choice)
        masks = [t["sampling_mask"] for t in content] if content and "sampling_mask" in content[0] else None
        text = (choice.get("message") or {}).get("content") or ""
        out.append(_content_choice(choice, prompt_ids, [parse_token_id(t["token"]) for t in content], masks, text))
    return out


def _prompt_and_choices(data: dict, needs: str) -> tuple[list[int], list[dict]]:
    """A response's prompt ids (one list for all its choices) and its choices in index order."""
    prompt_ids = data.get("prompt_token_ids")
    if not isinstance(prompt_ids, list):
        raise ValueError(f"response lacks prompt_token_ids ({needs})")
    return prompt_ids, sorted(data["choices"], key=lambda c: c["index"])


def _content(choice: dict) -> list[dict]:
    content = (choice.get("logprobs") or {}).get("content")
    if content is None:
        raise ValueError(f"choice {choice['index']} has no logprobs.content")
    return content


def _content_choice(choice: dict, prompt_ids: list[int], logprob_ids: list[int], masks: Any, text: str) -> Choice:
    """A choice whose logprobs are one `logprobs.content` entry per token (chat, the token route)."""
    ids = _check_ids(choice, logprob_ids)
    kept = _kept_sets(masks, ids, choice["index"])
    logprobs = [float(t["logprob"]) for t in choice["logprobs"]["content"]]
    steps = _token_steps(choice, ids)
    return Choice(list(prompt_ids), ids, logprobs, text, choice["finish_reason"], kept, steps)


def parse_completion_response(data: dict) -> list[Choice]:
    """The same for /v1/completions, whose logprobs are {"tokens": [...], "token_logprobs": [...]}."""
    out = []
    for choice in sorted(data["choices"], key=lambda c: c["index"]):
        prompt_ids = choice.get("prompt_token_ids")
        if not isinstance(prompt_ids, list):
            raise ValueError("choice lacks prompt_token_ids (the server must support return_token_ids)")
        logprobs = choice.get("logprobs") or {}
        tokens, token_logprobs = logprobs.get("tokens"), logprobs.get("token_logprobs")
        if tokens is None or token_logprobs is None:
            raise ValueError(f"choice {choice['index']} has no logprobs.tokens / token_logprobs")
        ids = _check_ids(choice, [parse_token_id(t) for t in tokens])
        text = choice.get("text") or ""
        kept = _kept_sets(logprobs.get("sampling_mask"), ids, choice["index"])
        values = [float(x) for x in token_logprobs]
        steps = _token_steps(choice, ids)
        out.append(Choice(list(prompt_ids), ids, values, text, choice["finish_reason"], kept, steps))
    return out


def parse_generate_response(data: dict) -> list[Choice]:
    """The same for the token-in/token-out route (/inference/v1/generate), whose logprob entries carry ids."""
    prompt_ids, choices = _prompt_and_choices(data, "the request must ask for return_token_ids")
    out = []
    for choice in choices:
        ids = [int(t["token_id"]) for t in _content(choice)]
        out.append(_content_choice(choice, prompt_ids, ids, choice.get("sampling_mask"), ""))
    return out


def parse_prompt_logprobs(data: dict, token_ids: list[int]) -> list[float]:
    """The prompt token logprobs of a completion answered with `prompt_logprobs` (vLLM's layout: None first,
    then per position a dict keyed by token id holding at least the prompt token's {"logprob", ...}); 0.0 at
    index 0. Raises ValueError when the answer does not score exactly `token_ids`."""
    choices = data["choices"]
    if not isinstance(choices, list) or not choices:
        raise ValueError("no choices")
    scored = choices[0].get("prompt_logprobs")
    if not isinstance(scored, list) or len(scored) != len(token_ids):
        length = len(scored) if isinstance(scored, list) else type(scored).__name__
        raise ValueError(f"prompt_logprobs has {length} entries for {len(token_ids)} tokens")
    if scored[0] is not None:
        raise ValueError("prompt_logprobs[0] is not null (the first token has no prefix)")
    out = [0.0]
    for i, (token, position) in enumerate(zip(token_ids[1:], scored[1:], strict=True), start=1):
        entry = position.get(str(token)) if isinstance(position, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("logprob"), int | float):
            raise ValueError(f"prompt_logprobs[{i}] has no logprob for token {token}")
        logprob = float(entry["logprob"])
        if not logprob <= 0.0:  # NaN or a positive "logprob"
            raise ValueError(f"prompt_logprobs[{i}] logprob {logprob} is not a log-probability")
        out.append(logprob)
    return out


class InferenceClient:
    """Async client for a pool of inference servers. Use as `async with InferenceClient(...) as client:`.

    Requests and sampling are here; they go through `servers` (the facade), whose pool (`pool`) and weight
    control (`weights`) also sit behind the methods at the end, which are what the orchestrator and `eval` call."""

    def __init__(
        self,
        config: ClientConfig,
        model: str,
        transport: httpx.AsyncBaseTransport | None = None,
        adapter: str | None = None,
        inflight: str | None = None,
        output_dir: Path | None = None,
        fleet: FleetFile | None = None,
    ):
        self.config = config
        self.model = model
        self.adapter = adapter  # the LoRA adapter's served name (model.lora.name); None: full weights
        # `inflight`: what weight updates ask of requests in flight (weights.inflight_ask); `output_dir`:
        # the run's, whose weights/step_k restore a server that answered from below the floor; `fleet`: the
        # run's list of servers, which may change while it goes on (fleet.py)
        self.servers = Servers(config, model, adapter, transport, inflight, output_dir, fleet)
        self.pool, self.weights = self.servers.pool, self.servers.weights

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.servers.close()

    # ---- requests ---------------------------------------------------------------------------------

    async def _sample(self, path: str, body: dict, parse) -> list[Completion]:
        """POST `body` through the facade (to a live server answering from weights at or above the floor) and
        read its answer with `parse` into one Completion per choice."""
        server, data, weight_step = await self.servers.generate(path, body)
        url = server_url(server, path)
        asked = body.get("sampling_params", body)  # the token route nests them
        try:
            choices = parse(data)
        except (KeyError, TypeError, ValueError) as e:
            raise InferenceError(f"POST {url} returned a malformed completion: {e}") from None
        if len(choices) != asked["n"]:
            raise InferenceError(f"POST {url} returned {len(choices)} choices, asked for n={asked['n']}")
        if weight_step is None:
            raise InferenceError(f"POST {url} did not report {WEIGHT_STEP_HEADER} (is it a prime-rl inference server?)")
        if asked.get("return_sampling_mask") and any(c.kept is None for c in choices):
            raise InferenceError(
                f"POST {url} returned no sampling masks: training with top_p < 1 or top_k > 0 needs each "
                "token's kept set (return_sampling_mask), which this server does not return (the built-in "
                "engine does); use top_p = 1 and top_k = 0 here"
            )
        return [choice.completion(weight_step, self.pool.servers.index(server)) for choice in choices]

    @property
    def request_model(self) -> str:
        """The model requests name: the LoRA adapter once the pool serves one, else the base model."""
        return self.servers.request_model

    def _sampling_body(self, n: int, sampling: SamplingConfig, seed: int | None, masks: bool = False) -> dict[str, Any]:
        # Every sampling parameter is sent, neutral ones too, so no server default (vLLM's, or a checkpoint's
        # generation_config.json) changes the distribution the trainer's logprobs assume. With `masks` and a
        # filter on, each token's kept set is asked for: the trainer scores over it.
        body: dict[str, Any] = {
            "model": self.model,
            "n": n,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": max(sampling.top_k, 0),  # 0 = off on both backends
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        }
        if seed is not None:
            body["seed"] = seed
        if masks and sampling.filtered:
            body["return_sampling_mask"] = True
        return body

    async def chat(
        self,
        messages: list[dict[str, Any]],
        n: int,
        sampling: SamplingConfig,
        seed: int | None = None,
        tools: list[dict] | None = None,
        masks: bool = False,
    ) -> list[Completion]:
        """`n` samples for one chat prompt (with the environment's `tools`, if any) from the next server; with
        `masks` (training) each token's kept set when top-p / top-k is on."""
        body = self._sampling_body(n, sampling, seed, masks) | {"messages": messages, "logprobs": True}
        if tools:
            body["tools"] = tools
        return await self._sample("/chat/completions", body, parse_chat_response)

    async def complete(
        self,
        prompt: str | list[int],
        n: int,
        sampling: SamplingConfig,
        seed: int | None = None,
        max_tokens: int = 0,
        masks: bool = False,
    ) -> list[Completion]:
        """`n` samples continuing a text or token-id prompt (/v1/completions); `masks` as in `chat`."""
        body = self._sampling_body(n, sampling, seed, masks) | {"prompt": prompt, "logprobs": 0}
        if max_tokens:
            body["max_tokens"] = max_tokens
        return await self._sample("/completions", body, parse_completion_response)

    async def generate(
        self, prompt_ids: list[int], n: int, sampling: SamplingConfig, seed: int | None = None, masks: bool = False
    ) -> list[Completion]:
        """`n` samples continuing a prompt of token ids the caller rendered itself, through the token-in/token-out
        route (/inference/v1/generate): the same pool, floor, weight steps and kept sets (`masks`) as `complete`."""
        body = {"model": self.model, "token_ids": list(prompt_ids), "return_token_ids": True}
        body["sampling_params"] = self.generate_params(n, sampling, seed, masks)
        return await self._sample("/inference/v1/generate", body, parse_generate_response)

    def generate_params(self, n: int, sampling: SamplingConfig, seed: int | None = None, masks: bool = False) -> dict:
        """The token route's `sampling_params` for `sampling`: every parameter, as `_sampling_body`."""
        params = self._sampling_body(n, sampling, seed, masks)
        del params["model"], params["return_tokens_as_token_ids"], params["return_token_ids"]
        return params | {"logprobs": 0}

    async def score(
        self,
        token_ids: list[int],
        server: Server | None = None,
        temperature: float = 1.0,
        kept: dict[int, list[int]] | None = None,
    ) -> list[float]:
        """The logprob of each token given the ones before it under the served weights, 0.0 at index 0: one
        /v1/completions request with `prompt_logprobs: 0` to `server`, or (None) to the next live server, going
        to another one when it is down. E.g. [5, 7, 9] -> [0.0, log p(7|5), log p(9|5,7)].

        From the raw logits (temperature 1) unless `temperature` ≠ 1 or `kept` (position -> the token ids the
        sampler could draw there) is given: then under log_softmax(logits / temperature), renormalised over each
        kept set, through the built-in engine's `prompt_logprobs_temperature` / `prompt_logprobs_kept`; a server
        that does not echo the temperature back (vLLM ignores unknown fields) is an InferenceError.
        """
        if len(token_ids) < 2:  # nothing to score: a first token has no prefix
            return [0.0] * len(token_ids)
        body = {"prompt": list(token_ids), "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0, "n": 1}
        processed = temperature != 1.0 or bool(kept)
        if processed:
            body["prompt_logprobs_temperature"] = temperature
            if kept:
                body["prompt_logprobs_kept"] = {str(p): ids for p, ids in kept.items()}
        target, data = await self.servers.post("/completions", body, server)
        url = f"{target.base}/completions"
        try:
            scored = parse_prompt_logprobs(data, token_ids)
            echo = data["choices"][0].get("prompt_logprobs_temperature")
        except (KeyError, TypeError, ValueError) as e:
            raise InferenceError(f"POST {url} returned malformed prompt_logprobs: {e}") from None
        if processed and echo != temperature:
            raise InferenceError(
                f"POST {url} scored the prompt without prompt_logprobs_temperature {temperature} (its answer "
                "does not echo it): only the built-in engine scores at a temperature and over kept sets"
            )
        return scored

    def set_floor(self, step: int) -> None:
        """From now on, completions sampled by a policy older than `step` are thrown away and asked again
        (their server restored first: Servers.generate). Set at each step's start by policy.wait_for_policy."""
        self.weights.floor = step

    # ---- pool health and weight control -----------------------------------------------------------

    async def wait_for_servers(self, timeout: float) -> dict[str, int]:
        """Wait until every server answers /health; the weight step each holds."""
        return await self.pool.wait_for_servers(timeout)

    async def server_step(self) -> int:
        """The oldest weight step any live server holds (removed servers are probed and may rejoin)."""
        return await self.servers.server_step()

    @property
    def weight_dir(self) -> str | None:
        """The weight dir the pool serves (the last `update_weights`); None: the servers' base weights."""
        return self.weights.weight_dir

    async def update_weights(self, weight_dir: str) -> int:
        """Load `weight_dir` on every live server; the step they now serve."""
        return await self.servers.update_weights(weight_dir)

    async def reload_weights(self) -> int:
        """Every live server back on the weights it started with; their step (0)."""
        return await self.weights.reload()

    async def broadcast_weights(self, step: int, rendezvous: dict) -> int:
        """Every server receives weight step `step` over the trainer's broadcast group; the step."""
        return await self.servers.broadcast_weights(step, rendezvous)
