"""Our chat messages and Examples as verifiers 0.4's objects: the conversion both ways, by verifiers' rules.

Our side: OpenAI-style chat dicts (`role`, `content`, `tool_calls`) and `Example` (the prompt messages, the
answer, the task's data as `info`). verifiers' side, through its chat dialect (`parse_message`,
`message_to_wire`): a task's prompt, and what its hooks inspect: a `vf.Trace` of the conversation (one
branch of message nodes, the model's sampled turns as its calls), the `vf.Response` of the model's last
message and the `vf.Request` of the next turn. What a taskset may not do is refused elsewhere
(verifiers_adapter); these functions only translate (and import verifiers, `import_vf`, and read a taskset's
tasks, `load_tasks` and `task_order`, for both ways verifiers tasksets are played here).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prime_rl.envs.base import EnvError, Example, shuffled_forever

INSTALL_HINT = "uv sync --extra verifiers (or pip install verifiers==0.4.0), plus the taskset's own package"


def import_vf(env_id: str) -> Any:
    """verifiers 0.4's `verifiers.v1`, or an EnvError saying what to install for `env_id`."""
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


def load_tasks(taskset: Any, where: str) -> tuple[list | None, Any]:
    """A taskset's tasks, materialised once when it is bounded (None when it is not: it streams), and its first;
    EnvError "<where> failed to load: ..." or "<where> yielded no tasks"."""
    try:
        tasks = list(taskset) if taskset.bounded else None
        first = next(iter(tasks if tasks is not None else taskset), None)
    except Exception as e:
        raise EnvError(f"{where} failed to load: {type(e).__name__}: {e}") from None
    if first is None:
        raise EnvError(f"{where} yielded no tasks")
    return tasks, first


def task_order(taskset: Any, tasks: list | None, seed: int) -> Iterator[Any]:
    """The tasks without end: materialised ones reshuffled each epoch by `seed`; a streaming taskset in its order."""
    return shuffled_forever(tasks, seed) if tasks is not None else iter(taskset)


def task_example(task: Any) -> Example:
    """The chat messages verifiers' chat loop opens with: the system prompt, then the task's prompt."""
    from verifiers.v1.dialects.chat import message_to_wire

    data = task.data
    prompt: list[dict[str, Any]] = []
    if data.system_prompt:
        prompt.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        prompt.append({"role": "user", "content": data.prompt})
    elif data.prompt is not None:
        prompt += [message_to_wire(m) for m in data.prompt]
    answer = getattr(data, "answer", "")
    return Example(prompt=prompt, answer="" if answer is None else str(answer),
                   info=data.model_dump(mode="json", exclude_defaults=True))  # fmt: skip


def full_conversation(completion: str | list[dict[str, Any]], example: Example) -> list[dict[str, Any]]:
    """The example's prompt followed by the completion (a reply's text, or the messages of several turns)."""
    prompt = list(example.prompt)
    if isinstance(completion, str):
        return [*prompt, {"role": "assistant", "content": completion}]
    return [*prompt, *completion]


def conversation_trace(
    vf: Any, task: Any, conversation: list[dict[str, Any]], prompt_len: int, schemas: list[dict[str, Any]]
) -> Any:
    """A vf.Trace of `conversation` (one branch); assistant messages after the prompt are the sampled turns.

    `schemas` are the OpenAI function schemas offered to the model, recorded on the trace as its vf.Tools.
    """
    from verifiers.v1.dialects.chat import parse_message
    from verifiers.v1.state import state_cls

    tools = [vf.Tool(name=t["function"]["name"], description=t["function"]["description"],
                     parameters=t["function"]["parameters"]) for t in schemas]  # fmt: skip
    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
        state=state_cls(type(task))(),
        tools=tools,
    )
    for i, raw in enumerate(conversation):
        message = parse_message(raw)
        sampled = i >= prompt_len and message.role == "assistant"
        trace.nodes.append(
            vf.MessageNode(parent=i - 1 if i else None, message=message, sampled=sampled,
                           tools=tools if i == 0 else [])
        )  # fmt: skip
        if sampled:
            finish = "tool_calls" if message.tool_calls else "stop"
            trace.calls.append(vf.ModelCall(node=i, finish_reason=finish))
    return trace


def model_response(vf: Any, message: dict[str, Any]) -> Any:
    """The vf.Response carrying the model's `message`: it finished on tool calls if it made any."""
    from verifiers.v1.dialects.chat import parse_message

    calls = message.get("tool_calls") or []
    return vf.Response(id="", created=0, model="", message=parse_message(message),
                       finish_reason="tool_calls" if calls else "stop")  # fmt: skip


def next_request(vf: Any, messages: list[dict[str, Any]], tools: list[Any]) -> Any:
    """The vf.Request of the model's next turn: the whole conversation so far and the vf.Tools it is offered."""
    from verifiers.v1.dialects.chat import parse_message

    return vf.Request(messages=[parse_message(m) for m in messages], tools=tools or None)
