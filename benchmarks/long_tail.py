"""`long_tail:load_environment`: a multi-turn environment with a long tail, for benchmarks/orchestration.py.

Every `every`-th example is an episode of `long` model turns (the env answers "Again." until then); the
others end after one turn. So one group in `every` takes about `long` times as long as the rest, the shape
of agent workloads where a few episodes run many tool calls. Reward: 1 for a last answer under 8 characters.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from prime_rl.envs import Example


@dataclass
class LongTail:
    every: int = 8
    long: int = 10

    @property
    def max_turns(self) -> int:
        return self.long

    def examples(self, seed: int) -> Iterator[Example]:
        rng, index = random.Random(seed), 0
        while True:
            turns = self.long if index % self.every == 0 else 1
            word = "".join(rng.choice("abcdefgh") for _ in range(4))
            prompt = [{"role": "user", "content": f"Say a short word like {word}."}]
            yield Example(prompt=prompt, answer=word, info={"index": index, "turns": turns})
            index += 1

    def respond(self, messages: list[dict], example: Example) -> str | None:
        taken = sum(m["role"] == "assistant" for m in messages)
        return "Again." if taken < example.info["turns"] else None

    def score(self, conversation: list[dict], example: Example) -> float:
        return float(len(conversation[-1]["content"]) < 8)


def load_environment(**args) -> LongTail:
    return LongTail(**args)
