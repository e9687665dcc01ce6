"""`arithmetic`: generated integer problems ("What is 37 * 4 - 12?") with an exact-answer checker.

Problems are drawn offline from a seed. The checker takes the model's final answer: the content of the
last `\\boxed{...}` if there is one, else the last integer in the text, and compares it exactly:

    "37 * 4 = 148, minus 12 is 136"   → 136 → reward 1.0 for answer 136
    "the answer is \\boxed{-5}."      → -5
    "no idea"                          → None → reward 0.0, metric has_answer 0.0
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

from prime_rl.envs.base import Example

SYSTEM_PROMPT = "Solve the arithmetic problem. End with the final answer as an integer."
_BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")
_INTEGER = re.compile(r"-?\d+")


def parse_final_answer(text: str) -> int | None:
    boxed = _BOXED.findall(text)
    if boxed:
        return int(boxed[-1])
    numbers = _INTEGER.findall(text.replace(",", ""))
    return int(numbers[-1]) if numbers else None


@dataclass
class Arithmetic:
    min_value: int = 0
    max_value: int = 99
    max_terms: int = 2
    ops: str = "+-*"
    chat: bool = True  # chat messages; False = a plain text prompt for /v1/completions

    def __post_init__(self) -> None:
        if self.min_value > self.max_value:
            raise ValueError(f"need min_value <= max_value, got {self.min_value}, {self.max_value}")
        if self.max_terms < 2 or not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"need max_terms >= 2 and ops from '+-*', got {self.max_terms}, {self.ops!r}")

    def make_problem(self, rng: random.Random) -> str:
        terms = [str(rng.randint(self.min_value, self.max_value)) for _ in range(rng.randint(2, self.max_terms))]
        expression = terms[0]
        for term in terms[1:]:
            expression += f" {rng.choice(self.ops)} {term}"
        return expression

    def examples(self, seed: int) -> Iterator[Example]:
        rng = random.Random(seed)
        index = 0
        while True:
            expression = self.make_problem(rng)
            answer = str(eval(expression, {"__builtins__": {}}))  # digits and + - * only, built just above
            question = f"What is {expression}?"
            prompt = (
                [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
                if self.chat
                else f"{SYSTEM_PROMPT}\nQuestion: {question}\nAnswer:"
            )
            yield Example(prompt=prompt, answer=answer, info={"expression": expression, "index": index})
            index += 1

    def score(self, completion: str, example: Example) -> dict[str, float]:
        guess = parse_final_answer(completion)
        correct = guess is not None and str(guess) == example.answer
        return {"reward": float(correct), "has_answer": float(guess is not None)}


def load_environment(**args) -> Arithmetic:
    return Arithmetic(**args)
