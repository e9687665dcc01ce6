"""The RL objective as pure tensor functions: token logprobs, entropy, and the default AIPO-style loss.

Notation (per token t of a packed row): π = the policy being trained, μ = the policy that sampled the
rollout (its logprobs come from inference), A_t = advantage, m_t = loss mask (generated tokens only).

    r_t  = exp(log π_t − log μ_t)                     importance ratio, detached
    w_t  = min(r_t, max_ratio)                        truncated (AIPO / truncated IS), detached
    loss = −Σ_t m_t · w_t · A_t · log π_t / N         N = loss-mask tokens of the whole step

The ratio only re-weights the policy gradient A_t ∇log π_t; it is never differentiated. Normalising by
the step's token count N (all micro batches, all ranks) makes the update independent of how the
orchestrator split the samples over micro batches and ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logprob of each token under softmax(logits / temperature), aligned with `input_ids`.

    `logits[:, t]` predicts `input_ids[:, t + 1]`, so position t of the result holds the logprob of
    `input_ids[:, t]` given the tokens before it; position 0 has no prediction and is 0.

    Example (vocab 2, temperature 1): input_ids [[0, 1, 0]], logits [[[0, 0], [ln 3, 0], [9, 9]]]
        position 1: softmax([0, 0])[1]    = 0.5  → log 0.5  = −0.693
        position 2: softmax([ln 3, 0])[0] = 0.75 → log 0.75 = −0.288
        result [[0, −0.693, −0.288]]   (the last logits row predicts beyond the row and is unused)
    """
    scaled = logits[:, :-1].float() / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    # gather − logsumexp is log_softmax at the target without materialising a second [L, V] tensor.
    logprobs = scaled.gather(-1, targets).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    return torch.nn.functional.pad(logprobs, (1, 0), value=0.0)


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of the distribution that predicted each token, aligned like `token_logprobs` (position 0 = 0).

    Example: logits [[[0, 0], [ln 3, 0], ...]] → position 1: ln 2 = 0.693; position 2:
    −(0.75 ln 0.75 + 0.25 ln 0.25) = 0.562.
    """
    scaled = logits[:, :-1].float() / temperature
    logp = torch.log_softmax(scaled, dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.nn.functional.pad(entropy, (1, 0), value=0.0)


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar to call backward on (already scaled by `scale`)
    loss_sum: torch.Tensor  # Σ m·w·(−A·log π), detached and unscaled: the step's loss is its global sum / N
    mismatch_kl_sum: torch.Tensor  # Σ m·((r − 1) − log r): k3 estimate of KL(μ‖π) summed over masked tokens
    clipped: torch.Tensor  # number of masked tokens with r > max_ratio


def aipo_loss(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    max_ratio: float,
    scale: float,
) -> LossTerms:
    """Token-level truncated importance-sampling policy gradient; `loss` = −Σ m·w·A·log π · scale.

    Pass `scale = world_size / N`: FSDP averages gradients over ranks, so the world size cancels and every
    token of the step weighs 1 / N.

    Example: log π = [−1, −2], log μ = [−1, −2 − ln 2] → r = [1, 2]; max_ratio 1.5 → w = [1, 1.5];
    A = [1, −1], mask all, scale 1/2:
        loss = −(1·1·(−1) + 1.5·(−1)·(−2)) / 2 = −1,   ∂loss/∂log π = −w·A/2 = [−0.5, 0.75]
        mismatch_kl_sum = (1 − 1 − 0) + (2 − 1 − ln 2) = 0.307,   clipped = 1
    """
    # Unmasked positions (prompts, padding) may hold placeholder μ logprobs whose ratio overflows;
    # `where` keeps their inf/nan out of the sums, where multiplying by a 0/1 mask would not.
    log_ratio = torch.where(loss_mask, logprobs.detach() - inference_logprobs, 0.0)
    ratio = log_ratio.exp()
    weight = ratio.clamp(max=max_ratio)
    per_token = torch.where(loss_mask, -weight * advantages * logprobs, 0.0)
    return LossTerms(
        loss=per_token.sum() * scale,
        loss_sum=per_token.detach().sum(),
        mismatch_kl_sum=(ratio - 1 - log_ratio).sum(),
        clipped=((ratio > max_ratio) & loss_mask).sum(),
    )
