"""Prompt logprobs: the log-probability of every prompt token given the tokens before it (`prompt_logprobs`).

As vLLM computes them: from the model's raw logits, `log_softmax` in float32, never scaled by the request's
temperature nor touched by its penalties or filters (prompt tokens skip the sampler). Position 0 has no
prefix, so it gets None. Each later position carries the prompt token's logprob, its rank (1 + the number of
other tokens at least as likely: vLLM counts `logprobs >= logprob`, the token included) and the `top` most
likely tokens.

Worked example, prompt [5, 7] whose logits after token 5 are [2, 1, 0, -1, ..., 0 (id 7)] over 8 ids:
position 1 reports log_softmax(logits)[7] and rank = #{ids with logit >= 0}.

Our extension for distillation (`prompt_logprobs_temperature`, `prompt_logprobs_kept`; vLLM has neither, so a
teacher scored there is refused at T ≠ 1 or with kept sets): the logprobs of the distribution a sampler at that
temperature reports, `log_softmax(logits / T)` (sampling.logprobs_of), and at a position given a kept set,
renormalised over it as `return_sampling_mask` renormalises a sampled token (sampling.renormalise_kept). A
teacher that is the student then scores each sampled token exactly as the student's sampler reported it.
E.g. logits [2, 1, 0, -1] at T = 0.5 are [4, 2, 0, -2] → log([.867, .117, .016, .002]); with kept {0, 1},
log([.881, .119, 0, 0]), the other ids -inf (written -9999.0, as vLLM writes -inf).

The scores are one forward over the whole prompt with the served weights, run by the worker when the
request is admitted (a weight swap waits for admitted requests, so the prompt is scored by the same policy
that samples its completion). The head runs on `CHUNK` positions at a time, so a long prompt never holds its
whole [L, V] logits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from prime_rl.inference.engine.sampling import logprobs_of

CHUNK = 512  # positions per lm_head + log_softmax: 512 x 151,936 x 4 B = 311 MB at Qwen's vocabulary


@dataclass
class PromptToken:
    """A prompt token's score: its logprob given the prefix, its rank, and the `top` most likely tokens."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


def score_prompt(
    model: torch.nn.Module,
    prompt_ids: list[int],
    top: int,
    device: torch.device,
    temperature: float = 1.0,
    kept: Mapping[int, Sequence[int]] | None = None,
) -> list:
    """[None, PromptToken(position 1), ..., PromptToken(position L - 1)] for one prompt; at `temperature`, and
    renormalised over `kept[p]` at each position p it names (the caller checked p in [1, L) and ids in range)."""
    ids = torch.tensor([prompt_ids], device=device)
    out: list[PromptToken | None] = [None]
    for start, logits in _logits_in_chunks(model, ids):
        # As the sampler computes them (one temperature per row, a tensor), so a teacher that is the student
        # reproduces the student's reported logprobs bit for bit on the same logits.
        rows = logits.shape[0]
        lp = logprobs_of(logits, torch.full((rows,), float(temperature), device=logits.device))  # [c, V]
        targets = ids[0, start + 1 : start + 1 + rows]
        lp = lp[: targets.shape[0]]  # the last position predicts past the prompt
        if kept:
            lp = _restrict(lp, start + 1, kept)
        chosen = lp.gather(1, targets[:, None])
        ranks = (lp >= chosen).sum(-1)
        tops = [[] for _ in range(targets.shape[0])]
        if top > 0:
            values, indices = torch.topk(lp, min(top, lp.shape[1]), dim=-1)
            tops = [
                [(i, v) for i, v in zip(i_row, v_row, strict=True) if v != float("-inf")]  # outside a kept set
                for i_row, v_row in zip(indices.tolist(), values.tolist(), strict=True)
            ]
        for logprob, rank, alternatives in zip(chosen[:, 0].tolist(), ranks.tolist(), tops, strict=True):
            out.append(PromptToken(logprob, rank, alternatives))
    return out


def _restrict(lp: torch.Tensor, first: int, kept: Mapping[int, Sequence[int]]) -> torch.Tensor:
    """`lp` [c, V] (row r scores position first + r) with each row whose position has a kept set renormalised
    over it, -inf outside: the operations of sampling.renormalise_kept, so the numbers are the sampler's."""
    lp = lp.clone()
    for position, ids in kept.items():
        r = position - first
        if 0 <= r < lp.shape[0]:
            keep = torch.zeros(lp.shape[1], dtype=torch.bool, device=lp.device)
            keep[torch.as_tensor(list(ids), dtype=torch.long, device=lp.device)] = True
            masked = lp[r].masked_fill(~keep, float("-inf"))
            lp[r] = masked - torch.logsumexp(masked, dim=-1)
    return lp


def _logits_in_chunks(model: torch.nn.Module, ids: torch.Tensor):
    """(first position, logits [c, V]) for every position of `ids` [1, L], `CHUNK` positions at a time.

    Llama-family heads are the lm_head on the decoder's (normed) last hidden state, so the decoder runs once
    and the head per chunk; any other model (its head may scale or cap the logits) is one full forward.
    """
    decoder, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if model.config.model_type in ("llama", "mistral", "qwen2", "qwen3") and decoder is not None and head is not None:
        hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state[0]
        for start in range(0, hidden.shape[0], CHUNK):
            yield start, head(hidden[start : start + CHUNK])
        return
    yield 0, model(input_ids=ids, use_cache=False).logits[0]
