"""Group-relative advantages: each rollout is judged against the other rollouts of the same prompt.

With rewards r_1..r_G of one prompt's G rollouts,

    A_i = r_i - mean(r)                              (baseline "mean", the default)
    A_i = r_i - mean(r_j, j != i) = G/(G-1) (r_i - mean(r))   (baseline "leave_one_out": RLOO)
    A_i = (r_i - baseline) / (std(r) + eps)          (std_norm, as in GRPO; population std)

Worked example, one group of four: rewards [0, 0, 1, 1] → mean 0.5 → advantages [-0.5, -0.5, 0.5, 0.5];
with std_norm the std is 0.5, so [-1, -1, 1, 1]; with leave_one_out, rollout 1's baseline is the mean of
[0, 1, 1] = 2/3, so [-2/3, -2/3, 2/3, 2/3]. A group whose shaped rewards (below) are all equal gets all-zero
advantages (nothing to learn from it) under every option; `is_zero` tells such groups apart so the
orchestrator can skip them and sample other prompts instead. With `length_penalty`, equal rewards of
different lengths are not equal once shaped: such a group keeps its signal (the shorter wins) and is not
skipped.

Dr.GRPO (Liu et al. 2025) is GRPO without the two normalisations that bias it toward long wrong answers:
no std (std_norm = false, the default here) and no per-sequence length normalisation in the loss (the
trainer's `loss.norm = "token"`, its default: every loss token of a step weighs the same).

Before the baseline, rewards can be shaped:
- truncated completions (cut at max_tokens, or a multi-turn episode out of seq_len) can get reward 0
  (`truncated="zero_reward"`): rewards [1, 1(truncated), 0, 0] → [1, 0, 0, 0] → advantages
  [0.75, -0.25, -0.25, -0.25]. With `truncated="mask"` the cut rollout's tokens leave the loss
  (batch.build_samples) but its reward stays in the group's baseline, as an outcome the policy produced on
  this prompt: rewards [1, 0(truncated)] → advantages [0.5, -0.5], the first trained on +0.5;
- `length_penalty` λ subtracts λ × (model tokens / token budget), the budget being max_tokens × max turns:
  λ = 0.1, budget 100, two correct answers of 20 and 80 tokens: rewards [0.98, 0.92] → advantages
  [0.03, -0.03]: among equally right answers the shorter wins, and a wrong one stays below any right one
  while λ < 1.
"""

from __future__ import annotations

import math

EPS = 1e-6


def group_advantages(rewards: list[float], std_norm: bool = False, baseline: str = "mean") -> list[float]:
    g = len(rewards)
    mean = sum(rewards) / g
    centered = [r - mean for r in rewards]
    if baseline == "leave_one_out":
        if g < 2:
            raise ValueError("a leave-one-out baseline needs at least 2 rollouts per example")
        centered = [c * g / (g - 1) for c in centered]
    elif baseline != "mean":
        raise ValueError(f"unknown advantage baseline {baseline!r}")
    if not std_norm:
        return centered
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / g)
    return [c / (std + EPS) for c in centered]


def compute_advantages(rewards: list[list[float]], std_norm: bool = False, baseline: str = "mean") -> list[list[float]]:
    """Advantages for each group of rewards (one group per prompt), in the same nesting."""
    return [group_advantages(group, std_norm, baseline) for group in rewards]


def is_zero(advantages: list[float] | list[list[float]]) -> bool:
    """True when a group carries no learning signal (all its rollouts scored the same); per-token advantages
    (distillation) count when any token's is not zero."""
    return all(abs(x) < EPS for a in advantages for x in (a if isinstance(a, list) else [a]))


def apply_truncation(rewards: list[float], truncated: list[bool], mode: str) -> list[float]:
    """Rewards after the `truncated` policy: "zero_reward" sets a cut completion's reward to 0.

    >>> apply_truncation([1.0, 1.0, 0.0], [False, True, False], "zero_reward")
    [1.0, 0.0, 0.0]
    """
    if mode != "zero_reward":
        return list(rewards)
    return [0.0 if t else r for r, t in zip(rewards, truncated, strict=True)]


def apply_length_penalty(rewards: list[float], lengths: list[int], budget: int, penalty: float) -> list[float]:
    """r_i - penalty × lengths_i / budget.

    >>> [round(r, 2) for r in apply_length_penalty([1.0, 1.0], [20, 80], 100, 0.1)]
    [0.98, 0.92]
    """
    if not penalty:
        return list(rewards)
    return [r - penalty * n / budget for r, n in zip(rewards, lengths, strict=True)]
