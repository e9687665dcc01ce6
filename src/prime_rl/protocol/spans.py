"""Which policy produced each generated token: weight-step spans (docs/design.md §4, §6).

A server that swaps weights inside a request (`/update_weights` with `inflight = "continue"`) answers each choice
with `weight_steps`, a compact list of `[step, start, end]` spans over its generated tokens (end exclusive,
contiguous, covering every token). A request that ran on one policy has one span:

    weight_steps [[3, 0, 17], [4, 17, 40]]    # tokens 0-16 sampled by weight step 3, 17-39 by step 4

The orchestrator expands them to one step per token (`steps_of`); the rank files carry them (`policy_steps`).
"""

from __future__ import annotations

from itertools import groupby


def spans_of(steps: list[int]) -> list[list[int]]:
    """Per-token steps → `[[step, start, end], ...]` over their runs."""
    spans, start = [], 0
    for step, run in groupby(steps):
        end = start + sum(1 for _ in run)
        spans.append([step, start, end])
        start = end
    return spans


def steps_of(spans: object, count: int) -> list[int]:
    """`[[step, start, end], ...]` → one step per token for `count` tokens; ValueError naming what is wrong
    (spans that do not cover 0..count contiguously, or steps that go back)."""
    if not isinstance(spans, list) or not all(
        isinstance(s, list) and len(s) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in s)
        for s in spans
    ):
        raise ValueError(f"weight_steps must be a list of [step, start, end] integer spans, got {spans!r:.200}")
    steps, at, last = [], 0, -1
    for step, start, end in spans:
        if start != at or end <= start or step < last:
            raise ValueError(f"weight_steps {spans!r:.200} do not cover tokens 0..{count} in order")
        steps += [step] * (end - start)
        at, last = end, step
    if at != count:
        raise ValueError(f"weight_steps {spans!r:.200} cover {at} tokens, the choice has {count}")
    return steps
