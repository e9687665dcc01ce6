"""reverse-text (envs/reverse_text.py) as a verifiers 0.4 taskset, for environments verifiers plays itself:

    [[orchestrator.env]]
    id = "verifiers-env"
    [orchestrator.env.args]
    taskset = { id = "prime_rl_reverse", min_chars = 5, max_chars = 16 }
    agent = { harness = { id = "null" }, runtime = { type = "subprocess" } }

The same texts for a seed and the same reward (the similarity of the reply to the reversed text) as the built-in
environment, so the two paths are compared on one task. A package of its own: verifiers' loader imports a taskset
id as a top-level module exporting one Taskset subclass in `__all__` (a dotted id is not looked up), as the
ecosystem's tasksets are installed. Importing it needs verifiers (`uv sync --extra verifiers`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import verifiers.v1 as vf

from prime_rl.envs.reverse_text import SYSTEM_PROMPT, ReverseText, similarity

__all__ = ["ReverseTaskset"]


class ReverseData(vf.TaskData):
    text: str


class ReverseConfig(vf.TasksetConfig):
    num_tasks: int = 1000
    """How many texts the taskset holds."""
    min_chars: int = 8
    max_chars: int = 32
    seed: int = 0
    """Seed of the texts (the examples' order is the orchestrator's seed)."""


class ReverseTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def similarity(self, task: ReverseData, trace: vf.Trace) -> float:
        return similarity(trace.last_reply, task.text[::-1])


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self) -> Iterator[ReverseTask]:
        texts, rng = ReverseText(self.config.min_chars, self.config.max_chars), random.Random(self.config.seed)
        for _ in range(self.config.num_tasks):
            text = texts.make_text(rng)
            yield ReverseTask(ReverseData(prompt=text, system_prompt=SYSTEM_PROMPT, text=text), self.config.task)
