"""Per-row token sampling for the built-in engine: temperature, top-k/top-p/min-p filtering, logprobs.

Pure functions over one row of logits (a 1-D tensor over the vocabulary). Each row is sampled on its
own with its own `torch.Generator`, so a seeded request draws the same tokens whatever else shares
its batch.

The logprob we report is that of the sampled token under `log_softmax(logits / temperature)`, taken
*before* any filtering: it is exactly what the trainer recomputes from its own logits (DESIGN §2,
`inference_logprobs`). Filtering only decides which tokens may be drawn. Temperature 0 means greedy
decoding; its logprobs come from the plain `log_softmax(logits)`.

Worked example, logits [2, 1, 0, -1] (probabilities ≈ [.644, .237, .087, .032]):
  - temperature 1, top_p 0.8: the two most likely tokens reach .881 ≥ .8, so only ids {0, 1} may be
    drawn; drawing id 1 reports logprob log(.237) ≈ -1.440.
  - temperature 0: id 0 is chosen and reports log(.644) ≈ -0.440.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to draw one request's tokens; validated by the API layer."""

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = no limit (vLLM convention)
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int = 0  # alternatives to record per generated token


def logprobs_of(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probabilities (float32) of the distribution the token is reported under."""
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1)


def filter_logprobs(logprobs: torch.Tensor, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0) -> torch.Tensor:
    """`logprobs` with -inf on every token the filters exclude. The most likely token always survives.

    top_k keeps the k most likely; top_p keeps the smallest most-likely set whose mass reaches top_p;
    min_p keeps tokens with probability ≥ min_p × the top probability.
    """
    keep = torch.ones_like(logprobs, dtype=torch.bool)
    if 0 < top_k < logprobs.numel():
        keep &= logprobs >= torch.topk(logprobs, top_k).values[-1]
    if top_p < 1.0:
        sorted_lp, order = torch.sort(logprobs, descending=True)
        mass_before = torch.cumsum(sorted_lp.exp(), dim=-1) - sorted_lp.exp()
        keep_sorted = mass_before < top_p  # a token is needed while the mass before it is short of top_p
        keep_sorted[0] = True
        keep &= torch.zeros_like(keep).scatter(0, order, keep_sorted)
    if min_p > 0.0:
        keep &= logprobs >= logprobs.max() + torch.log(torch.tensor(min_p))
    return logprobs.masked_fill(~keep, float("-inf"))


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, float, torch.Tensor]:
    """Draw one token from a row of logits: (token id, its logprob, the row's reported logprobs)."""
    logprobs = logprobs_of(logits, params.temperature)
    if params.temperature <= 0:
        token = int(torch.argmax(logprobs))
    else:
        allowed = filter_logprobs(logprobs, params.top_p, params.top_k, params.min_p)
        token = int(torch.multinomial(allowed.exp(), 1, generator=generator))
    return token, float(logprobs[token]), logprobs


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, logprob) pairs, most likely first."""
    if k <= 0:
        return []
    values, ids = torch.topk(logprobs, min(k, logprobs.numel()))
    return [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
