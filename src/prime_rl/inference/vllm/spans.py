"""Each choice's weight-step spans (and sampling masks) on vLLM's OpenAI routes (protocol/spans.py).

vLLM labels every output token with the weight version that sampled it (the engine core stamps each step's
outputs with the version `finish_weight_update` set; `CompletionOutput.weight_versions`, on a choice's final
output), and, started with `--return-sampling-mask` (GPU only: Model Runner V2), each token's kept set
(`CompletionOutput.sampling_mask`: the ids with a finite processed logit); but only its token-in/token-out route
answers with them. We take them where vLLM's OpenAI serving classes get them, from the engine client's
`generate`, and add them to the response on the way out:

- `record_outputs(client)` wraps the engine client's `generate` (the one its OpenAI serving classes call) so
  that, inside a request that `recording()` opened, each choice's spans and kept sets are kept by choice index
  (vLLM's: a request's k-th `generate` call, its k-th prompt, holds choices k·n .. k·n + n − 1);
- `with_weight_steps(send, record)` is the ASGI `send` that puts them on the response: `weight_steps` on each
  choice of a JSON body, or, streamed, on the chunk that finishes a choice (where the built-in engine puts
  them); kept sets on a JSON body's logprobs (`sampling_mask`, the built-in engine's format: a set holding
  the whole vocabulary is [], nothing filtered). Streamed responses carry no kept sets (server.py refuses
  to stream them).

Versions are the weight steps as text (server.py sets them); vLLM's label for the weights it started with
("default") is step 0, the base weights.
"""

from __future__ import annotations

import contextvars
import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

BASE_VERSION = "default"  # vLLM's label for the weights it loaded at start (EngineCore._weight_version)


@dataclass
class ChoiceSpans:
    """The spans of one HTTP request's choices, filled as its `generate` calls finish choices."""

    choices: int = 0  # choices of the `generate` calls made so far
    spans: dict[int, list[list[int]]] = field(default_factory=dict)
    masks: dict[int, list[list[int]]] = field(default_factory=dict)  # per choice, per token its kept set

    def open(self, n: int) -> int:
        """The first choice index of a `generate` call of `n` choices."""
        first, self.choices = self.choices, self.choices + n
        return first


_RECORD: contextvars.ContextVar[ChoiceSpans | None] = contextvars.ContextVar("prime_rl_choice_spans", default=None)


@contextmanager
def recording():
    """Collect the spans of the `generate` calls made while this request is served (tasks it starts, such as a
    streamed body's, copy the context and so share the record)."""
    record = ChoiceSpans()
    token = _RECORD.set(record)
    try:
        yield record
    finally:
        _RECORD.reset(token)


def version_step(version: str) -> int:
    """A weight version label as a weight step."""
    if version == BASE_VERSION:
        return 0
    if not version.isdigit():
        raise ValueError(f"weight version {version!r} is not a weight step (this server sets only steps)")
    return int(version)


def step_spans(versions: list) -> list[list[int]]:
    """vLLM's `WeightVersionSpan`s → `[[step, start, end], ...]`, runs of one step merged (a version set again
    to the same step, e.g. a reload of the base after the base, starts no new span)."""
    spans: list[list[int]] = []
    for v in versions:
        step = version_step(v.version)
        if spans and spans[-1][0] == step and spans[-1][2] == v.start:
            spans[-1][2] = v.end
        else:
            spans.append([step, v.start, v.end])
    return spans


def record_outputs(client: Any, vocab: int) -> None:
    """Make `client.generate` (vLLM's AsyncLLM, shared by its serving classes) keep each choice's spans and kept
    sets in the record of the request calling it; calls outside a recording are untouched. Once per client.
    `vocab`: the vocabulary size (a kept set that large filtered nothing)."""
    if getattr(client, "_prime_rl_records", False):
        return
    generate = client.generate

    def recorded_generate(prompt, sampling_params, *args, **kwargs):
        stream = generate(prompt, sampling_params, *args, **kwargs)
        record = _RECORD.get()
        if record is None:
            return stream
        return _recorded(stream, record, record.open(getattr(sampling_params, "n", 1) or 1), vocab)

    client.generate = recorded_generate
    client._prime_rl_records = True


async def _recorded(stream, record: ChoiceSpans, first: int, vocab: int):
    try:
        async for output in stream:
            for choice in output.outputs:
                if choice.weight_versions is not None:
                    record.spans[first + choice.index] = step_spans(choice.weight_versions)
                mask = getattr(choice, "sampling_mask", None)
                if mask is not None:  # the new tokens' (a streamed delta's) or, at the end, all of them
                    sets = record.masks.setdefault(first + choice.index, [])
                    sets += [[] if len(kept) >= vocab else list(kept) for kept in mask.token_ids]
            yield output
    finally:
        await stream.aclose()  # a client that left: vLLM aborts the request when its generator is closed


def with_weight_steps(send, record: ChoiceSpans):
    """An ASGI `send` adding `weight_steps` to the choices of a successful response (JSON or server-sent events)."""
    start: dict | None = None
    chunks: list[bytes] = []
    pending = b""  # the part of a streamed body after its last whole event
    mode = "pass"

    async def sending(message):
        nonlocal start, mode, pending
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers", []))
            kind = headers.get(b"content-type", b"")
            if message["status"] == 200 and kind.startswith(b"application/json"):
                start, mode = message, "json"  # sent with the rewritten body, whose length changes
                return
            mode = "events" if message["status"] == 200 and kind.startswith(b"text/event-stream") else "pass"
            return await send(message)
        if message["type"] != "http.response.body" or mode == "pass":
            return await send(message)
        more = message.get("more_body", False)
        if mode == "json":
            chunks.append(message.get("body", b""))
            if more:
                return
            body = add_to_json(b"".join(chunks), record)
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send(start | {"headers": [*headers, (b"content-length", str(len(body)).encode())]})
            return await send({"type": "http.response.body", "body": body, "more_body": False})
        events, sep, pending = (pending + message.get("body", b"")).rpartition(b"\n\n")
        body = add_to_events(events + sep, record)
        if not more:
            body, pending = body + pending, b""
        await send(message | {"body": body})

    return sending


def add_to_json(body: bytes, record: ChoiceSpans) -> bytes:
    """A completion body with each recorded choice's `weight_steps` (a body that is not one is returned as is)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if not _add(data, record, finished_only=False):
        return body
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


def add_to_events(events: bytes, record: ChoiceSpans) -> bytes:
    """Whole server-sent events (`data: {...}\\n\\n`) with `weight_steps` on each chunk that finishes a choice."""
    out = []
    for event in events.split(b"\n\n")[:-1]:
        if event.startswith(b"data: {"):
            try:
                data = json.loads(event[len(b"data: ") :])
            except ValueError:
                data = None
            if data is not None and _add(data, record, finished_only=True):
                event = b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
        out.append(event + b"\n\n")
    return b"".join(out)


def _add(data: Any, record: ChoiceSpans, finished_only: bool) -> bool:
    """Put the recorded spans on the choices of a response (or of a streamed chunk: those finishing), and on a
    whole response the kept sets; whether anything was added."""
    choices = data.get("choices") if isinstance(data, dict) else None
    added = False
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        added |= name_token_ids(choice)
        spans = record.spans.get(choice.get("index"))
        if spans is not None and (not finished_only or choice.get("finish_reason") is not None):
            choice["weight_steps"] = spans
            added = True
        masks = None if finished_only else record.masks.get(choice.get("index"))
        logprobs = choice.get("logprobs")
        if masks is not None and isinstance(logprobs, dict):
            if isinstance(logprobs.get("content"), list):  # chat: one entry per token
                for entry, kept in zip(logprobs["content"], masks, strict=False):
                    entry["sampling_mask"] = kept
            else:  # completions: parallel lists
                logprobs["sampling_mask"] = masks
            added = True
    return added


def name_token_ids(choice: dict) -> bool:
    """On a choice of vLLM's token-in/token-out route, each logprob entry (and its alternatives) also named
    `token: "token_id:<id>"`, as `renderers` (verifiers' training client) reads them and the built-in engine
    writes them; whether any was named."""
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    named = False
    for entry in content if isinstance(content, list) else ():
        for e in [entry, *(entry.get("top_logprobs") or [])] if isinstance(entry, dict) else ():
            if isinstance(e, dict) and "token_id" in e and "token" not in e:
                e["token"] = f"token_id:{e['token_id']}"
                named = True
    return named
