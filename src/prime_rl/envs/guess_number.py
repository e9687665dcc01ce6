"""`guess-number`: a multi-turn game. The model guesses a secret integer; the env answers higher/lower.

One episode, secret 42 in [1, 100]:

    user:      I am thinking of a number between 1 and 100. Guess it; answer with one number.
    assistant: 50            → env: "Lower."
    assistant: 30            → env: "Higher."
    assistant: 42            → env: None (done)

Reward 1.0 if a guess hit the secret, minus `turn_penalty` per extra turn (never below 0.5 for a hit);
metrics: `turns` (model turns taken) and `valid_guesses` (fraction of turns that contained a number).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

from prime_rl.envs.base import Example

_INTEGER = re.compile(r"-?\d+")


def last_guess(text: str) -> int | None:
    numbers = _INTEGER.findall(text)
    return int(numbers[-1]) if numbers else None


@dataclass
class GuessNumber:
    low: int = 1
    high: int = 100
    max_turns: int = 4
    turn_penalty: float = 0.1

    def __post_init__(self) -> None:
        if self.low >= self.high or self.max_turns < 1:
            raise ValueError(f"need low < high and max_turns >= 1, got {self.low}, {self.high}, {self.max_turns}")

    def examples(self, seed: int) -> Iterator[Example]:
        rng = random.Random(seed)
        index = 0
        while True:
            secret = rng.randint(self.low, self.high)
            text = f"I am thinking of a number between {self.low} and {self.high}. Guess it; answer with one number."
            yield Example(prompt=[{"role": "user", "content": text}], answer=str(secret), info={"index": index})
            index += 1

    def respond(self, messages: list[dict[str, str]], example: Example) -> str | None:
        guess = last_guess(messages[-1]["content"])
        if guess is None:
            return f"Please answer with one number between {self.low} and {self.high}."
        secret = int(example.answer)
        if guess == secret:
            return None
        return "Higher." if guess < secret else "Lower."

    def score(self, conversation: list[dict[str, str]], example: Example) -> dict[str, float]:
        turns = [m["content"] for m in conversation if m["role"] == "assistant"]
        guesses = [last_guess(t) for t in turns]
        hit = next((i for i, g in enumerate(guesses) if g == int(example.answer)), None)
        reward = 0.0 if hit is None else max(0.5, 1.0 - self.turn_penalty * hit)
        valid = sum(g is not None for g in guesses) / max(1, len(guesses))
        return {"reward": reward, "turns": float(len(turns)), "valid_guesses": valid}


def load_environment(**args) -> GuessNumber:
    return GuessNumber(**args)
