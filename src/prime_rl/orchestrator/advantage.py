"""Group-relative advantages: each rollout is judged against the other rollouts of the same prompt.

With rewards r_1..r_G of one prompt's G rollouts,

    A_i = r_i - mean(r)                      (default)
    A_i = (r_i - mean(r)) / (std(r) + eps)   (std_norm, as in GRPO; population std)

Worked example, one group of four: rewards [0, 0, 1, 1] → mean 0.5 → advantages [-0.5, -0.5, 0.5, 0.5];
with std_norm the std is 0.5, so [-1, -1, 1, 1]. A group whose rewards are all equal gets all-zero
advantages (nothing to learn from it), with or without std_norm; `is_zero` tells such groups apart so
the orchestrator can skip them and sample other prompts instead.

Truncated completions (cut at max_tokens) can first get reward 0 (`truncated="zero_reward"`): rewards
[1, 1(truncated), 0, 0] → [1, 0, 0, 0] → advantages [0.75, -0.25, -0.25, -0.25].
"""

from __future__ import annotations

import math

EPS = 1e-6


def group_advantages(rewards: list[float], std_norm: bool = False) -> list[float]:
    mean = sum(rewards) / len(rewards)
    centered = [r - mean for r in rewards]
    if not std_norm:
        return centered
    std = math.sqrt(sum(c * c for c in centered) / len(rewards))
    return [c / (std + EPS) for c in centered]


def compute_advantages(rewards: list[list[float]], std_norm: bool = False) -> list[list[float]]:
    """Advantages for each group of rewards (one group per prompt), in the same nesting."""
    return [group_advantages(group, std_norm) for group in rewards]


def is_zero(advantages: list[float]) -> bool:
    """True when a group carries no learning signal (all its rollouts scored the same)."""
    return all(abs(a) < EPS for a in advantages)


def apply_truncation(rewards: list[float], truncated: list[bool], mode: str) -> list[float]:
    """Rewards after the `truncated` policy: "zero_reward" sets a cut completion's reward to 0.

    >>> apply_truncation([1.0, 1.0, 0.0], [False, True, False], "zero_reward")
    [1.0, 0.0, 0.0]
    """
    if mode != "zero_reward":
        return list(rewards)
    return [0.0 if t else r for r, t in zip(rewards, truncated, strict=True)]
