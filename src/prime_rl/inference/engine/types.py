"""The engine's data: what a request gets back (`Sample`, `Delta`) or why it is refused or failed (`EngineBusy`,
`EngineClosed`, `RequestFailed`), and what a request and a pending weight swap carry from the asyncio side to the worker
thread and back (engine.py, outcomes.py). A request's rows, while decoded, are rows.py's."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from prime_rl.inference.engine.sampling import SamplingParams


class EngineBusy(RuntimeError):
    """The waiting queue is full; the client should retry later (HTTP 429)."""


class EngineClosed(RuntimeError):
    """The engine is shutting down (HTTP 503)."""


class RequestFailed(RuntimeError):
    """The engine failed on this request alone (its prefill, its draw or its text); the others go on (HTTP 500)."""


@dataclass
class Sample:
    """One generated completion. `token_ids` include the EOS / stop token when one ended it."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]  # per token; empty lists unless asked for
    text: str
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    weight_step: int = 0  # the policy that sampled its first token (the oldest)
    weight_steps: list[list[int]] = field(default_factory=list)  # [[step, start, end], ...] (protocol.spans)
    sampling_mask: list[list[int]] = field(default_factory=list)  # per token its kept set, with return_sampling_mask
    prompt_logprobs: list | None = None  # scoring.PromptToken per prompt position (None at 0), when asked
    stop_reason: int | str | None = None  # the stop token id or string that ended it (vLLM's); None on EOS


@dataclass
class Delta:
    """What one sample of a streamed request gained since the last delta; `finish_reason` on its last one."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    text: str
    finish_reason: str | None = None
    sampling_mask: list[list[int]] = field(default_factory=list)  # per token, with return_sampling_mask
    weight_steps: list[list[int]] | None = None  # on the sample's last delta: its spans (protocol.spans)


@dataclass(eq=False)
class Request:
    """One queued or running request; its `n` samples are filled in by the worker as its rows finish."""

    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    events: asyncio.Queue | None  # set for streamed requests: lists of Delta, or an exception
    samples: list[Sample | None] = field(default_factory=list)
    cancelled: bool = False  # set from the asyncio side; the worker drops the request's rows
    prompt_logprobs: list | None = None  # its prompt's scores, set by the worker on admission when asked


@dataclass
class Swap:
    """Checked weights waiting to be copied in; `future` gets the step. `inflight` "finish": once the running
    rows have finished; "continue": at the next iteration, the running rows' caches recomputed under them."""

    tensors: dict[str, torch.Tensor]
    step: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    inflight: str = "finish"
