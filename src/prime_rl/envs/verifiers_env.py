"""`verifiers:<id>`: tasksets written for verifiers 0.4 (`import verifiers.v1 as vf`), played by our orchestrator.

verifiers 0.4 runs an episode by launching a harness program that talks to the model through its own
interception server. We keep the model on our side instead (exact token ids, our server pool) and take
from verifiers only what a taskset defines: its tasks, its tools, its stop hooks and its scoring. The
conversation is the one verifiers' plain chat loop (its `null` harness: the model and the task's tools) plays:

    system: task.system_prompt            user: task.prompt         (Example.prompt)
    assistant: text + tool_calls      →   respond(): one tool message per call, run on the task's Toolsets
    assistant: text, no tool_calls    →   respond(): None, the episode is over
    score(): the task's @vf.metric / @vf.reward hooks (and plugged judges) over a vf.Trace of the conversation

Loading. `verifiers:<taskset id>` goes through verifiers' own loader (`vf.resolve_env_config`,
`vf.load_taskset`): the id is an installed package (or any top-level module on the path) exporting its
`vf.Taskset` subclass in `__all__`; hub ids `owner/name@version` import `name`; the args are the taskset
config's fields. `verifiers:package.module:function` imports `function` and calls it with the args; it
returns a `vf.Taskset` (or a `vf.SingleAgentEnv`). `max_turns` (default 4) is ours, not the taskset's.
docs/orchestrator.md ("verifiers environments") has the full mapping.

Single-turn when the tasks have no tools (the chat loop then ends after the first reply); otherwise the
env has `respond`, `tools` (OpenAI function schemas) and `max_turns`.

Refused at load, with an EnvError naming the feature: an `Env` other than `SingleAgentEnv` (its `run()`
drives agents itself through `Agent.interaction()` / `Interaction.turn()`: user simulators, games,
multi-agent), a taskset that bundles its own `Harness` (the harness program drives the model), tasks that
need a runtime (`NEEDS_CONTAINER`, `setup`/`finalize`/`stage_verifier` overrides, hooks or judges taking
`runtime`), `@vf.intercept` hooks (they rewrite what the model sees or said), tasks without a prompt (a
user opens the conversation), and Toolsets with per-rollout state (a `vf.State` subclass, a `setup_task`
override) or placed elsewhere (`config.url`, a runtime other than subprocess): tools run in-process here.

This module owns the loading: a `verifiers:` id to a built taskset, the Env classes and harnesses refused
there, and the adapted environment (`load_verifiers_environment`, `adapt_taskset`). The environment classes
`VerifiersEnv` / `VerifiersToolEnv` (the other refusals, the examples, stop hooks and scoring) live in
verifiers_adapter and are importable from here; the conversion to and from verifiers' messages, traces,
responses and requests is verifiers_convert's; the in-process tool servers are verifiers_tools'.
"""

from __future__ import annotations

import importlib
from typing import Any

from prime_rl.envs.base import DEFAULT_MAX_TURNS, EnvError
from prime_rl.envs.verifiers_adapter import VerifiersEnv, VerifiersToolEnv
from prime_rl.envs.verifiers_convert import import_vf
from prime_rl.envs.verifiers_episodes import PLAYED_BY_VERIFIERS


def load_verifiers_environment(env_id: str, **args: Any) -> VerifiersEnv:
    """The verifiers taskset `env_id` (an installed taskset id, or 'module:function'), adapted to our protocol."""
    vf = import_vf(env_id)
    turns = int(args.pop("max_turns", DEFAULT_MAX_TURNS))
    if turns < 1:
        raise EnvError(f"verifiers:{env_id}: max_turns must be >= 1, got {turns}")
    taskset = _factory_taskset(vf, env_id, args) if ":" in env_id else _installed_taskset(vf, env_id, args)
    return adapt_taskset(taskset, env_id, turns)


def adapt_taskset(taskset: Any, env_id: str = "taskset", max_turns: int = DEFAULT_MAX_TURNS) -> VerifiersEnv:
    """A built vf.Taskset as one of our environments: multi-turn when its tasks have tools."""
    vf = import_vf(env_id)
    shared = list(type(taskset).toolsets(taskset.config))  # one server for the whole taskset
    per_task = list(type(taskset).task_type().toolsets(taskset.config.task))  # verifiers: one per rollout
    if shared or per_task:
        return VerifiersToolEnv(vf, taskset, env_id, shared, per_task, max_turns)
    return VerifiersEnv(vf, taskset, env_id)


def _installed_taskset(vf: Any, env_id: str, args: dict[str, Any]) -> Any:
    """verifiers' own loader: `env_id` is the taskset id, `args` its config fields."""
    try:
        config = vf.resolve_env_config({"taskset": {"id": env_id, **args}})
        env_cls = vf.environment_class(config.taskset.id, config.id)
        harness = vf.default_harness_id(config.taskset.id)
    except Exception as e:
        raise EnvError(f"verifiers could not load taskset {env_id!r} with {args}: {type(e).__name__}: {e}") from None
    _refuse_env_class(vf, env_id, env_cls)
    if harness != "bash":  # bash is verifiers' default for a taskset that ships no harness
        raise EnvError(
            f"verifiers:{env_id}: the taskset bundles its own harness {harness!r}, a program that drives the model "
            f"itself; prime-rl plays the conversation turn by turn and cannot run it; {PLAYED_BY_VERIFIERS}"
        )
    try:
        return vf.load_taskset(config.taskset)
    except Exception as e:
        raise EnvError(f"verifiers could not build taskset {env_id!r}: {type(e).__name__}: {e}") from None


def _factory_taskset(vf: Any, env_id: str, args: dict[str, Any]) -> Any:
    """`package.module:function` returning a vf.Taskset (or a vf.SingleAgentEnv)."""
    module_name, _, attr = env_id.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr, None)
    except ImportError as e:
        raise EnvError(f"verifiers:{env_id}: cannot import {module_name!r}: {e}") from None
    if not callable(factory):
        raise EnvError(f"verifiers:{env_id}: module {module_name!r} has no callable {attr!r}")
    try:
        built = factory(**args)
    except (TypeError, ValueError) as e:
        raise EnvError(f"verifiers:{env_id} rejected its arguments {args}: {type(e).__name__}: {e}") from None
    if isinstance(built, vf.Env):
        _refuse_env_class(vf, env_id, type(built))
        built = built.taskset
    if not isinstance(built, vf.Taskset):
        raise EnvError(f"verifiers:{env_id} returned a {type(built).__name__}; expected a vf.Taskset")
    return built


def _refuse_env_class(vf: Any, env_id: str, env_cls: type) -> None:
    if env_cls is not vf.SingleAgentEnv:
        raise EnvError(
            f"verifiers:{env_id}: its environment {env_cls.__name__} defines its own Env.run(), which drives the "
            f"agents itself (Agent.interaction() / Interaction.turn(): a user simulator, a game engine, several "
            f"agents); prime-rl only plays single-agent tasksets (vf.SingleAgentEnv); {PLAYED_BY_VERIFIERS}"
        )
