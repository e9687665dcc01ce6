"""`reverse-text`: the model must write the user's text backwards, character by character.

Examples are random lowercase words generated offline from a seed, so the task needs no dataset download
and the same seed always yields the same prompts. The reward is the similarity of the completion to the
reversed text (difflib ratio, 1.0 for an exact answer), which gives a dense signal even to a tiny model:

    text "ab cd"  →  answer "dc ba"
    score("dc ba") = 1.0,   score("dc b") = 2·4/9 ≈ 0.89,   score("xyz") = 0.0
"""

from __future__ import annotations

import difflib
import random
import string
from collections.abc import Iterator
from dataclasses import dataclass

from prime_rl.envs.base import Example

SYSTEM_PROMPT = "Reverse the text character by character."


@dataclass
class ReverseText:
    min_chars: int = 8
    max_chars: int = 32
    min_word: int = 2
    max_word: int = 7

    def __post_init__(self) -> None:
        if not 1 <= self.min_chars <= self.max_chars:
            raise ValueError(f"need 1 <= min_chars <= max_chars, got {self.min_chars}, {self.max_chars}")
        if not 1 <= self.min_word <= self.max_word:
            raise ValueError(f"need 1 <= min_word <= max_word, got {self.min_word}, {self.max_word}")

    def make_text(self, rng: random.Random) -> str:
        target = rng.randint(self.min_chars, self.max_chars)
        words: list[str] = []
        while len(" ".join(words)) < target:
            words.append("".join(rng.choices(string.ascii_lowercase, k=rng.randint(self.min_word, self.max_word))))
        # Cut to the drawn length so lengths spread evenly over the range; never end on a space.
        return " ".join(words)[:target].strip()

    def examples(self, seed: int) -> Iterator[Example]:
        rng = random.Random(seed)
        index = 0
        while True:
            text = self.make_text(rng)
            prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]
            yield Example(prompt=prompt, answer=text[::-1], info={"text": text, "index": index})
            index += 1

    def score(self, text: str, example: Example) -> float:
        return difflib.SequenceMatcher(None, text.strip(), example.answer, autojunk=False).ratio()


def load_environment(**args) -> ReverseText:
    return ReverseText(**args)
