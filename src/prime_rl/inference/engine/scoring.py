"""Prompt logprobs: the log-probability of every prompt token given the tokens before it (`prompt_logprobs`).

As vLLM computes them: from the model's raw logits, `log_softmax` in float32, never scaled by the request's
temperature nor touched by its penalties or filters (prompt tokens skip the sampler). Position 0 has no
prefix, so it gets None. Each later position carries the prompt token's logprob, its rank (1 + the number of
other tokens at least as likely: vLLM counts `logprobs >= logprob`, the token included) and the `top` most
likely tokens.

Worked example, prompt [5, 7] whose logits after token 5 are [2, 1, 0, -1, ..., 0 (id 7)] over 8 ids:
position 1 reports log_softmax(logits)[7] and rank = #{ids with logit >= 0}.

The scores are one forward over the whole prompt with the served weights, run by the worker when the
request is admitted (a weight swap waits for admitted requests, so the prompt is scored by the same policy
that samples its completion). The head runs on `CHUNK` positions at a time, so a long prompt never holds its
whole [L, V] logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK = 512  # positions per lm_head + log_softmax: 512 x 151,936 x 4 B = 311 MB at Qwen's vocabulary


@dataclass
class PromptToken:
    """A prompt token's score: its logprob given the prefix, its rank, and the `top` most likely tokens."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


def score_prompt(model: torch.nn.Module, prompt_ids: list[int], top: int, device: torch.device) -> list:
    """[None, PromptToken(position 1), ..., PromptToken(position L - 1)] for one prompt."""
    ids = torch.tensor([prompt_ids], device=device)
    out: list[PromptToken | None] = [None]
    for start, logits in _logits_in_chunks(model, ids):
        lp = torch.log_softmax(logits.float(), dim=-1)  # [c, V], positions start .. start + c - 1
        targets = ids[0, start + 1 : start + 1 + lp.shape[0]]
        lp = lp[: targets.shape[0]]  # the last position predicts past the prompt
        chosen = lp.gather(1, targets[:, None])
        ranks = (lp >= chosen).sum(-1)
        tops = [[] for _ in range(targets.shape[0])]
        if top > 0:
            values, indices = torch.topk(lp, min(top, lp.shape[1]), dim=-1)
            tops = [list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
        for logprob, rank, alternatives in zip(chosen[:, 0].tolist(), ranks.tolist(), tops, strict=True):
            out.append(PromptToken(logprob, rank, alternatives))
    return out


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
