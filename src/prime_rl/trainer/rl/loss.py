"""The RL objective as pure tensor functions: the policy losses (token logprobs come from `trainer/logprobs.py`).

Notation (per token t of a packed row): π = the policy being trained, μ = the policy that sampled the
rollout (its logprobs come from inference), A_t = advantage, m_t = loss mask (generated tokens only),
r_t = exp(log π_t − log μ_t) the importance ratio, ω_t a per-token weight fixed by the normalisation,
k_t = 1 − (t masked by a ratio mask below) the keep flag.

    aipo (default)  ℓ_t = −sg[min(r_t, max_ratio)] · A_t · log π_t        truncated IS; the ratio is a constant
    ppo  (GRPO)     ℓ_t = −min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t)           two-sided clip
    gspo            like ppo with r_t replaced by s_i,t = sg[s_i] · π_t / sg[π_t],
                    s_i = exp(mean over sample i's loss tokens of (log π − log μ))   (GSPO-token form);
                    always norm "sequence" and by default ε = 3e-4 / 4e-4 (the paper's), so with one
                    advantage per sample the loss is the paper's −1/G Σ_i min(s_i A_i, clip(s_i) A_i)
    custom          ℓ_t = f(LossInputs, **loss.kwargs)[t], a function named in the config (`LossInputs`)
    loss            = Σ_t m_t k_t ω_t (ℓ_t + kl_coef · KL_t − entropy_coef · H_t) / N

KL_t (`kl_type`, with gradient: keeps π near the sampling policy): k3 = min(1/r_t − 1 + log r_t, KL_MAX)
(default) or k2 = ½ (log r_t)². Unbounded, k3 grows as 1/r: one token with r = 1e-6 added 1e6 · kl_coef, more
than the rest of a step; capped at KL_MAX = 10 (verl's bound for its k3), past r < 0.073 or r > 6e4 a token's
k3 is a constant, with no gradient.

Ratio masks (`loss.mask`, all off by default; any rule masks, k_t = 0): the token band masks t when
r_t ∉ [token_low, token_high] (IcePop-style); the sequence band masks every token of sample i when its
geometric-mean ratio s_i ∉ [sequence_low, sequence_high] (masked importance sampling); the binary-TV rule
masks t when |π_t − μ_t| > tv_max, the total variation between π and μ over {the sampled token, the rest}
(in probability: π_t = exp log π_t). A masked token still counts in N, so masking shrinks the update rather
than re-weighting the other tokens, and the update stays independent of the micro-batch split.
Example: log r = [ln 3, 0, ln 0.25] on one sample, token band [0.5, 2] → k = [0, 1, 0]; s = (3 · 1 · 0.25)^⅓
= 0.91, inside a sequence band [0.5, 2] → nothing more.

Lag mask (`loss.max_token_lag`, off by default): trainer step n trains on rollouts/step_n, so a token sampled by
policy step p is n − p steps old (`token_lag`); tokens older than max_token_lag are masked the same way (k_t = 0,
still counted in N; `is_masked/lag`). Tokens no policy step is known for (policy_steps −1) are never masked.

Normalisation: `token` → ω_t = 1, N = loss tokens of the whole step (all micro batches, all ranks);
`sequence` → ω_t = 1 / (loss tokens of t's sample), N = samples of the step, so every sample weighs the
same whatever its length. Either way the update is independent of how the orchestrator split the
samples over micro batches and ranks.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from prime_rl.configs.trainer import LossConfig, MaskConfig
from prime_rl.trainer.errors import TrainerError

MASK_RULES = ("token", "sequence", "tv", "lag")
KL_MAX = 10.0  # the k3 penalty's cap per token (verl's clamp of its k3, `kl_penalty` in core_algos.py)


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


def sample_mean(values: torch.Tensor, loss_mask: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
    """[1, L]: at every position, the mean of `values` over its sample's loss tokens (0 for a sample without).

    Example: values [[9, 1, 3, 5]], mask [[F, T, T, T]], samples [[0, 0, 0, 1]] → [[2, 2, 2, 5]].
    """
    mask = loss_mask.float()
    v = torch.where(loss_mask, values, 0.0)
    sums = torch.zeros(int(samples.max()) + 1, device=v.device, dtype=v.dtype).scatter_add_(0, samples[0], v[0])
    counts = torch.zeros_like(sums).scatter_add_(0, samples[0], mask[0].to(v.dtype)).clamp(min=1.0)
    return (sums / counts)[samples]


def token_lag(policy_steps: torch.Tensor, step: int) -> torch.Tensor:
    """Long [1, L]: how many steps older than the trained `step` each token's policy is; −1 where no policy
    step is known (policy_steps −1). Example: policy_steps [[−1, 3, 5]] at step 5 → [[−1, 2, 0]]."""
    steps = policy_steps.long()
    return torch.where(steps >= 0, step - steps, -1)


@dataclass(frozen=True)
class LossInputs:
    """What a custom loss (`loss.type = "custom"`) is called with; every tensor is [1, L] over one packed row.

    It returns the per-token loss ℓ [1, L] (float, differentiable through `logprobs` / `log_ratio`), or a
    pair (ℓ, clipped) with `clipped` a bool [1, L] counted in `clip_frac`. The trainer then applies the loss
    mask, the ratio masks, the KL and entropy terms and the normalisation, exactly as for the built-in types.
    """

    logprobs: torch.Tensor  # log π_t, differentiable
    inference_logprobs: torch.Tensor  # log μ_t (placeholders off the loss mask)
    advantages: torch.Tensor  # A_t
    loss_mask: torch.Tensor  # bool m_t: generated tokens with a logprob
    samples: torch.Tensor  # long: the packed sample of each position (`sample_index`)
    log_ratio: torch.Tensor  # log π_t − log μ_t on loss tokens, 0 elsewhere; differentiable
    entropy: torch.Tensor | None  # H_t of π (differentiable only when entropy_coef > 0), or None


CustomLoss = Callable[..., "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


def load_custom_loss(import_path: str) -> CustomLoss:
    """The function at 'package.module:function' (from the config only); a TrainerError naming it otherwise."""
    module_name, _, name = import_path.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), name)
    except Exception as e:  # any failure of user code to import is one line naming the path
        raise TrainerError(f"loss.import_path = {import_path!r} does not import: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise TrainerError(f"loss.import_path = {import_path!r} is not a function ({type(fn).__name__})")
    return fn


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar to call backward on (already scaled by `scale`)
    loss_sum: torch.Tensor  # Σ m·k·ω·ℓ (+ kl/entropy terms), detached and unscaled: step loss = global sum / N
    mismatch_kl: torch.Tensor  # [1, L] m·((r − 1) − log r): k3 estimate of KL(μ‖π) per token, detached
    clipped: torch.Tensor  # number of loss tokens whose ratio was truncated or clipped
    masked: torch.Tensor  # bool [1, L]: loss tokens masked by any rule (ratio masks, lag)
    rule_masks: dict[str, torch.Tensor] = field(default_factory=dict)  # enabled rule → bool [1, L] (loss tokens)

    @property
    def mismatch_kl_sum(self) -> torch.Tensor:
        return self.mismatch_kl.sum()


def policy_loss(
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    samples: torch.Tensor,
    cfg: LossConfig,
    scale: float,
    entropy: torch.Tensor | None = None,
    custom: CustomLoss | None = None,
    lag: torch.Tensor | None = None,
) -> LossTerms:
    """The configured objective (module docstring) over one micro batch; `loss` = Σ m·k·ω·ℓ · scale.

    Pass `scale = world_size / N`: FSDP averages gradients over ranks, so the world size cancels.
    `samples` is `sample_index(cu_seqlens, L)`; `entropy` (differentiable) is needed when entropy_coef > 0;
    `custom` is `load_custom_loss(cfg.import_path)` when cfg.type is "custom"; `lag` is `token_lag(...)` (None:
    no token's policy step is known, so max_token_lag masks nothing).
    """
    # Unmasked positions (prompts, padding) may hold placeholder μ logprobs whose ratio overflows;
    # `where` keeps their inf/nan out of the sums, where multiplying by a 0/1 mask would not.
    log_ratio = torch.where(loss_mask, logprobs - inference_logprobs, 0.0)
    if cfg.type == "aipo":
        per_token, clipped = aipo_objective(logprobs, log_ratio.detach(), advantages, cfg.max_ratio)
    elif cfg.type == "ppo":
        per_token, clipped = clipped_objective(log_ratio.exp(), advantages, cfg.clip_low, cfg.clip_high)
    elif cfg.type == "gspo":
        ratio = gspo_ratio(logprobs, log_ratio, loss_mask, samples)
        per_token, clipped = clipped_objective(ratio, advantages, cfg.clip_low, cfg.clip_high)
    else:
        inputs = LossInputs(logprobs, inference_logprobs, advantages, loss_mask, samples, log_ratio, entropy)
        per_token, clipped = call_custom(custom, inputs, cfg)
    if cfg.kl_coef:
        per_token = per_token + cfg.kl_coef * kl_penalty(log_ratio, cfg.kl_type)
    if cfg.entropy_coef:
        per_token = per_token - cfg.entropy_coef * entropy
    rules = ratio_masks(log_ratio.detach(), logprobs.detach(), inference_logprobs, loss_mask, samples, cfg.mask)
    if cfg.max_token_lag is not None:  # always reported when set, so every rank has the same keys
        rules["lag"] = (lag > cfg.max_token_lag) & loss_mask if lag is not None else torch.zeros_like(loss_mask)
    masked = torch.zeros_like(loss_mask)
    for rule in rules.values():
        masked = masked | rule
    keep = loss_mask & ~masked
    weighted = torch.where(keep, token_weights(loss_mask, samples, cfg.norm) * per_token, 0.0)
    ratio = log_ratio.detach().exp()
    return LossTerms(
        loss=weighted.sum() * scale,
        loss_sum=weighted.detach().sum(),
        mismatch_kl=torch.where(loss_mask, ratio - 1 - log_ratio.detach(), 0.0),
        clipped=(clipped & loss_mask).sum(),
        masked=masked,
        rule_masks=rules,
    )


def call_custom(fn: CustomLoss | None, inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The custom function's (ℓ, clipped), its result checked: a TrainerError naming the path when malformed."""
    if fn is None:
        raise TrainerError("loss.type = 'custom' but no function was loaded (load_custom_loss(loss.import_path))")
    out = fn(inputs, **cfg.kwargs)
    per_token, clipped = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    shape = tuple(inputs.loss_mask.shape)
    if not isinstance(per_token, torch.Tensor) or not per_token.is_floating_point() or per_token.shape != shape:
        got = f"{per_token.dtype} {list(per_token.shape)}" if isinstance(per_token, torch.Tensor) else type(out)
        raise TrainerError(f"loss.import_path = {cfg.import_path!r} returned {got}; expected a float tensor {shape}")
    if clipped is None:
        clipped = torch.zeros_like(inputs.loss_mask)
    elif not isinstance(clipped, torch.Tensor) or clipped.dtype != torch.bool or clipped.shape != shape:
        raise TrainerError(f"loss.import_path = {cfg.import_path!r}: its 'clipped' must be a bool tensor {shape}")
    return per_token, clipped


def kl_penalty(log_ratio: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL(π‖μ) estimate with gradient: k3 = min(1/r − 1 + log r, KL_MAX), k2 = ½ (log r)² (both ≥ 0,
    0 at r = 1).

    Example: log r = ln 2 → k3 = 0.5 − 1 + 0.693 = 0.193, k2 = 0.240; ∂k2/∂log π = log r = 0.693.
    log r = ln 1e-6 → k3 = 1e6 − 1 − 13.8, capped at 10, gradient 0.
    """
    if kl_type == "k2":
        return 0.5 * log_ratio.square()
    # exp(-log r) of a very negative log π overflows float32 to inf: clamp log r first (|log r| ≤ 20), as verl does.
    log_ratio = log_ratio.clamp(-20.0, 20.0)
    return ((-log_ratio).exp() + log_ratio - 1).clamp(max=KL_MAX)


def ratio_masks(
    log_ratio: torch.Tensor,
    logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    samples: torch.Tensor,
    cfg: MaskConfig,
) -> dict[str, torch.Tensor]:
    """Per enabled rule ("token", "sequence", "tv"), the loss tokens it masks (bool [1, L]); detached inputs.

    Example: log r = [ln 3, 0, ln 0.25] (one sample), π = [0.9, 0.5, 0.1], μ = [0.3, 0.5, 0.4]:
    token band [0.5, 2] → [T, F, T]; tv_max 0.4 → |π − μ| = [0.6, 0, 0.3] → [T, F, F];
    sequence band [0.95, 2] → s = 0.91 < 0.95 → [T, T, T].
    """
    rules = {}
    if cfg.token_low is not None or cfg.token_high is not None:
        rules["token"] = outside_band(log_ratio.exp(), cfg.token_low, cfg.token_high) & loss_mask
    if cfg.sequence_low is not None or cfg.sequence_high is not None:
        seq_ratio = sample_mean(log_ratio, loss_mask, samples).exp()
        rules["sequence"] = outside_band(seq_ratio, cfg.sequence_low, cfg.sequence_high) & loss_mask
    if cfg.tv_max is not None:
        tv = (logprobs.exp() - torch.where(loss_mask, inference_logprobs, logprobs).exp()).abs()
        rules["tv"] = (tv > cfg.tv_max) & loss_mask
    return rules


def outside_band(ratio: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """Bool: ratio < low or ratio > high (an unset side never masks)."""
    out = torch.zeros_like(ratio, dtype=torch.bool)
    if low is not None:
        out = out | (ratio < low)
    if high is not None:
        out = out | (ratio > high)
    return out


def aipo_objective(
    logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, max_ratio: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """ℓ = −min(r, max_ratio)·A·log π with the weight detached; clipped where r > max_ratio.

    Example: log π = [−1, −2], r = [1, 2], max_ratio 1.5, A = [1, −1] → ℓ = [1·1·1, −1.5·(−1)·(−2)] = [1, −3],
    ∂ℓ/∂log π = −w·A = [−1, 1.5], clipped = [F, T].
    """
    ratio = log_ratio.exp()
    return -ratio.clamp(max=max_ratio) * advantages * logprobs, ratio > max_ratio


def clipped_objective(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO/GRPO: ℓ = −min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A); clipped where the clipped branch wins.

    Example (ε = 0.2): r = [1.5, 0.5, 1.1], A = [1, −1, 1] → ℓ = [−1.2, 0.8, −1.1]; the first two are clipped
    (their gradient is 0), the third has ∂ℓ/∂r = −A = −1.
    """
    unclipped = ratio * advantages
    clipped_value = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped_value), clipped_value.detach() < unclipped.detach()


def gspo_ratio(
    logprobs: torch.Tensor, log_ratio: torch.Tensor, loss_mask: torch.Tensor, samples: torch.Tensor
) -> torch.Tensor:
    """GSPO-token ratio s_i,t = sg[s_i]·exp(log π_t − sg[log π_t]): value s_i, gradient s_i ∇log π_t.

    Example: one sample with log π − log μ = [ln 2, 0] on its two loss tokens → s = exp(ln 2 / 2) = √2 for both.
    """
    seq_ratio = sample_mean(log_ratio.detach(), loss_mask, samples).exp()
    return seq_ratio * (logprobs - logprobs.detach()).exp()
