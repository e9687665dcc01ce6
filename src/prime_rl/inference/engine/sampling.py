"""Token sampling for the built-in engine, one decode step for a whole batch at once.

Every row carries its own parameters (temperature, top-k/top-p/min-p, repetition penalty, min_tokens)
and its own seeded `random.Random`. A row's random draw is one uniform number from its generator per
token, turned into a token by inverse-CDF over its filtered distribution, so a seeded request draws the
same tokens whatever else shares its batch (a Python generator costs ~50 ns a draw, a torch one ~2 µs).

The logprob we report is that of the sampled token under `log_softmax(logits / temperature)` of the
model's raw logits, taken *before* repetition penalty and filtering: it is exactly what the trainer
recomputes from its own logits (docs/design.md §2, `inference_logprobs`). Penalties and filters only decide
which tokens may be drawn. Temperature 0 means greedy decoding; its logprobs come from the plain
`log_softmax(logits)`.

With `return_sampling_mask` a row also reports, per token, its kept set: the sorted ids of every token it
could have drawn (the survivors of top-k / top-p / min-p and of tokens blocked by `min_tokens`; empty when
nothing was filtered), and its logprob is renormalised over that set, log_softmax(logits / temperature)
restricted to it. The trainer replays the set (docs/design.md §2, `kept_ids`), so both score the
distribution the token was really drawn from.

Worked example, logits [2, 1, 0, -1] (probabilities ≈ [.644, .237, .087, .032]):
  - temperature 1, top_p 0.8: the two most likely tokens reach .881 ≥ .8, so only ids {0, 1} may be
    drawn; drawing id 1 reports logprob log(.237) ≈ -1.440.
  - temperature 0: id 0 is chosen and reports log(.644) ≈ -0.440.
  - repetition_penalty 2 with id 0 already seen: its logit becomes 2 / 2 = 1 for sampling (a negative
    logit would be multiplied by 2 instead), but the reported logprob of id 0 stays -0.440.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to draw one request's tokens; validated by the API layer."""

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0  # EOS, stop token ids and stop strings cannot end a sample before this many tokens
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = no limit (vLLM convention)
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or the output (vLLM's rule)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_logprobs: int = 0  # alternatives to record per generated token
    return_sampling_mask: bool = False  # report each token's kept set and renormalise its logprob over it
    prompt_logprobs: int | None = None  # score the prompt too, with this many alternatives (scoring.py)
    prompt_temperature: float = 1.0  # ... at this temperature (our extension, for distillation: scoring.py)
    prompt_kept: Mapping[int, Sequence[int]] | None = None  # ... renormalised over these sets (position -> ids)


@dataclass
class Draws:
    """One decode step's result for a batch: per row the token, its logprob, and its top alternatives."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # empty lists for rows that asked for none
    kept: list[list[int]]  # per row its kept set (sorted ids); [] = nothing filtered, or not asked for


def logprobs_of(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """Log-probabilities (float32) of the distribution the token is reported under; temperature 0 = plain."""
    logits = logits.float()
    if isinstance(temperature, torch.Tensor):
        scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(logits)[:, None]
        return torch.log_softmax(logits / scale, dim=-1)
    return torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)


def filter_logprobs(
    logprobs: torch.Tensor,
    top_p: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor = -1,
    min_p: float | torch.Tensor = 0.0,
) -> torch.Tensor:
    """`logprobs` ([V] or [B, V]) with -inf on every token the filters exclude; per-row params may be tensors.

    top_k keeps the k most likely; top_p keeps the smallest most-likely set whose mass reaches top_p;
    min_p keeps tokens with probability ≥ min_p × the top probability. The most likely token always survives.
    """
    single = logprobs.dim() == 1
    lp = logprobs[None] if single else logprobs
    rows, vocab = lp.shape

    def column(value, dtype) -> torch.Tensor:
        return torch.as_tensor(value, dtype=dtype, device=lp.device).expand(rows)[:, None]

    top_p, top_k, min_p = column(top_p, torch.float32), column(top_k, torch.long), column(min_p, torch.float32)
    keep = torch.ones_like(lp, dtype=torch.bool)
    if bool((top_p < 1).any()) or bool(((top_k > 0) & (top_k < vocab)).any()):
        sorted_lp, order = torch.sort(lp, dim=-1, descending=True)
        ranks = torch.arange(vocab, device=lp.device)[None]
        keep_sorted = (top_k <= 0) | (ranks < top_k)  # top_k
        probs = sorted_lp.exp()
        mass_before = torch.cumsum(probs, dim=-1) - probs
        keep_sorted &= mass_before < top_p  # a token is needed while the mass before it is short of top_p
        keep_sorted[:, 0] = True
        keep = torch.zeros_like(keep).scatter(1, order, keep_sorted)
    if bool((min_p > 0).any()):
        keep &= lp >= lp.max(dim=-1, keepdim=True).values + torch.log(min_p)
    out = lp.masked_fill(~keep, float("-inf"))
    return out[0] if single else out


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """vLLM's rule on [B, V] logits: a seen token's positive logit is divided by the penalty, a negative one
    multiplied. `seen` is a [B, V] bool mask, `penalty` a [B] tensor (1 = off)."""
    factor = torch.where(logits > 0, 1 / penalty[:, None], penalty[:, None])
    return torch.where(seen, logits * factor, logits)


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[random.Random | None],
    seen: torch.Tensor | None = None,
    blocked: Sequence[Sequence[int]] = (),
) -> Draws:
    """Draw one token for each row of `logits` [B, V].

    `seen` ([B, V] bool) marks tokens the repetition penalty applies to; `blocked[b]` lists token ids row b
    may not draw now (EOS and stop ids before `min_tokens`). Rows without a generator use the global RNG.
    Greedy rows draw nothing, so their generators do not advance.
    """
    logits = logits.float()
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    reported = logprobs_of(logits, temperature)
    penalty = torch.tensor([p.repetition_penalty for p in params], device=device)
    shaped = logits
    if seen is not None and bool((penalty != 1).any()):
        shaped = apply_repetition_penalty(logits, seen, penalty)
    if any(blocked):
        shaped = shaped.clone()
        for b, ids in enumerate(blocked):
            if ids:
                shaped[b, list(ids)] = float("-inf")
    drawn_from = reported if shaped is logits else logprobs_of(shaped, temperature)
    greedy = temperature <= 0
    any_greedy = any(p.temperature <= 0 for p in params)
    tokens = drawn_from.argmax(dim=-1) if any_greedy else None  # an argmax is ~15% of sampling at 64 rows
    kept: list[list[int]] = [[] for _ in params]
    if any(p.temperature > 0 for p in params):
        allowed = drawn_from
        vocab = logits.shape[-1]
        if any(p.top_p < 1 or 0 < p.top_k < vocab or p.min_p > 0 for p in params):
            allowed = filter_logprobs(
                drawn_from,
                torch.tensor([p.top_p for p in params], device=device),
                torch.tensor([p.top_k for p in params], device=device),
                torch.tensor([p.min_p for p in params], device=device),
            )
        if any(p.return_sampling_mask for p in params):
            reported, kept = renormalise_kept(reported, allowed, params)
        cdf = torch.cumsum(allowed.exp(), dim=-1)
        draws = [(g or random).random() if p.temperature > 0 else 0.0 for g, p in zip(generators, params, strict=True)]
        u = torch.tensor(draws, device=device)
        # The first token whose cumulative mass exceeds u × total: tokens of zero mass are never chosen.
        sampled = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=cdf.shape[1] - 1)
        tokens = torch.where(greedy, tokens, sampled) if any_greedy else sampled
    token_logprobs = reported.gather(1, tokens[:, None])[:, 0]
    top: list[list[tuple[int, float]]] = [[] for _ in params]
    k = max((p.top_logprobs for p in params), default=0)
    if k > 0:
        values, ids = torch.topk(reported, min(k, reported.shape[1]), dim=-1)
        values, ids = values.tolist(), ids.tolist()
        # A renormalised row lists only tokens of its kept set (the others are -inf: no JSON number).
        top = [
            [(i, v) for i, v in list(zip(ids[b], values[b], strict=True))[: p.top_logprobs] if v != float("-inf")]
            for b, p in enumerate(params)
        ]
    return Draws(tokens.tolist(), token_logprobs.tolist(), top, kept)


def renormalise_kept(
    reported: torch.Tensor, allowed: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, list[list[int]]]:
    """For rows that asked for their sampling mask: the kept set (finite entries of `allowed`, [] when that is
    every token) and `reported` renormalised over it (-inf outside); other rows unchanged.

    Example: reported log([.644, .237, .087, .032]), allowed finite on ids {0, 1} → kept [0, 1] and the row
    becomes log([.731, .269, 0, 0]) (.644 / .881, .237 / .881).
    """
    kept: list[list[int]] = [[] for _ in params]
    rows = [b for b, p in enumerate(params) if p.return_sampling_mask and p.temperature > 0]
    keep = torch.isfinite(allowed[rows])
    partial = [j for j in range(len(rows)) if not bool(keep[j].all())]
    if not partial:
        return reported, kept
    reported = reported.clone()
    for j in partial:
        b = rows[j]
        kept[b] = keep[j].nonzero().squeeze(-1).tolist()
        masked = reported[b].masked_fill(~keep[j], float("-inf"))
        reported[b] = masked - torch.logsumexp(masked, dim=-1)
    return reported, kept


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: random.Random | None
) -> tuple[int, float, torch.Tensor]:
    """One row: (token id, its logprob, the row's reported logprobs)."""
    draws = sample_batch(logits[None], [params], [generator])
    return draws.tokens[0], draws.logprobs[0], logprobs_of(logits, params.temperature)


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, logprob) pairs, most likely first."""
    if k <= 0:
        return []
    values, ids = torch.topk(logprobs, min(k, logprobs.numel()))
    return [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
