"""The RL objective as pure tensor functions: the policy losses (token logprobs come from `trainer/logprobs.py`).

Notation (per token t of a packed row): π = the policy being trained, μ = the policy that sampled the
rollout (its logprobs come from inference), A_t = advantage, m_t = loss mask (generated tokens only),
r_t = exp(log π_t − log μ_t) the importance ratio, ω_t a per-token weight fixed by the normalisation.

    aipo (default)  ℓ_t = −sg[min(r_t, max_ratio)] · A_t · log π_t        truncated IS; the ratio is a constant
    ppo  (GRPO)     ℓ_t = −min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t)           two-sided clip
    gspo            like ppo with r_t replaced by s_i,t = sg[s_i] · π_t / sg[π_t],
                    s_i = exp(mean over sample i's loss tokens of (log π − log μ))   (GSPO-token form)
    loss            = Σ_t m_t ω_t ℓ_t / N  (+ kl_coef · k3(π, μ) − entropy_coef · H, same weighting)

Normalisation: `token` → ω_t = 1, N = loss tokens of the whole step (all micro batches, all ranks);
`sequence` → ω_t = 1 / (loss tokens of t's sample), N = samples of the step, so every sample weighs the
same whatever its length. Either way the update is independent of how the orchestrator split the
samples over micro batches and ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from prime_rl.configs.trainer import LossConfig


def sample_index(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """Long [1, L]: the packed sample each position belongs to. cu_seqlens [0, 2, 3] → [[0, 0, 1]]."""
    cu = cu_seqlens.long()
    return torch.repeat_interleave(torch.arange(len(cu) - 1, device=cu.device), cu.diff(), output_size=length)[None]


def token_weights(loss_mask: torch.Tensor, samples: torch.Tensor, norm: str) -> torch.Tensor:
    """ω_t · m_t: 1 on loss tokens (`token`), or 1 / (loss tokens of the sample) (`sequence`).

    Example: mask [[F, T, T, T]], samples [[0, 0, 0, 1]] → token [[0, 1, 1, 1]]; sequence [[0, .5, .5, 1]].
    """
    mask = loss_mask.float()
    if norm == "token":
        return mask
    counts = torch.zeros(int(samples.max()) + 1, device=mask.device).scatter_add_(0, samples[0], mask[0])
    return mask / counts[samples].clamp(min=1.0)


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar to call backward on (already scaled by `scale`)
    loss_sum: torch.Tensor  # Σ m·ω·ℓ (+ kl/entropy terms), detached and unscaled: step loss = global sum / N
    mismatch_kl_sum: torch.Tensor  # Σ m·((r − 1) − log r): k3 estimate of KL(μ‖π) summed over masked tokens
    clipped: torch.Tensor  # number of masked tokens whose ratio was truncated or clipped


def policy_loss(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    samples: torch.Tensor,
    cfg: LossConfig,
    scale: float,
    entropy: torch.Tensor | None = None,
) -> LossTerms:
    """The configured objective (module docstring) over one micro batch; `loss` = Σ m·ω·ℓ · scale.

    Pass `scale = world_size / N`: FSDP averages gradients over ranks, so the world size cancels.
    `samples` is `sample_index(cu_seqlens, L)`; `entropy` (differentiable) is needed when entropy_coef > 0.
    """
    # Unmasked positions (prompts, padding) may hold placeholder μ logprobs whose ratio overflows;
    # `where` keeps their inf/nan out of the sums, where multiplying by a 0/1 mask would not.
    log_ratio = torch.where(loss_mask, logprobs - inference_logprobs, 0.0)
    if cfg.type == "aipo":
        per_token, clipped = aipo_objective(logprobs, log_ratio.detach(), advantages, cfg.max_ratio)
    elif cfg.type == "ppo":
        per_token, clipped = clipped_objective(log_ratio.exp(), advantages, cfg.clip_low, cfg.clip_high)
    else:
        ratio = gspo_ratio(logprobs, log_ratio, loss_mask, samples)
        per_token, clipped = clipped_objective(ratio, advantages, cfg.clip_low, cfg.clip_high)
    if cfg.kl_coef:  # k3 estimate of KL(π‖μ) with gradient: keeps π near the sampling policy
        per_token = per_token + cfg.kl_coef * ((-log_ratio).exp() + log_ratio - 1)
    if cfg.entropy_coef:
        per_token = per_token - cfg.entropy_coef * entropy
    weighted = torch.where(loss_mask, token_weights(loss_mask, samples, cfg.norm) * per_token, 0.0)
    ratio = log_ratio.detach().exp()
    return LossTerms(
        loss=weighted.sum() * scale,
        loss_sum=weighted.detach().sum(),
        mismatch_kl_sum=torch.where(loss_mask, ratio - 1 - log_ratio.detach(), 0.0).sum(),
        clipped=(clipped & loss_mask).sum(),
    )


def aipo_objective(logprobs, log_ratio, advantages, max_ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ℓ = −min(r, max_ratio)·A·log π with the weight detached; clipped where r > max_ratio.

    Example: log π = [−1, −2], r = [1, 2], max_ratio 1.5, A = [1, −1] → ℓ = [1·1·1, −1.5·(−1)·(−2)] = [1, −3],
    ∂ℓ/∂log π = −w·A = [−1, 1.5], clipped = [F, T].
    """
    ratio = log_ratio.exp()
    return -ratio.clamp(max=max_ratio) * advantages * logprobs, ratio > max_ratio


def clipped_objective(ratio, advantages, clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO/GRPO: ℓ = −min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A); clipped where the clipped branch wins.

    Example (ε = 0.2): r = [1.5, 0.5, 1.1], A = [1, −1, 1] → ℓ = [−1.2, 0.8, −1.1]; the first two are clipped
    (their gradient is 0), the third has ∂ℓ/∂r = −A = −1.
    """
    unclipped = ratio * advantages
    clipped_value = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped_value), clipped_value.detach() < unclipped.detach()


def gspo_ratio(logprobs, log_ratio, loss_mask, samples) -> torch.Tensor:
    """GSPO-token ratio s_i,t = sg[s_i]·exp(log π_t − sg[log π_t]): value s_i, gradient s_i ∇log π_t.

    Example: one sample with log π − log μ = [ln 2, 0] on its two loss tokens → s = exp(ln 2 / 2) = √2 for both.
    """
    mask = loss_mask.float()
    lr = log_ratio.detach() * mask
    sums = torch.zeros(int(samples.max()) + 1, device=lr.device).scatter_add_(0, samples[0], lr[0])
    counts = torch.zeros_like(sums).scatter_add_(0, samples[0], mask[0]).clamp(min=1.0)
    seq_ratio = (sums / counts).exp()[samples]
    return seq_ratio * (logprobs - logprobs.detach()).exp()
