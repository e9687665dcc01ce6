"""`reverse-text`: the model must write the user's text backwards, character by character.

Examples are random lowercase words generated offline from a seed, so the task needs no dataset download
and the same seed always yields the same prompts. The reward is the similarity of the completion to the
reversed text (difflib ratio, 1.0 for an exact answer), which gives a dense signal even to a tiny model:

    text "ab cd"  →  answer "dc ba"
    score("dc ba") = 1.0,   score("dc b") = 2·4/9 ≈ 0.89,   score("xyz") = 0.0

`typo_rate` makes the reference answers those of an imperfect demonstrator: each character of the answer is
replaced by a random letter with that probability (the text and the score stay exact). SFT on them learns
the task and the demonstrator's slips; RL, scored on the true reversal, can then do better than its teacher.
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
    typo_rate: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.typo_rate < 1.0:
            raise ValueError(f"need 0 <= typo_rate < 1, got {self.typo_rate}")
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
        slips = random.Random(f"typos-{seed}")  # its own stream: the texts of a seed never depend on the rate
        index = 0
        while True:
            text = self.make_text(rng)
            prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]
            yield Example(prompt=prompt, answer=self.demonstrate(text, slips), info={"text": text, "index": index})
            index += 1

    def demonstrate(self, text: str, rng: random.Random) -> str:
        """The reference answer: the reversal, each character slipped to a random letter at `typo_rate`."""
        if not self.typo_rate:
            return text[::-1]
        return "".join(rng.choice(string.ascii_lowercase) if rng.random() < self.typo_rate else c for c in text[::-1])

    def score(self, text: str, example: Example) -> float:
        return similarity(text, example.info["text"][::-1] if "text" in example.info else example.answer)


def similarity(text: str, target: str) -> float:
    """The reward: difflib's ratio of the stripped reply to the reversed text (1.0 when exact)."""
    return difflib.SequenceMatcher(None, text.strip(), target, autojunk=False).ratio()


def load_environment(**args) -> ReverseText:
    return ReverseText(**args)
