"""Two offline tasksets written with verifiers 0.4's public API (`import verifiers.v1 as vf`), for `verifiers:` ids.

    [env]
    id = "verifiers:prime_rl.envs.verifiers_examples:sums"   # single-turn
    args = { num_tasks = 500, max_value = 99 }

    [env]
    id = "verifiers:prime_rl.envs.verifiers_examples:calc"   # the `add` tool, multi-turn

`sums`: "What is 12 + 30? ..." with a system prompt asking for the answer in \\boxed{}; verifiers'
parser `vf.extract_boxed_answer` reads it. Rewards `correct` (1.0) and `boxed` (weight 0.1), metric
`reply_chars`: reward = correct + 0.1·boxed.

`calc`: "What is {a} + {b}?" (no system prompt) with one tool, `add(a: int, b: int) -> int`, served bare
(`TOOL_PREFIX = None`, so the model sees `add`, not `calc_tools_add`): the conversation of the tiny
tool-calling model `assets/calc-qwen3` (scripts/make_calc_model.py). Reward `correct`: the last integer of
the final reply equals a + b; metric `tool_calls`.

Every hook is async: verifiers 0.4 scores a task by gathering its hooks, so a sync hook fails there (our
adapter takes both). Importing this module needs verifiers (`uv sync --extra verifiers`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf

SUMS_SYSTEM_PROMPT = "Solve the problem. Put the final answer in \\boxed{}."
_INTEGER = re.compile(r"-?\d+")


class AdditionData(vf.TaskData):
    a: int
    b: int
    answer: int


class AdditionConfig(vf.TasksetConfig):
    num_tasks: int = 1000
    """How many (a, b) questions the taskset holds."""
    max_value: int = 99
    """Operands are drawn from 0..max_value."""
    seed: int = 0
    """Seed of the operands (the examples' order is the orchestrator's seed)."""


def _pairs(config: AdditionConfig) -> Iterator[tuple[int, int]]:
    rng = random.Random(config.seed)
    for _ in range(config.num_tasks):
        yield rng.randint(0, config.max_value), rng.randint(0, config.max_value)


class SumsTask(vf.Task[AdditionData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: AdditionData, trace: vf.Trace) -> float:
        return float(vf.extract_boxed_answer(trace.last_reply, strict=True).strip() == str(task.answer))

    @vf.reward(weight=0.1)
    async def boxed(self, trace: vf.Trace) -> float:
        return float(bool(vf.extract_boxed_answer(trace.last_reply, strict=True).strip()))

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SumsTaskset(vf.Taskset[SumsTask, AdditionConfig]):
    def load(self) -> Iterator[SumsTask]:
        for a, b in _pairs(self.config):
            data = AdditionData(prompt=f"What is {a} + {b}?", system_prompt=SUMS_SYSTEM_PROMPT, a=a, b=b, answer=a + b)
            yield SumsTask(data, self.config.task)


class CalcTools(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the tool is `add`, as the calc model was trained on

    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class CalcTask(vf.Task[AdditionData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: AdditionData, trace: vf.Trace) -> float:
        numbers = _INTEGER.findall(trace.last_reply)
        return float(bool(numbers) and int(numbers[-1]) == task.answer)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(sum(len(m.tool_calls or []) for m in trace.assistant_messages))


class CalcTaskset(vf.Taskset[CalcTask, AdditionConfig]):
    @classmethod
    def toolsets(cls, config: AdditionConfig) -> list[vf.Toolset]:
        """`add` keeps no state: one tool server for the whole taskset, not one per episode (each is a Python
        process importing verifiers, ~8 CPU-s on 2 cores)."""
        return [CalcTools(vf.ToolsetConfig())]

    def load(self) -> Iterator[CalcTask]:
        for a, b in _pairs(self.config):
            yield CalcTask(AdditionData(prompt=f"What is {a} + {b}?", a=a, b=b, answer=a + b), self.config.task)


def sums(**args) -> SumsTaskset:
    return SumsTaskset(AdditionConfig(**args))


def calc(**args) -> CalcTaskset:
    return CalcTaskset(AdditionConfig(**args))


if __name__ == "__main__":  # verifiers serves a Toolset in its runtime as `python -m <its module>`
    CalcTools.run()
