"""The environment classes over a built vf.Taskset: what we refuse in it, its tasks as examples, its hooks as the score.

`VerifiersEnv` (single-turn) checks the taskset's first task and its Toolsets for what prime-rl cannot
play (the list is in verifiers_env's doc), sorts the task's @vf.stop hooks by what they inspect, yields
the tasks as Examples, and scores a conversation with the task's @vf.metric / @vf.reward hooks and plugged
judges. `VerifiersToolEnv` adds the tool turns: `respond` answers the model's tool calls with the task's
Toolsets (served by verifiers_tools) unless a @vf.stop hook ends the episode. The translation to and from
verifiers' objects is verifiers_convert's; loading a taskset is verifiers_env's.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterator
from typing import Any

from prime_rl.envs.base import EnvError, Example
from prime_rl.envs.verifiers_convert import (
    conversation_trace,
    full_conversation,
    load_tasks,
    model_response,
    next_request,
    task_example,
    task_order,
)
from prime_rl.envs.verifiers_episodes import PLAYED_BY_VERIFIERS
from prime_rl.envs.verifiers_tools import ToolServers


def _requires_runtime(fn: Any) -> bool:
    """verifiers' rule (Task.score): a hook needs a runtime when it has a `runtime` parameter without default."""
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


class VerifiersEnv:
    """A single-turn verifiers taskset: its tasks as examples, its hooks as the score."""

    def __init__(self, vf: Any, taskset: Any, env_id: str, shared: list | None = None, per_task: list | None = None):
        from verifiers.v1.state import state_cls

        self.vf, self.taskset, self.env_id = vf, taskset, env_id
        self._state_cls = state_cls
        self.task_cls = type(taskset).task_type()
        self.data_cls = self.task_cls.data_type()
        self.task_config = taskset.config.task
        self.tasks, first = load_tasks(taskset, f"verifiers:{env_id}: its taskset")
        self._refuse_task(first)
        self.stops = self._stop_hooks(first)
        self.toolsets = self._check_toolsets(shared or [], per_task or [])
        self._tool_servers = ToolServers(self.toolsets, env_id)
        self.tools = self._tool_servers.schemas

    # --- what we refuse ---------------------------------------------------------------------------------

    def _refuse(self, feature: str, why: str) -> None:
        raise EnvError(f"verifiers:{self.env_id}: {feature} is not supported: {why}; {PLAYED_BY_VERIFIERS}")

    def _refuse_task(self, task: Any) -> None:
        vf, cls = self.vf, self.task_cls
        if cls.NEEDS_CONTAINER:
            self._refuse(f"task {cls.__name__} (NEEDS_CONTAINER)", "it runs in a container runtime")
        overridden = [h for h in ("setup", "finalize", "stage_verifier") if getattr(cls, h) is not getattr(vf.Task, h)]
        if overridden:
            self._refuse(f"task {cls.__name__}.{'/'.join(overridden)}()", "it prepares a runtime (sandbox)")
        from verifiers.v1.utils.decorators import discover_decorated

        if intercepts := [fn.__name__ for fn in discover_decorated(task, "intercept")]:
            self._refuse(
                f"@vf.intercept hooks {intercepts}",
                "they rewrite requests or responses, so the tokens trained on would differ from what the model saw",
            )
        needs = [fn.__name__ for kind in ("metric", "reward") for fn in task.hooks(kind) if _requires_runtime(fn)]
        needs += [j.reward_name for j in task.plugged_judges() if _requires_runtime(j.score)]
        if needs:
            self._refuse(f"scoring hooks {needs}", "they read a runtime (sandbox) that prime-rl does not provide")
        if task.data.prompt is None:
            self._refuse("a task without a prompt", "the user opens the conversation (a user simulator)")

    def _stop_hooks(self, task: Any) -> dict[type, list[Any]]:
        """The task's @vf.stop hooks by what they inspect: Request, Response or Trace (verifiers' own rule)."""
        from verifiers.v1.session import hook_boundary

        stops: dict[type, list[Any]] = {self.vf.Request: [], self.vf.Response: [], self.vf.Trace: []}
        for fn in task.hooks("stop"):
            try:
                stops[hook_boundary(fn, allow_trace=True)].append(fn)
            except TypeError as e:
                raise EnvError(f"verifiers:{self.env_id}: @vf.stop {fn.__name__}: {e}") from None
        return stops

    def _check_toolsets(self, shared: list[Any], per_task: list[Any]) -> list[Any]:
        """The taskset's shared Toolsets and the task's per-rollout ones, if they can run in-process here."""
        from verifiers.v1.mcp import ServerBase
        from verifiers.v1.runtimes import SubprocessConfig

        for toolset in [*shared, *per_task]:
            name = f"Toolset {type(toolset).__name__}"
            if self._state_cls(type(toolset)) is not self.vf.State:
                self._refuse(f"{name} with state", "its vf.State is per rollout and prime-rl runs tools in-process")
            if getattr(toolset.config, "url", None):
                self._refuse(f"{name} at {toolset.config.url}", "remote tool servers are not called from prime-rl")
            runtime = getattr(toolset.config, "runtime", None)
            if runtime is not None and not isinstance(runtime, SubprocessConfig):
                self._refuse(f"{name} in a {runtime.type} runtime", "prime-rl runs tools in-process")
        for toolset in per_task:
            if type(toolset).setup_task is not ServerBase.setup_task:
                self._refuse(
                    f"Toolset {type(toolset).__name__}.setup_task()", "it builds per-rollout state on the tool server"
                )
        return [*shared, *per_task]

    # --- examples ---------------------------------------------------------------------------------------

    def examples(self, seed: int) -> Iterator[Example]:
        for task in task_order(self.taskset, self.tasks, seed):
            yield self.example(task)

    def example(self, task: Any) -> Example:
        """The chat messages verifiers' chat loop opens with: the system prompt, then the task's prompt."""
        if task.data.prompt is None:
            self._refuse("a task without a prompt", "the user opens the conversation (a user simulator)")
        return task_example(task)

    def task(self, example: Example) -> Any:
        """The task behind `example`, rebuilt from its data and the taskset's task config (verifiers' wire rule)."""
        return self.task_cls(self.data_cls.model_validate(example.info), self.task_config)

    # --- the conversation as verifiers sees it ----------------------------------------------------------

    def trace(self, task: Any, conversation: list[dict[str, Any]], prompt_len: int) -> Any:
        """A vf.Trace of `conversation` (one branch); assistant messages after the prompt are the sampled turns."""
        return conversation_trace(self.vf, task, conversation, prompt_len, self.tools)

    def conversation(self, completion: str | list[dict[str, Any]], example: Example) -> list[dict[str, Any]]:
        return full_conversation(completion, example)

    # --- scoring ----------------------------------------------------------------------------------------

    async def score(self, completion: str | list[dict[str, Any]], example: Example) -> dict[str, float]:
        """The task's metrics and rewards over the conversation: reward = Σ weight·score, each one also a metric."""
        task = self.task(example)
        conversation = self.conversation(completion, example)
        trace = self.trace(task, conversation, len(example.prompt))
        last = trace.last_message
        if last.role != "assistant":
            trace.stop("max_total_tokens")  # cut after an env reply: no room for another turn
        else:
            trace.stop("max_turns" if last.tool_calls else "agent_completed")
        if type(task).score is not self.vf.Task.score:
            await task.score(trace, None)  # the task's own scoring
        else:
            await self._score(task, trace)
        metrics = {name: float(v) for name, v in trace.metrics.items() if v is not None}
        metrics |= {name: r.score for name, r in trace.rewards.items() if r is not None}
        return {**metrics, "reward": trace.reward}

    async def _score(self, task: Any, trace: Any) -> None:
        """vf.Task.score's recording, but a hook may be sync or async (verifiers 0.4 itself needs async hooks)."""
        from verifiers.v1.utils.decorators import invoke

        available = {"task": task.data, "trace": trace}

        async def call(fn: Any) -> Any:
            try:
                result = invoke(fn, available)
                return await result if inspect.isawaitable(result) else result
            except Exception as e:
                raise EnvError(f"verifiers:{self.env_id}: {fn.__name__} failed: {type(e).__name__}: {e}") from e

        metrics, rewards, judges = task.hooks("metric"), task.hooks("reward"), task.plugged_judges()
        for fn, result in zip(metrics, await asyncio.gather(*map(call, metrics)), strict=True):
            if isinstance(result, dict):
                trace.record_metrics(result)
            else:
                trace.record_metric(fn.__name__, result)
        weights = [getattr(fn, "_vf_weight", 1.0) for fn in rewards] + [j.config.weight for j in judges]
        names = [fn.__name__ for fn in rewards] + [j.reward_name for j in judges]
        results = await asyncio.gather(*map(call, [*rewards, *(j.score for j in judges)]))
        for name, weight, result in zip(names, weights, results, strict=True):
            for key, value in result.items() if isinstance(result, dict) else [(name, result)]:
                trace.record_reward(key, value, weight)

    # --- tools --------------------------------------------------------------------------------------------

    async def call_tool(self, call: dict[str, Any]) -> dict[str, Any]:
        """One tool message for one OpenAI tool call; every failure becomes the message's text, as in verifiers."""
        return await self._tool_servers.call(call)


class VerifiersToolEnv(VerifiersEnv):
    """A verifiers taskset with tools: multi-turn, the model's tool calls answered by the task's Toolsets."""

    def __init__(self, vf: Any, taskset: Any, env_id: str, shared: list, per_task: list, max_turns: int):
        super().__init__(vf, taskset, env_id, shared, per_task)
        self.max_turns = max_turns

    async def respond(self, messages: list[dict[str, Any]], example: Example) -> list[dict[str, Any]] | None:
        """Tool messages for the calls on the model's last message; None when it called none, or a @vf.stop fired."""
        vf, last = self.vf, messages[-1]
        calls = last.get("tool_calls") or []
        prompt_len = len(example.prompt)
        if self.stops[vf.Response]:
            response = model_response(vf, last)
            if await self._stopped(self.stops[vf.Response], {vf.Response: response}, messages, example):
                return None
        if not calls:
            return None
        results = [await self.call_tool(call) for call in calls]
        if self.stops[vf.Trace] or self.stops[vf.Request]:
            trace = self.trace(self.task(example), messages, prompt_len)
            if await self._stopped(self.stops[vf.Trace], {vf.Trace: trace}, messages, example, trace):
                return None
            request = next_request(vf, [*messages, *results], trace.tools)
            if await self._stopped(self.stops[vf.Request], {vf.Request: request}, messages, example, trace):
                return None
        return results

    async def _stopped(self, hooks: list[Any], given: dict[type, Any], messages: list[dict[str, Any]],
                       example: Example, trace: Any = None) -> bool:  # fmt: skip
        from verifiers.v1.session import call_hook

        if not hooks:
            return False
        trace = trace if trace is not None else self.trace(self.task(example), messages, len(example.prompt))
        for hook in hooks:
            result = await call_hook(hook, {self.vf.Trace: trace, **given})
            if not isinstance(result, bool):
                raise EnvError(f"verifiers:{self.env_id}: @vf.stop {hook.__name__} returned {result!r}, not a bool")
            if result:
                return True
        return False
