"""What every environment is: the `Example` it yields, the `Environment` protocol, its errors, and the helpers
the built-in and adapted environments share (docs/design.md §6; the package docstring has the whole contract).
Environments import these from here, never from the package, whose registry imports them."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

DEFAULT_MAX_TURNS = 4


@dataclass
class Example:
    """One prompt (plain text, or chat messages), the reference answer, and anything else the scorer needs."""

    prompt: str | list[dict[str, str]]
    answer: str = ""
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    def examples(self, seed: int) -> Iterator[Example]: ...

    def score(self, completion: Any, example: Example) -> float | dict[str, float]: ...  # or async


class EnvError(ValueError):
    """The environment id, its arguments or what it yields are wrong; the message says which."""


class EpisodeFailed(EnvError):
    """One episode failed in the environment's own code (a harness, tool or scorer; verifiers recorded why): its
    group is dropped and counted, and the run goes on until too many fail in a row (max_env_errors)."""


def shuffled_forever(rows: list, seed: int) -> Iterator[Any]:
    """The rows in a fresh seeded order each epoch, without end (datasets become example streams)."""
    rng = random.Random(seed)
    order = list(range(len(rows)))
    while True:
        rng.shuffle(order)
        for i in order:
            yield rows[i]


def is_multi_turn(env: Environment) -> bool:
    return callable(getattr(env, "respond", None))


def max_turns(env: Environment) -> int:
    return int(getattr(env, "max_turns", DEFAULT_MAX_TURNS))


def split_score(value: Any, env_id: str = "environment") -> tuple[float, dict[str, float]]:
    """(reward, other metrics) from what `score` returned: a number, or a dict with a "reward" key.

    >>> split_score({"reward": 1, "format": 0.5})
    (1.0, {'format': 0.5})
    """
    if isinstance(value, dict):
        if "reward" not in value:
            raise EnvError(f"{env_id}: score() returned a dict without a 'reward' key: {sorted(value)}")
        metrics = {str(k): float(v) for k, v in value.items() if k != "reward"}
        reward = float(value["reward"])
    else:
        try:
            reward, metrics = float(value), {}
        except (TypeError, ValueError):
            raise EnvError(f"{env_id}: score() returned {value!r}, expected a number or a dict") from None
    if not math.isfinite(reward):
        raise EnvError(f"{env_id}: score() returned a non-finite reward {reward}")
    return reward, metrics
