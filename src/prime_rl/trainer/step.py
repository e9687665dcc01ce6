"""One optimizer step, shared by the RL trainer and SFT: only the loss differs (a callback).

For the micro batches (packed rows) of this rank: the policy's logprobs at the loss tokens
(`logprobs.forward_logprobs`), the loss callback's term backward (gradient accumulation; FSDP reduces once
per step on one rank), then clipping, the optimizer step (skipped, on every rank alike, when the gradient
norm is not finite) and the step's metrics reduced over all ranks.

Every loss token (or sample, `norm = "sequence"`) of the whole step weighs 1/N, N counted over all micro
batches and ranks, so the update does not depend on how the samples were split; the callback gets
`scale` = world_size / N (× world_size undoes FSDP's gradient averaging).

Reported metrics: the callback returns, per key, either a sum over its loss tokens (the step reports
Σ / loss tokens of the step) or a (sum, count) pair (the step reports Σ sum / Σ count, e.g. a mean over one
environment's tokens; left out when Σ count is 0). Both are summed over micro batches and ranks first, so a
mean does not depend on the split. A `Peak` is the largest over micro batches and ranks instead (left out when
no micro batch had one: −inf). Every rank must report the same keys (one collective over the sorted keys,
one more for peaks).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from torch.optim import Optimizer

from prime_rl.protocol.liveness import stamp
from prime_rl.trainer.ckpt import Progress
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.logprobs import PolicyOutput, sample_starts
from prime_rl.trainer.micro_batch import MicroBatch
from prime_rl.trainer.parallel import Dist, all_reduce, set_micro_batch_sync
from prime_rl.trainer.prefix import policy_output, shared_row, shares_prompts
from prime_rl.utils.memory import peak_rss_gib

logger = logging.getLogger("prime_rl")


@dataclass(frozen=True)
class Peak:
    """A reported value taken as the maximum over micro batches and ranks (−inf: none in this micro batch)."""

    value: torch.Tensor


# A reported value: a scalar sum over the micro batch's loss tokens (divided by the step's loss tokens), a
# (sum, count) pair (divided by the step's total count of the key), or a Peak (the maximum)
Reported = torch.Tensor | tuple[torch.Tensor, torch.Tensor] | Peak
# (policy output, micro batch, loss mask, scale) → (the term to backpropagate, values to report: "loss", a sum
# divided by N, and any others)
LossFn = Callable[[PolicyOutput, MicroBatch, torch.Tensor, float], tuple[torch.Tensor, dict[str, Reported]]]


@dataclass
class StepStats:
    loss: float  # Σ loss / N
    grad_norm: float  # before clipping
    num_tokens: int  # tokens processed (all ranks, padding included)
    num_computed_tokens: int  # of those, the ones the forward ran on (a shared prompt counts once: trainer/prefix.py)
    num_loss_tokens: int
    num_samples: int  # packed samples with at least one loss token
    num_rows: int  # micro batches run (all ranks, padding rows included): how well the step packed
    peak_memory_gib: float  # max over ranks: the device's (CUDA: allocated by torch; CPU: the process's RSS)
    peak_rss_gib: float  # max over ranks: the host process's resident memory
    means: dict[str, float] = field(default_factory=dict)  # the loss callback's other values (module docstring)


def train_step(
    model: nn.Module,
    optimizer: Optimizer,
    micro_batches: list[MicroBatch],
    dist: Dist,
    loss_fn: LossFn,
    max_norm: float,
    norm: Literal["token", "sequence"] = "token",
    entropy_grad: bool = False,
    share_prompts: bool = False,
) -> StepStats:
    """Accumulate `loss_fn`'s gradient over the micro batches, clip to `max_norm`, take one optimizer step;
    `share_prompts`: a prompt that several samples of a row share is computed once (trainer/prefix.py)."""
    # The first token of each sample has no prefix, so it never carries a logprob to train on.
    masks = [(mb.loss_mask & ~sample_starts(mb)).to(dist.device) for mb in micro_batches]
    share = share_prompts and shares_prompts(model, dist.device)
    rows = [shared_row(mb, m) if share else None for mb, m in zip(micro_batches, masks, strict=True)]
    local_counts = [
        sum(mb.num_tokens for mb in micro_batches),
        sum((mb if row is None else row.mb).num_tokens for mb, row in zip(micro_batches, rows, strict=True)),
        sum(int(m.sum()) for m in masks),
        sum(samples_with_loss(mb.cu_seqlens, m) for mb, m in zip(micro_batches, masks, strict=True)),
        len(micro_batches),
    ]
    num_tokens, computed, num_loss_tokens, num_samples, num_rows = all_reduce(local_counts, dist.device)
    denominator = max(num_loss_tokens if norm == "token" else num_samples, 1)
    scale = dist.world_size / denominator

    if dist.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dist.device)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, torch.Tensor] = {}  # keys reported as (sum, count) pairs
    peaks: dict[str, torch.Tensor] = {}  # keys reported as Peak
    for i, (mb, mask, row) in enumerate(zip(micro_batches, masks, rows, strict=True)):
        set_micro_batch_sync(model, dist, last=i == len(micro_batches) - 1)
        out = policy_output(model, mb, dist.device, mask, entropy_grad, row)
        term, reported = loss_fn(out, mb, mask, scale)
        term.backward()
        stamp()  # a step of a big model takes minutes: each micro batch shows the launcher it advances
        for key, value in reported.items():
            if isinstance(value, Peak):
                peak = value.value.detach().double()
                peaks[key] = torch.maximum(peaks[key], peak) if key in peaks else peak
                continue
            if isinstance(value, tuple):
                value, count = value
                counts[key] = counts.get(key, 0.0) + count.detach().double()
            sums[key] = sums.get(key, 0.0) + value.detach().double()

    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if math.isfinite(grad_norm):
        optimizer.step()
    else:  # every rank sees the same (reduced) norm, so all skip together
        logger.warning(f"non-finite gradient norm ({grad_norm}); skipping this update")
    optimizer.zero_grad(set_to_none=True)

    totals, total_counts, maxima = reduce_reported(sums, counts, peaks, dist)
    peak, rss = all_reduce([peak_memory_gib(dist.device), peak_rss_gib()], dist.device, op="max")
    return StepStats(
        loss=totals.pop("loss", 0.0) / denominator,
        grad_norm=grad_norm,
        num_tokens=int(num_tokens),
        num_computed_tokens=int(computed),
        num_loss_tokens=int(num_loss_tokens),
        num_samples=int(num_samples),
        num_rows=int(num_rows),
        peak_memory_gib=peak,
        peak_rss_gib=rss,
        means=reported_means(totals, total_counts, num_loss_tokens) | maxima,
    )


def reported_means(totals: dict[str, float], counts: dict[str, float], loss_tokens: float) -> dict[str, float]:
    """A sum per loss token of the step, or per its own count (left out when that is 0).

    Example: totals {"kl": 3, "kl/a": 2}, counts {"kl/a": 4}, 10 loss tokens → {"kl": 0.3, "kl/a": 0.5}."""
    means = {}
    for key, total in totals.items():
        count = counts.get(key, max(loss_tokens, 1))
        if count > 0:
            means[key] = total / count
    return means


def reduce_reported(
    sums: dict[str, torch.Tensor], counts: dict[str, torch.Tensor], peaks: dict[str, torch.Tensor], dist: Dist
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """The reported sums and counts summed over ranks, in one collective over the sorted keys, and the peaks'
    maxima in one more (a peak still −inf, i.e. none on any rank, is left out).

    The keys must be the same on every rank (a mismatch would pair the wrong values): checked by their count."""
    keys, count_keys, peak_keys = sorted(sums), sorted(counts), sorted(peaks)
    local = len(keys) + len(count_keys) + len(peak_keys)
    most, neg_fewest = all_reduce([local, -local], dist.device, op="max")
    if most != -neg_fewest:
        raise TrainerError(f"ranks reported different metric keys ({-neg_fewest:.0f} to {most:.0f}); this rank: {keys}")
    totals, total_counts, maxima = {}, {}, {}
    if keys:
        local = torch.stack([sums[k] for k in keys] + [counts[k] for k in count_keys]).tolist()  # one device sync
        values = all_reduce(local, dist.device)
        totals = dict(zip(keys, values[: len(keys)], strict=True))
        total_counts = dict(zip(count_keys, values[len(keys) :], strict=True))
    if peak_keys:
        values = all_reduce(torch.stack([peaks[k] for k in peak_keys]).tolist(), dist.device, op="max")
        maxima = {k: v for k, v in zip(peak_keys, values, strict=True) if math.isfinite(v)}
    return totals, total_counts, maxima


def samples_with_loss(cu_seqlens: torch.Tensor, mask: torch.Tensor) -> int:
    return sum(int(seg.any()) for seg in mask[0].cpu().split(cu_seqlens.diff().tolist()))


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return peak_rss_gib()


def step_metrics(stats: StepStats, times: dict[str, float], lr: float, progress: Progress) -> dict:
    """What every step reports: loss (+ the loss's own means), gradient, lr, token counts, throughput,
    memory, progress and timers."""
    return {
        "loss": stats.loss,
        **stats.means,
        "grad_norm": stats.grad_norm,
        "lr": lr,
        "num_tokens": stats.num_tokens,
        "num_computed_tokens": stats.num_computed_tokens,
        "num_loss_tokens": stats.num_loss_tokens,
        "num_samples": stats.num_samples,
        "num_rows": stats.num_rows,
        "tokens_per_s": stats.num_tokens / max(times["train"], 1e-9),
        "peak_memory_gib": stats.peak_memory_gib,
        "peak_rss_gib": stats.peak_rss_gib,
        "progress/tokens": progress.tokens,
        "progress/samples": progress.samples,
        **{f"time/{k}": v for k, v in times.items()},
    }
