"""Continuous mode (`max_inflight` set): up to max_inflight rollouts are generating or waiting to be taken at all
times, across weight updates (a server swaps weights between requests, never inside one); the step takes the
first complete groups, dropping those sampled by a policy older than policy.oldest_policy (counted in
`stale_groups`), so one long rollout no longer holds the whole step.
"""

from __future__ import annotations

import asyncio

from prime_rl.configs.orchestrator import OrchestratorConfig
from prime_rl.orchestrator.advantage import is_zero
from prime_rl.orchestrator.batch import Batch, EnvMix, group_seed, sample_group
from prime_rl.orchestrator.client import InferenceClient
from prime_rl.orchestrator.distill import Teacher
from prime_rl.orchestrator.policy import oldest_policy
from prime_rl.orchestrator.rollout import Group
from prime_rl.orchestrator.sinks import ProgressLine
from prime_rl.utils.timer import timer


class RolloutStream:
    """Continuous mode: groups keep generating across steps and weight updates.

    At most `max_inflight` rollouts are started and not yet taken into a batch (generating, or finished
    and waiting), so the stream runs ahead of the trainer by a bounded amount. `take` hands a step the
    first complete groups in completion order; groups from a policy older than policy.oldest_policy (step -
    max_off_policy_steps) are dropped. Examples in flight when the run stops are not replayed on resume
    (their draws are kept).
    """

    def __init__(self, client: InferenceClient, mix: EnvMix, config: OrchestratorConfig, rng,
                 teacher: Teacher | None = None):  # fmt: skip
        self.client, self.mix, self.config, self.rng, self.teacher = client, mix, config, rng, teacher
        self.size = config.rollouts_per_example
        self.held = 0  # rollouts started and not yet taken
        self.done: asyncio.Queue = asyncio.Queue()
        self.tasks: set[asyncio.Task] = set()

    def fill(self) -> None:
        while self.held + self.size <= self.config.max_inflight:
            slot = self.mix.next()
            draw = (slot, slot.data.next(), group_seed(self.config, self.rng))
            task = asyncio.create_task(sample_group(self.client, self.config, *draw, self.teacher))
            task.add_done_callback(self._finished)
            self.tasks.add(task)
            self.held += self.size

    def _finished(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled():
            self.done.put_nowait(task)

    async def take(self, step: int, progress: ProgressLine) -> Batch:
        need = self.config.batch_size // self.config.rollouts_per_example
        adv, oldest = self.config.advantage, oldest_policy(step, self.config)
        batch = Batch([], [])
        zero: list[tuple[Group, list[float]]] = []
        with timer(batch.times, "generate"):
            while len(batch.groups) < need:
                self.fill()
                task = await self.done.get()
                self.held -= self.size
                group, advantages = task.result()  # a failed group (server gone, env error) stops the run here
                if group.weight_step < oldest:
                    batch.stale += 1
                elif adv.skip_zero_advantage and is_zero(advantages) and batch.skipped < need * (adv.max_rounds - 1):
                    batch.skipped += 1
                    zero.append((group, advantages))
                else:
                    batch.groups.append(group)
                    batch.advantages.append(advantages)
                progress.note(len(batch.groups), need)
        self.fill()  # the next step's groups start generating now
        return batch

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
