"""A row — one sample of one request while it is decoded — and the rules its tokens follow: which tokens it
may not draw yet (`min_tokens`), when a drawn token ends it (EOS, stop token, stop string, `max_tokens`),
and the text it shows, whole when it ends or piecewise while it streams. Stop tokens and strings behave as
in vLLM. The worker (engine.py) decides when rows run; this module only keeps their books."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from prime_rl.inference.engine.types import Request

Decode = Callable[[list[int]], str]  # token ids -> text, special tokens skipped


@dataclass(eq=False)
class Row:
    """One sample of one request while it is being decoded."""

    request: Request
    index: int
    generator: random.Random
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    sampling_mask: list[list[int]] = field(default_factory=list)  # kept sets, when the request asked for them
    steps: list[int] = field(default_factory=list)  # per token, the weight step that sampled it
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # as vLLM's: the stop token id or string that ended it; None on EOS
    streamed: int = 0  # tokens already sent as deltas
    streamed_chars: int = 0

    def blocked(self, eos_ids: set[int]) -> list[int]:
        """Token ids that may not be drawn yet: whatever would end the sample before `min_tokens`."""
        params = self.request.params
        if len(self.token_ids) >= params.min_tokens:
            return []
        return list(params.stop_token_ids) + ([] if params.ignore_eos else sorted(eos_ids))

    def append(
        self,
        token: int,
        logprob: float,
        top: list[tuple[int, float]],
        eos_ids: set[int],
        decode: Decode,
        kept: list[int] | None = None,
        step: int = 0,
    ) -> None:
        """Record the row's next token (its kept set, the weight `step` that sampled it) and decide whether the
        row is finished."""
        params = self.request.params
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.steps.append(step)
        if params.top_logprobs > 0:
            self.top_logprobs.append(top)
        if params.return_sampling_mask:
            self.sampling_mask.append(kept or [])
        if token in params.stop_token_ids and token not in eos_ids:
            # Like vLLM: a stop token ends the sample and stays in token_ids, but not in the text.
            self.text, self.finish_reason, self.stop_reason = decode(self.token_ids[:-1]), "stop", token
        elif token in eos_ids and not params.ignore_eos:
            self.finish_reason = "stop"
        elif token in params.stop_token_ids:  # an EOS id named a stop token while EOS is ignored
            self.finish_reason, self.stop_reason = "stop", token
        elif (
            params.stop
            and len(self.token_ids) >= params.min_tokens
            and (found := _stop_at(text := decode(self.token_ids), params.stop)) is not None
        ):
            # Like vLLM: the text ends before the stop string; the token that completed it stays.
            self.text, self.finish_reason, self.stop_reason = text[: found[0]], "stop", found[1]
        elif len(self.token_ids) >= params.max_tokens:
            self.finish_reason = "length"
        if self.finish_reason is not None and self.text is None:
            self.text = decode(self.token_ids)

    def stream_text(self, decode: Decode) -> str:
        """New text that is safe to send: held back while it could still become (part of) a stop string or
        ends in an incomplete UTF-8 character; everything left on the last delta."""
        if self.finish_reason is not None:
            end, text = len(self.text or ""), self.text or ""
        else:
            text = decode(self.token_ids)
            end = len(text.rstrip("\ufffd"))
            if self.request.params.stop:
                end -= max(len(s) for s in self.request.params.stop) - 1
        if end <= self.streamed_chars:
            return ""
        new, self.streamed_chars = text[self.streamed_chars : end], end
        return new

    def context(self) -> list[int]:
        """The tokens the row's KV cache holds: its prompt and every drawn token but the last, which the next
        decode step feeds."""
        return self.request.prompt_ids + self.token_ids[:-1]


def eos_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    """The token ids that end a sample (unless `ignore_eos`): the generation config's and the tokenizer's."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _stop_at(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Where the first stop string in `text` starts, and which it is."""
    found = [(i, s) for i, s in ((text.find(s), s) for s in stops) if i >= 0]
    return min(found) if found else None
