"""Group-relative advantages: each rollout is judged against the other rollouts of the same prompt.

With rewards r_1..r_G of one prompt's G rollouts,

    A_i = r_i - mean(r)                      (default)
    A_i = (r_i - mean(r)) / (std(r) + eps)   (std_norm, as in GRPO; population std)

Worked example, one group of four: rewards [0, 0, 1, 1] → mean 0.5 → advantages [-0.5, -0.5, 0.5, 0.5];
with std_norm the std is 0.5, so [-1, -1, 1, 1]. A group whose rewards are all equal gets all-zero
advantages (nothing to learn from it), with or without std_norm.
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
