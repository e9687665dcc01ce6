"""reverse-text (prime_rl_reverse) whose scorer fails on purpose, for the fault tests of episodes verifiers plays.

`fault` (a task config field, `taskset = { id = "faulty_taskset", task = { fault = "..." } }`: a run-time knob of
the task, so verifiers' env server, which builds tasks from their data and never loads the taskset, has it too):
"" scores; "raise" / "hang" raises / sleeps for an hour on every task, "block" sleeps for an hour without
yielding (its env server's event loop stops: nothing else there is answered); "raise-some" / "hang-some" /
"block-some" only on texts whose length is a multiple of 4 (about one in four). verifiers' loader imports a
taskset id as a top-level module: the tests put this directory on PYTHONPATH.
"""

import asyncio
import time

import verifiers.v1 as vf

from prime_rl.envs.reverse_text import similarity
from prime_rl_reverse import ReverseConfig, ReverseData, ReverseTaskset

__all__ = ["FaultyTaskset"]


class FaultyTaskConfig(vf.TaskConfig):
    fault: str = ""


class FaultyConfig(ReverseConfig):
    task: FaultyTaskConfig = FaultyTaskConfig()


class FaultyTask(vf.Task[ReverseData, vf.State, FaultyTaskConfig]):
    @vf.reward
    async def similarity(self, task: ReverseData, trace: vf.Trace) -> float:
        fault = self.config.fault
        if fault and (not fault.endswith("-some") or len(task.text) % 4 == 0):
            if fault.startswith("hang"):
                await asyncio.sleep(3600)
            if fault.startswith("block"):
                time.sleep(3600)
            raise RuntimeError(f"the scorer broke on purpose on {task.text!r}")
        return similarity(trace.last_reply, task.text[::-1])


class FaultyTaskset(vf.Taskset[FaultyTask, FaultyConfig]):
    def load(self):
        for task in ReverseTaskset(self.config).load():
            yield FaultyTask(task.data, self.config.task)
