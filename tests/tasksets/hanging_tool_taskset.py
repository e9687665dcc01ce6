"""The calculator taskset (prime_rl_calc) whose `add` tool never answers, for the fault tests of episodes verifiers
plays: the model calls the tool, the tool server in the runtime sleeps, and only the episode's bound
(`timeout.episode`) ends the episode. verifiers runs a Toolset in its runtime as `python -m <its module>`, so this
module serves its tools when run; the tests put this directory on PYTHONPATH for that process too."""

import asyncio

import verifiers.v1 as vf

from prime_rl.envs.verifiers_examples import AdditionConfig, CalcTask, CalcTaskset, CalcTools

__all__ = ["HangingToolTaskset"]


class HangingTools(CalcTools):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        await asyncio.sleep(3600)
        return a + b


class HangingToolTask(CalcTask):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [HangingTools(vf.ToolsetConfig())]


class HangingToolTaskset(vf.Taskset[HangingToolTask, AdditionConfig]):
    def load(self):
        for task in CalcTaskset(self.config).load():
            yield HangingToolTask(task.data, self.config.task)


if __name__ == "__main__":
    HangingTools.run()
