"""Environments: where prompts come from and how completions are scored (docs/design.md §6).

An environment is any object with two methods:

    examples(seed) -> Iterator[Example]         # endless (or epoch-cycled), deterministic given the seed
    score(completion, example) -> float | dict  # reward of one rollout; a dict holds "reward" plus any
                                                # other per-rollout metrics, logged as reward/<name>

`completion` is the model's text for single-turn environments. An environment is multi-turn when it also
has `respond(messages, example)`: after each model turn it gets the whole conversation (prompt + model and
env messages so far) and answers with the next user message (a str), a list of messages (e.g. `role:
"tool"` results, one per call, with its `tool_call_id`), or None when the episode is over (at the latest
after `max_turns` model turns, an attribute, default 4). A multi-turn environment's `score` receives the
conversation after the prompt (a list of chat messages) instead of text. Env messages are tokens of the
trained sequence but are masked from the loss. `score` and `respond` may be `async def`.

Tool use: an environment with a `tools` attribute (OpenAI function schemas, `[{"type": "function",
"function": {"name", "description", "parameters"}}]`) gets it sent with its requests; the assistant
messages it sees carry the model's parsed `tool_calls` (arguments as a JSON string, as OpenAI sends them).

`load_environment(id, **args)` builds one from a built-in name (`reverse-text`, `arithmetic`,
`guess-number`, `dataset`), an import path `package.module:function`, or `verifiers:<env id>` when the
optional `verifiers` package is installed; `verifiers-env` is an environment whose episodes verifiers plays itself
(its args: verifiers' env config; envs/verifiers_episodes.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from prime_rl.envs.base import (
    DEFAULT_MAX_TURNS,
    EnvError,
    Environment,
    EpisodeFailed,
    Example,
    is_multi_turn,
    max_turns,
    shuffled_forever,
    split_score,
)

__all__ = [
    "DEFAULT_MAX_TURNS",
    "EnvError",
    "Environment",
    "EpisodeFailed",
    "Example",
    "is_multi_turn",
    "max_turns",
    "shuffled_forever",
    "split_score",
    "BUILTIN",
    "environment_factory",
    "load_environment",
]

# Built-ins as import paths so that loading one environment never imports the others.
BUILTIN: dict[str, str] = {
    "reverse-text": "prime_rl.envs.reverse_text:load_environment",
    "arithmetic": "prime_rl.envs.arithmetic:load_environment",
    "guess-number": "prime_rl.envs.guess_number:load_environment",
    "dataset": "prime_rl.envs.dataset:load_environment",
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


def environment_factory(env_id: str) -> Callable[..., Any]:
    """What builds `env_id` (built-in name, 'module:function' or 'verifiers:<id>'); EnvError if nothing does.
    Cheap (imports the module only): a launcher checks its ids before it starts any service."""
    if env_id == "verifiers-env":
        from prime_rl.envs.verifiers_episodes import load_episode_env

        return load_episode_env
    if env_id.startswith("verifiers:"):
        from prime_rl.envs.verifiers_env import load_verifiers_environment

        return lambda **kw: load_verifiers_environment(env_id.removeprefix("verifiers:"), **kw)
    if env_id in BUILTIN:
        return _resolve(BUILTIN[env_id])
    if ":" in env_id:
        return _resolve(env_id)
    known = ", ".join(sorted(BUILTIN))
    raise EnvError(f"unknown environment {env_id!r}; built-ins are: {known} (or give an import path 'module:function')")


def load_environment(env_id: str, **args: Any) -> Environment:
    """Build the environment `env_id` (see `environment_factory`) with `args`."""
    factory = environment_factory(env_id)
    try:
        env = factory(**args)
    except (TypeError, ValueError) as e:
        if isinstance(e, EnvError):
            raise
        raise EnvError(f"environment {env_id!r} rejected its arguments {args}: {e}") from None
    if not isinstance(env, Environment):
        raise EnvError(
            f"environment {env_id!r} built a {type(env).__name__}, which lacks examples(seed) and "
            f"score(completion, example)"
        )
    return env
