"""The RL objective as pure tensor functions: token logprobs, entropy, and the policy losses.

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
    from prime_rl.trainer.rl.config import LossConfig


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


def token_entropy(logits: torch.Tensor, temperature: float, grad: bool = False) -> torch.Tensor:
    """Entropy of the distribution that predicted each token, aligned like `token_logprobs` (position 0 = 0).

    Differentiable only with `grad=True` (an entropy bonus needs it; plain logging does not).
    Example: logits [[[0, 0], [ln 3, 0], ...]] → position 1: ln 2 = 0.693; position 2:
    −(0.75 ln 0.75 + 0.25 ln 0.25) = 0.562.
    """
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        scaled = logits[:, :-1].float() / temperature
        logp = torch.log_softmax(scaled, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return torch.nn.functional.pad(entropy, (1, 0), value=0.0)


def token_logprobs_and_entropy(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and `token_entropy` in one chunked pass over the vocabulary (the trainer's hot path;
    those two are the plain references the tests hold it to, and the trainer itself no longer calls them).

    Same values as the two functions (see their examples): `target_logprobs_and_entropy` on the logits
    shifted against their next tokens, with position 0 (no prefix) set to 0.
    """
    logprobs, entropy = target_logprobs_and_entropy(logits[:, :-1], input_ids[:, 1:], temperature, entropy_grad)
    pad = torch.nn.functional.pad
    return pad(logprobs, (1, 0), value=0.0), pad(entropy, (1, 0), value=0.0)


def target_logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy_grad: bool = False,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature) at `targets` [B, K] and the entropy, for logits [B, K, V] already
    aligned with their targets (no shift).

    Same values and gradients as log_softmax + gather + −Σ p log p, but the [K, V] work runs `chunk_rows`
    rows at a time (default: ~8 MiB of fp32, so each chunk stays in cache) and nothing of size [K, V] is
    kept besides the logits themselves: forward and backward read the logits once each and the backward
    writes the gradient once, where autograd's log-softmax makes ~10 passes over [K, V] in memory and
    keeps a second [K, V] tensor (~30% of a CPU step at vocab 32k; 4% at 1k).
    """
    rows = chunk_rows or max(1, 2**21 // logits.shape[-1])
    logprobs, entropy = _TargetLogprobs.apply(logits, targets, temperature, entropy_grad, rows)
    return logprobs, entropy if entropy_grad else entropy.detach()


class _TargetLogprobs(torch.autograd.Function):
    """(logits [B, K, V], targets [B, K]) → (logprobs [B, K], entropy [B, K]), chunked over the K rows.

    With z = logits / T, lse = logsumexp(z), p = softmax(z): logprob = z_target − lse, entropy = lse − Σ p z.
    Gradients: d logprob / dz = onehot(target) − p;  d entropy / dz = −p (z − lse + entropy).
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature, entropy_grad, rows):
        flat, index = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, 1)
        lse, target, entropy = (flat.new_empty(flat.shape[0], dtype=torch.float32) for _ in range(3))
        for start in range(0, flat.shape[0], rows):
            chunk = slice(start, start + rows)
            z = _scaled(flat[chunk], temperature)
            lse[chunk] = torch.logsumexp(z, -1)
            target[chunk] = z.gather(-1, index[chunk]).squeeze(-1)
            p = (z - lse[chunk, None]).exp_()
            entropy[chunk] = lse[chunk] - torch.linalg.vecdot(p, z)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature, ctx.entropy_grad, ctx.rows = temperature, entropy_grad, rows
        return (target - lse).view(targets.shape), entropy.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        flat, index = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, 1)
        g_lp = grad_logprobs.reshape(-1, 1).float() / ctx.temperature  # dz/dlogits = 1 / T
        g_ent = grad_entropy.reshape(-1, 1).float() / ctx.temperature if ctx.entropy_grad else None
        grad = torch.empty_like(flat)
        for start in range(0, flat.shape[0], ctx.rows):
            chunk = slice(start, start + ctx.rows)
            z = _scaled(flat[chunk], ctx.temperature)
            p = (z - lse[chunk, None]).exp_()
            if g_ent is None:
                dz = p.mul_(-g_lp[chunk])
            else:  # −g_lp p − g_ent p (z − lse + entropy)
                shift = (entropy[chunk] - lse[chunk])[:, None]
                dz = p.mul_((z + shift).mul_(g_ent[chunk]).add_(g_lp[chunk])).neg_()
            dz.scatter_add_(-1, index[chunk], g_lp[chunk])
            grad[chunk] = dz
        return grad.view(logits.shape), None, None, None, None


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits / temperature (the logits themselves at fp32 and T = 1: read, never written)."""
    z = logits.float()
    return z / temperature if temperature != 1.0 else z


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
