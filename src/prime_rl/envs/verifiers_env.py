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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import json
from collections.abc import Coroutine, Iterator
from typing import Any

from prime_rl.envs import DEFAULT_MAX_TURNS, EnvError, Example, shuffled_forever

INSTALL_HINT = "uv sync --extra verifiers (or pip install verifiers==0.4.0), plus the taskset's own package"


def _import_vf(env_id: str) -> Any:
    try:
        import verifiers
    except ImportError:
        raise EnvError(
            f"environment 'verifiers:{env_id}' needs the optional 'verifiers' package, which is not installed "
            f"({INSTALL_HINT})"
        ) from None
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        found = getattr(verifiers, "__version__", "unknown")
        raise EnvError(
            f"environment 'verifiers:{env_id}' needs verifiers 0.4 (its verifiers.v1 stack); the installed "
            f"verifiers {found} has none ({type(e).__name__}: {e}); {INSTALL_HINT}"
        ) from None
    return vf


def load_verifiers_environment(env_id: str, **args: Any) -> VerifiersEnv:
    """The verifiers taskset `env_id` (an installed taskset id, or 'module:function'), adapted to our protocol."""
    vf = _import_vf(env_id)
    turns = int(args.pop("max_turns", DEFAULT_MAX_TURNS))
    if turns < 1:
        raise EnvError(f"verifiers:{env_id}: max_turns must be >= 1, got {turns}")
    taskset = _factory_taskset(vf, env_id, args) if ":" in env_id else _installed_taskset(vf, env_id, args)
    return adapt_taskset(taskset, env_id, turns)


def adapt_taskset(taskset: Any, env_id: str = "taskset", max_turns: int = DEFAULT_MAX_TURNS) -> VerifiersEnv:
    """A built vf.Taskset as one of our environments: multi-turn when its tasks have tools."""
    vf = _import_vf(env_id)
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
            f"itself; prime-rl plays the conversation turn by turn and cannot run it"
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
            f"agents); prime-rl only plays single-agent tasksets (vf.SingleAgentEnv)"
        )


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run `coro` to completion from sync code, also when called inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _requires_runtime(fn: Any) -> bool:
    """verifiers' rule (Task.score): a hook needs a runtime when it has a `runtime` parameter without default."""
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def _drop_derived_titles(schema: Any, derived: str) -> Any:
    """`schema` without the `title` keys pydantic derives from names (`addArguments`, `A` for property `a`).

    MCP builds a tool's parameters from its signature with pydantic, which titles the object and each
    property after their names: tokens in every prompt that say nothing. Other titles stay.

    >>> _drop_derived_titles({"title": "addArguments", "properties": {"a": {"title": "A", "type": "integer"}}},
    ...                      "addArguments")
    {'properties': {'a': {'type': 'integer'}}}
    """
    if not isinstance(schema, dict):
        return schema
    out = {k: v for k, v in schema.items() if not (k == "title" and v == derived)}
    if isinstance(out.get("properties"), dict):
        out["properties"] = {
            name: _drop_derived_titles(sub, name.replace("_", " ").title()) for name, sub in out["properties"].items()
        }
    return out


class VerifiersEnv:
    """A single-turn verifiers taskset: its tasks as examples, its hooks as the score."""

    def __init__(self, vf: Any, taskset: Any, env_id: str, shared: list | None = None, per_task: list | None = None):
        from verifiers.v1.dialects.chat import message_to_wire, parse_message
        from verifiers.v1.state import state_cls

        self.vf, self.taskset, self.env_id = vf, taskset, env_id
        self._parse_message, self._message_to_wire, self._state_cls = parse_message, message_to_wire, state_cls
        self.task_cls = type(taskset).task_type()
        self.data_cls = self.task_cls.data_type()
        self.task_config = taskset.config.task
        try:
            # Bounded tasksets are materialised once and reshuffled per epoch; unbounded ones stream in their order.
            self.tasks = list(taskset) if taskset.bounded else None
            first = next(iter(self.tasks if self.tasks is not None else taskset), None)
        except Exception as e:
            raise EnvError(f"verifiers:{env_id}: its taskset failed to load: {type(e).__name__}: {e}") from None
        if first is None:
            raise EnvError(f"verifiers:{env_id}: its taskset yielded no tasks")
        self._refuse_task(first)
        self.stops = self._stop_hooks(first)
        self.toolsets = self._check_toolsets(shared or [], per_task or [])
        self.tools, self._dispatch, self._servers = self._list_tools()
        self._setups: dict[int, asyncio.Future] = {}

    # --- what we refuse ---------------------------------------------------------------------------------

    def _refuse(self, feature: str, why: str) -> None:
        raise EnvError(f"verifiers:{self.env_id}: {feature} is not supported: {why}")

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

    def _list_tools(self) -> tuple[list[dict[str, Any]], dict[str, tuple[int, str]], list[Any]]:
        """OpenAI function schemas of every tool, named as verifiers' chat loop names them (`<server>_<tool>`)."""
        if not self.toolsets:
            return [], {}, []
        from mcp.server.mcpserver import MCPServer

        servers = []
        for toolset in self.toolsets:
            server = MCPServer(toolset.server_name or type(toolset).__name__)
            toolset.register(server)
            servers.append(server)

        async def list_all() -> list[list[Any]]:
            return [await server.list_tools() for server in servers]

        schemas, dispatch = [], {}
        for index, (toolset, listed) in enumerate(zip(self.toolsets, _run(list_all()), strict=True)):
            for tool in listed:
                full = f"{toolset.server_name}_{tool.name}" if toolset.server_name else tool.name
                if full in dispatch:
                    raise EnvError(f"verifiers:{self.env_id}: two tools are named {full!r}; give one a TOOL_PREFIX")
                dispatch[full] = (index, tool.name)
                parameters = _drop_derived_titles(tool.input_schema, f"{tool.name}Arguments")
                schemas.append(
                    {"type": "function", "function": {"name": full, "description": tool.description or "",
                                                      "parameters": parameters}}
                )  # fmt: skip
        return schemas, dispatch, servers

    # --- examples ---------------------------------------------------------------------------------------

    def examples(self, seed: int) -> Iterator[Example]:
        tasks = shuffled_forever(self.tasks, seed) if self.tasks is not None else iter(self.taskset)
        for task in tasks:
            yield self.example(task)

    def example(self, task: Any) -> Example:
        """The chat messages verifiers' chat loop opens with: the system prompt, then the task's prompt."""
        data = task.data
        prompt: list[dict[str, Any]] = []
        if data.system_prompt:
            prompt.append({"role": "system", "content": data.system_prompt})
        if isinstance(data.prompt, str):
            prompt.append({"role": "user", "content": data.prompt})
        elif data.prompt is not None:
            prompt += [self._message_to_wire(m) for m in data.prompt]
        else:
            self._refuse("a task without a prompt", "the user opens the conversation (a user simulator)")
        answer = getattr(data, "answer", "")
        return Example(prompt=prompt, answer="" if answer is None else str(answer),
                       info=data.model_dump(mode="json", exclude_defaults=True))  # fmt: skip

    def task(self, example: Example) -> Any:
        """The task behind `example`, rebuilt from its data and the taskset's task config (verifiers' wire rule)."""
        return self.task_cls(self.data_cls.model_validate(example.info), self.task_config)

    # --- the conversation as verifiers sees it ----------------------------------------------------------

    def trace(self, task: Any, conversation: list[dict[str, Any]], prompt_len: int) -> Any:
        """A vf.Trace of `conversation` (one branch); assistant messages after the prompt are the sampled turns."""
        vf = self.vf
        tools = [vf.Tool(name=t["function"]["name"], description=t["function"]["description"],
                         parameters=t["function"]["parameters"]) for t in self.tools]  # fmt: skip
        trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=vf.AgentInfo(config=vf.AgentConfig()),
            state=self._state_cls(type(task))(),
            tools=tools,
        )
        for i, raw in enumerate(conversation):
            message = self._parse_message(raw)
            sampled = i >= prompt_len and message.role == "assistant"
            trace.nodes.append(
                vf.MessageNode(parent=i - 1 if i else None, message=message, sampled=sampled,
                               tools=tools if i == 0 else [])
            )  # fmt: skip
            if sampled:
                finish = "tool_calls" if message.tool_calls else "stop"
                trace.calls.append(vf.ModelCall(node=i, finish_reason=finish))
        return trace

    def conversation(self, completion: str | list[dict[str, Any]], example: Example) -> list[dict[str, Any]]:
        prompt = list(example.prompt)
        if isinstance(completion, str):
            return [*prompt, {"role": "assistant", "content": completion}]
        return [*prompt, *completion]

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
        from mcp.client import Client
        from verifiers.v1.harnesses.utils.compaction import truncate_tool_output

        function = call.get("function") or {}
        name = str(function.get("name", ""))
        message = {"role": "tool", "tool_call_id": str(call.get("id", "")), "content": "", "name": name}
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError) as e:
            message["content"] = f"error: invalid JSON in tool arguments ({e}); resend the call with valid JSON"
            return message
        if not isinstance(arguments, dict):
            kind = type(arguments).__name__
            message["content"] = f"error: tool arguments must be a JSON object, got {kind}; resend as an object"
            return message
        if name not in self._dispatch:
            message["content"] = f"error: unknown tool {name!r}"
            return message
        index, raw = self._dispatch[name]
        try:
            await self._setup(index)
            async with Client(self._servers[index]) as client:
                result = await client.call_tool(raw, arguments)
            text = "\n".join(b.text if b.type == "text" else f"[{b.type} content omitted]" for b in result.content)
        except Exception as e:
            text = f"error: tool {name!r} failed: {type(e).__name__}: {e}"
        message["content"] = truncate_tool_output(text)
        return message

    async def _setup(self, index: int) -> None:
        """Toolset.setup() once, on first use, in the loop that calls the tools (its resources live there)."""
        if index not in self._setups:
            self._setups[index] = asyncio.ensure_future(self.toolsets[index].setup())
        await self._setups[index]


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
            message = self._parse_message(last)
            response = vf.Response(id="", created=0, model="", message=message,
                                   finish_reason="tool_calls" if calls else "stop")  # fmt: skip
            if await self._stopped(self.stops[vf.Response], {vf.Response: response}, messages, example):
                return None
        if not calls:
            return None
        results = [await self.call_tool(call) for call in calls]
        if self.stops[vf.Trace] or self.stops[vf.Request]:
            trace = self.trace(self.task(example), messages, prompt_len)
            if await self._stopped(self.stops[vf.Trace], {vf.Trace: trace}, messages, example, trace):
                return None
            request = vf.Request(messages=[self._parse_message(m) for m in [*messages, *results]],
                                 tools=trace.tools or None)  # fmt: skip
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
