"""A verifiers taskset's Toolsets served in this process: their tools as OpenAI schemas, and the model's calls answered.

Each Toolset registers its tools on an MCP server built here, called through an MCP client in this
process (no tool server program, no runtime). Tools are named as verifiers' chat loop names them,
`<server>_<tool>` (bare when the Toolset has no server name), and their schemas drop the titles pydantic
derives from names. A Toolset's setup() runs once, on its first call, in the event loop that calls it. Every
failure of a call (bad JSON, unknown tool, the tool raising) becomes the tool message's text, as in verifiers.
Which Toolsets may run here is decided by the adapter (verifiers_adapter).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Coroutine
from typing import Any

from prime_rl.envs.base import EnvError


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run `coro` to completion from sync code, also when called inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


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


def list_tools(toolsets: list[Any], env_id: str) -> tuple[list[dict[str, Any]], dict[str, tuple[int, str]], list[Any]]:
    """OpenAI function schemas of every tool, named as verifiers' chat loop names them (`<server>_<tool>`);
    with them, each name's (toolset index, tool name on its server) and the toolsets' MCP servers."""
    if not toolsets:
        return [], {}, []
    servers = []
    for toolset in toolsets:
        server = _tool_server_class()(toolset.server_name or type(toolset).__name__)
        toolset.register(server)
        servers.append(server)

    async def list_all() -> list[list[Any]]:
        return [await server.list_tools() for server in servers]

    schemas, dispatch = [], {}
    for index, (toolset, listed) in enumerate(zip(toolsets, _run(list_all()), strict=True)):
        for tool in listed:
            full = f"{toolset.server_name}_{tool.name}" if toolset.server_name else tool.name
            if full in dispatch:
                raise EnvError(f"verifiers:{env_id}: two tools are named {full!r}; give one a TOOL_PREFIX")
            dispatch[full] = (index, tool.name)
            parameters = _drop_derived_titles(tool.input_schema, f"{tool.name}Arguments")
            schemas.append(
                {"type": "function", "function": {"name": full, "description": tool.description or "",
                                                  "parameters": parameters}}
            )  # fmt: skip
    return schemas, dispatch, servers


def _tool_server_class() -> type:
    """mcp's MCPServer, answering a tool that raised with the exception's text, as mcp 2.0 (which verifiers 0.4
    pins) did: mcp >= 2.2 (vLLM 0.33 needs it) keeps only "Error executing tool <name>" for anything but a
    ToolError, and the model could no longer read why its call failed (a bad argument, a division by zero)."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError

    class ToolServer(MCPServer):
        async def call_tool(self, name, arguments, context=None):
            try:
                return await super().call_tool(name, arguments, context)
            except UnexpectedToolError as e:
                raise ToolError(f"{e}: {e.__cause__}" if e.__cause__ is not None else str(e)) from e.__cause__

    return ToolServer


class ToolServers:
    """The MCP servers of a taskset's Toolsets: `schemas` for the model, `call` for each of its tool calls."""

    def __init__(self, toolsets: list[Any], env_id: str):
        self.toolsets = toolsets
        self.schemas, self._dispatch, self._servers = list_tools(toolsets, env_id)
        self._setups: dict[int, asyncio.Future] = {}

    async def call(self, call: dict[str, Any]) -> dict[str, Any]:
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
