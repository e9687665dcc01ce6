"""Environments: where prompts come from and how completions are scored (DESIGN §6).

An environment is any object with two methods:

    examples(seed) -> Iterator[Example]     # endless (or epoch-cycled), deterministic given the seed
    score(text, example) -> float           # reward of one completion, usually in [0, 1]

`load_environment(id, **args)` builds one from a built-in name (`reverse-text`) or an import path
`package.module:function`, so users can train on their own environments without touching this package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass
class Example:
    """One prompt: chat messages for the model, the reference answer, and anything else the scorer needs."""

    prompt: list[dict[str, str]]
    answer: str
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    def examples(self, seed: int) -> Iterator[Example]: ...

    def score(self, text: str, example: Example) -> float: ...


class EnvError(ValueError):
    """The environment id, its arguments or what it yields are wrong; the message says which."""


# Built-ins as import paths so that loading one environment never imports the others.
BUILTIN: dict[str, str] = {
    "reverse-text": "prime_rl.orchestrator.envs.reverse_text:load_environment",
}


def _resolve(path: str) -> Callable[..., Any]:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise EnvError(f"environment import path {path!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise EnvError(f"cannot import environment module {module_name!r} (from {path!r}): {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise EnvError(f"module {module_name!r} has no callable {attr!r} (from environment {path!r})")
    return factory


def load_environment(env_id: str, **args: Any) -> Environment:
    """Build the environment `env_id` (a built-in name or 'module:function') with keyword `args`."""
    if env_id in BUILTIN:
        factory = _resolve(BUILTIN[env_id])
    elif ":" in env_id:
        factory = _resolve(env_id)
    else:
        known = ", ".join(sorted(BUILTIN))
        raise EnvError(
            f"unknown environment {env_id!r}; built-ins are: {known} (or give an import path 'module:function')"
        )
    try:
        env = factory(**args)
    except (TypeError, ValueError) as e:
        raise EnvError(f"environment {env_id!r} rejected its arguments {args}: {e}") from None
    if not isinstance(env, Environment):
        raise EnvError(
            f"environment {env_id!r} built a {type(env).__name__}, which lacks examples(seed) and score(text, example)"
        )
    return env
