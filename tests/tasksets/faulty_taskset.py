"""reverse-text (prime_rl_reverse) whose scorer fails on purpose, for the fault tests of episodes verifiers plays.

`fault` (a taskset config field): "" scores; "raise" / "hang" raises / sleeps for an hour on every task;
"raise-some" / "hang-some" only on texts whose length is a multiple of 4 (about one in four). verifiers' loader
imports a taskset id as a top-level module: the tests put this directory on PYTHONPATH.
"""

import asyncio

import verifiers.v1 as vf

from prime_rl.envs.reverse_text import similarity
from prime_rl_reverse import ReverseConfig, ReverseData, ReverseTaskset

__all__ = ["FaultyTaskset"]


class FaultyConfig(ReverseConfig):
    fault: str = ""


class FaultyTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
    fault: str = ""

    @vf.reward
    async def similarity(self, task: ReverseData, trace: vf.Trace) -> float:
        if self.fault and (not self.fault.endswith("-some") or len(task.text) % 4 == 0):
            if self.fault.startswith("hang"):
                await asyncio.sleep(3600)
            raise RuntimeError(f"the scorer broke on purpose on {task.text!r}")
        return similarity(trace.last_reply, task.text[::-1])


class FaultyTaskset(vf.Taskset[FaultyTask, FaultyConfig]):
    def load(self):
        for task in ReverseTaskset(self.config).load():
            faulty = FaultyTask(task.data, self.config.task)
            faulty.fault = self.config.fault
            yield faulty
