"""The step's batches, one `take(step)` for both modes: `Barrier` (default: each step samples its own batch,
batch.generate_batch) and `RolloutStream`, continuous mode (`max_inflight` set): groups keep generating across
steps and weight updates, and a step takes groups as they complete, so one long rollout does not hold the whole
step, and no group is dropped for being slow.

Deadlines. A group sampled from weight step w may be trained at steps up to its deadline w + max_off_policy_steps
(staleness.py). With B = batch_size / rollouts_per_example groups a step and step n the one being taken,
of which `taken` groups are in already, the started-not-taken groups can all be trained in time iff

    owed = max over deadlines d of (groups with deadline <= d) - B * (d - n)  <=  B - taken           (*)

(`owed` is how many of them step n itself must take: the rest fit in steps n+1..d). The stream keeps (*):
- admission (`fill`): a group starts only if (*) holds with it counted, its deadline taken as the servers'
  weight step now + max_off_policy_steps (its real one is never earlier); and at most max_inflight rollouts
  are started and not taken;
- `take(n)`: a complete group is taken (earliest deadline first, then completion order) only if (*) still
  holds without it, i.e. no running group owed to step n needs its slot; an owed group still running is
  waited for. Started groups are so finished first, long ones included, in their share of the batches.
A group that completes past its deadline anyway (its server sampled from older weights than it announced,
e.g. after a restart) is dropped and counted in `stale_groups`.

Worked example: B = 2, max_off_policy_steps = 2, async_level = 1. Step 5, the servers hold weights 4: new groups
get deadline 6, and (*) admits 4 of them (owed 4 - 2 * (6 - 5) = 2 <= 2): a (long), b, c, d. b completes:
without it owed = 3 - 2 = 1 <= 2 - 0 - 1, taken; c likewise (owed 0 <= 0). Step 6, servers on weights 5:
e and f start (deadline 7; owed stays 2, from a and d); d, complete already, is taken (without it owed 1 <=
1); e completes next, but without it owed is still 1 (a) > 2 - 1 - 1, so e waits for step 7 and a, running,
is waited for and taken. The old rule (take the first complete groups, drop those past their deadline) took
d and e at step 6 and dropped a at step 7: long episodes were trained on less than their share.

Per step the stream reports what it generated next to what was trained (`window_metrics`): the length and
reward distribution of the trained groups and of every group that finished generating in the step's window.
Examples in flight when the run stops are not replayed on resume (their draws are kept).
"""

from __future__ import annotations

import asyncio
import math
import statistics
from dataclasses import dataclass
from typing import Any

from prime_rl.configs.orchestrator import OrchestratorConfig
from prime_rl.orchestrator.advantage import is_zero
from prime_rl.orchestrator.batch import Batch, EnvMix, generate_batch, group_seed, sample_group
from prime_rl.orchestrator.distill import Teacher
from prime_rl.orchestrator.observer import StepObserver
from prime_rl.orchestrator.rollout import Group
from prime_rl.orchestrator.servers.client import InferenceClient
from prime_rl.orchestrator.sinks import ProgressLine
from prime_rl.orchestrator.staleness import Staleness
from prime_rl.utils.timer import timer


def owed(deadlines: list[int], step: int, per_step: int) -> int:
    """How many of the groups with these deadlines step `step` must take so every later one fits (B = per_step
    a step): max over d of (count <= d) - B * (d - step), at least 0. Deadlines before `step` are left out."""
    ordered = sorted(d for d in deadlines if d >= step)
    return max([0] + [i + 1 - per_step * (d - step) for i, d in enumerate(ordered)])


@dataclass
class Started:
    """A group started and not yet taken: its deadline (the last step that may train it) and, once complete,
    its scored group with advantages."""

    task: asyncio.Task
    deadline: int
    result: Group | None = None
    order: int = 0  # completion order


class Barrier(StepObserver):
    """Barrier mode: each step samples its own batch once the step's weights are in place."""

    def __init__(self, client: InferenceClient, mix: EnvMix, config: OrchestratorConfig, rng,
                 teacher: Teacher | None = None, progress: ProgressLine | None = None):  # fmt: skip
        self.client, self.mix, self.config, self.rng, self.teacher = client, mix, config, rng, teacher
        self.progress = progress or ProgressLine(False, config.max_steps)

    async def take(self, step: int) -> Batch:
        return await generate_batch(self.client, self.mix, self.config, self.rng, self.progress, self.teacher)

    async def metrics(self, client: InferenceClient, step: int, batch: Batch) -> dict[str, Any]:
        """trained/* as continuous mode reports them, so runs of both modes compare."""
        return group_metrics("trained", batch.groups)

    async def close(self) -> None:
        return None


class RolloutStream(StepObserver):
    """Continuous mode: groups keep generating across steps and weight updates, paced by their deadlines.

    At most `max_inflight` rollouts are started and not yet taken into a batch (generating, or finished
    and waiting), and only as many groups as can be trained before their policy is too old (module docstring)."""

    def __init__(self, client: InferenceClient, mix: EnvMix, config: OrchestratorConfig, rng,
                 teacher: Teacher | None = None, progress: ProgressLine | None = None):  # fmt: skip
        self.client, self.mix, self.config, self.rng, self.teacher = client, mix, config, rng, teacher
        self.progress = progress or ProgressLine(False, config.max_steps)
        self.staleness = Staleness.of(config)
        self.size = config.rollouts_per_example
        self.per_step = config.batch_size // config.rollouts_per_example
        self.started: list[Started] = []  # started and not taken, in start order
        self.done: asyncio.Queue[Started] = asyncio.Queue()
        self.step, self.taken = 0, 0  # the step being (or next to be) taken, and its groups so far
        self.floor = 0  # the oldest weight step the servers are known to hold: policy.wait_for_policy's guarantee
        self.completions = 0
        self.generated: list[Group] = []  # groups that finished generating in this step's window

    @property
    def held(self) -> int:
        """Rollouts started and not yet taken."""
        return len(self.started) * self.size

    def served(self) -> int:
        """The oldest weight step new requests can be sampled from: what the live servers last said they hold,
        and at least step - async_level once step's policy is in place (`take`)."""
        live = [s.step for s in self.client.pool.live()]
        return max(self.floor, min(live)) if live else self.floor

    def room(self, deadlines: list[int]) -> bool:
        """Whether groups with these deadlines can all still be trained in time: (*) in the module docstring."""
        return owed(deadlines, self.step, self.per_step) <= self.per_step - self.taken

    def fill(self) -> None:
        """Start groups while max_inflight and the deadlines allow (none whose deadline is already past: with
        max_off_policy_steps = async_level, between two steps, until the servers load the next weights)."""
        deadline = self.staleness.deadline(self.served())
        deadlines = [s.deadline for s in self.started]
        while (
            self.held + self.size <= self.config.max_inflight
            and deadline >= self.step
            and self.room(deadlines + [deadline])
        ):
            slot = self.mix.next()
            draw = (slot, slot.data.next(), group_seed(self.config, self.rng))
            task = asyncio.create_task(sample_group(self.client, self.config, *draw, self.teacher))
            started = Started(task, deadline)
            task.add_done_callback(lambda _, s=started: self.done.put_nowait(s))
            self.started.append(started)
            deadlines.append(deadline)

    def complete(self, started: Started, batch: Batch) -> None:
        """A group finished generating: its real deadline, or dropped as stale if that has passed."""
        started.result = started.task.result()  # a failed group (server gone, env error) stops the run here
        group = started.result
        self.completions += 1
        started.order = self.completions
        started.deadline = self.staleness.deadline(group.weight_step)
        self.generated.append(group)
        if started.deadline < self.step:
            self.started.remove(started)
            batch.stale += 1

    def next_ready(self) -> Started | None:
        """The complete group to take now: earliest deadline, then completion order, whose slot no owed group
        needs; None if there is none: an owed group is still running, or nothing is complete. (Should (*) be
        broken, by a server that sampled from older weights than it announced, and nothing run, the first.)"""
        ready = sorted((s for s in self.started if s.result is not None), key=lambda s: (s.deadline, s.order))
        for candidate in ready:
            rest = [s.deadline for s in self.started if s is not candidate]
            if owed(rest, self.step, self.per_step) <= self.per_step - self.taken - 1:
                return candidate
        running = len(ready) < len(self.started)
        return ready[0] if ready and not running else None

    async def take(self, step: int) -> Batch:
        need, adv = self.per_step, self.config.advantage
        self.step, self.taken = step, 0
        self.floor = max(self.floor, self.staleness.required(step))
        batch = Batch([])
        with timer(batch.times, "generate"):
            for started in [s for s in self.started if s.result is not None and s.deadline < step]:
                self.started.remove(started)  # (*) never lets this happen; counted should it anyway
                batch.stale += 1
            while len(batch.groups) < need:
                while not self.done.empty():  # every completion so far, so the completion order is kept
                    self.complete(self.done.get_nowait(), batch)
                self.fill()
                started = self.next_ready()
                if started is None:
                    self.complete(await self.done.get(), batch)
                    continue
                self.started.remove(started)
                group, advantages = started.result, started.result.advantages
                if adv.skip_zero_advantage and is_zero(advantages) and batch.skipped < need * (adv.max_rounds - 1):
                    batch.skipped += 1
                    continue
                batch.groups.append(group)
                self.taken += 1
                self.progress.note(len(batch.groups), need)
        self.step, self.taken = step + 1, 0
        self.fill()  # the next step's groups start generating now
        return batch

    def window_metrics(self, batch: Batch) -> dict[str, Any]:
        """The step's trained groups beside all groups that finished generating since the last step (its
        window): rollout length (prompt + completion tokens), turns and reward, so a length bias shows."""
        generated, self.generated = self.generated, []
        return group_metrics("trained", batch.groups) | group_metrics("generated", generated)

    async def metrics(self, client: InferenceClient, step: int, batch: Batch) -> dict[str, Any]:
        return self.window_metrics(batch)

    async def close(self) -> None:
        tasks = [s.task for s in self.started]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def group_metrics(prefix: str, groups: list[Group]) -> dict[str, Any]:
    """`{prefix}/groups`, and the mean and p90 of its rollouts' seq_len, the mean turns and reward."""
    rollouts = [r for g in groups for r in g.rollouts]
    if not rollouts:
        return {f"{prefix}/groups": 0}
    lengths = sorted(r.num_tokens for r in rollouts)
    return {
        f"{prefix}/groups": len(groups),
        f"{prefix}/seq_len_mean": statistics.fmean(lengths),
        f"{prefix}/seq_len_p90": lengths[math.ceil(0.9 * len(lengths)) - 1],
        f"{prefix}/turns_mean": statistics.fmean(r.turns for r in rollouts),
        f"{prefix}/reward_mean": statistics.fmean(r.reward for r in rollouts),
    }
