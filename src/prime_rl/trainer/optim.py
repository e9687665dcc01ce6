"""AdamW and its learning-rate schedule, shared by the RL trainer and SFT."""

from __future__ import annotations

import math

import torch

from prime_rl.trainer.config import OptimConfig


def build_optimizer(model: torch.nn.Module, o: OptimConfig) -> torch.optim.Optimizer:
    """AdamW with the fused kernel (one pass over all parameters, CPU and CUDA; ~3x faster than per-tensor)."""
    return torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, fused=True)


def lr_factor(step: int, o: OptimConfig, max_steps: int) -> float:
    """Multiplier of `o.lr` for optimizer step `step` (0-based).

    Example (warmup 2, max_steps 6, linear): warmup (step + 1) / 2, then 1 − (step − 2) / 4 over the remaining
    4 steps → steps 0..5 use [0.5, 1, 1, 0.75, 0.5, 0.25].
    """
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.scheduler == "constant":
        return 1.0
    progress = (step - o.warmup_steps) / max(max_steps - o.warmup_steps, 1)
    if o.scheduler == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, o: OptimConfig, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, o, max_steps))
