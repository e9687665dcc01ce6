"""The one owner of tool-call parsing: Hermes/Qwen `<tool_call>` blocks in a model turn -> OpenAI `tool_calls`.

A model trained on the Hermes format ends its turn with one or more blocks

    <tool_call>
    {"name": "add", "arguments": {"a": 3, "b": 4}}
    </tool_call>

The built-in inference server parses its output with `parse_tool_calls`, and the orchestrator parses
model turns locally with the same function, so both sides agree on what a call is. vLLM's `hermes`
parser reads the same format (it also takes a last block left unclosed at the end of the turn, and so
do we).

>>> turn = 'Sure.\\n<tool_call>\\n{"name": "add", "arguments": {"a": 3, "b": 4}}\\n</tool_call>'
>>> content, calls = parse_tool_calls(turn)
>>> content
'Sure.'
>>> calls[0]["type"], calls[0]["function"]
('function', {'name': 'add', 'arguments': '{"a": 3, "b": 4}'})
>>> calls[0]["id"] == parse_tool_calls(turn)[1][0]["id"]
True
>>> parse_tool_calls("<tool_call>not json</tool_call>")
('<tool_call>not json</tool_call>', [])
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# A closed block anywhere, or an unclosed one running to the end of the text (the model stopped at EOS
# right after the JSON).
# Neither kind of body may contain another `<tool_call>`, so a broken block cannot swallow the next one.
_BLOCK = re.compile(r"<tool_call>((?:(?!<tool_call>).)*?)</tool_call>|<tool_call>((?:(?!<tool_call>).)*)\Z", re.DOTALL)


def tool_call_id(text: str, index: int) -> str:
    """A deterministic id for the `index`-th call parsed from `text`: replaying the same turn gives the same ids."""
    digest = hashlib.sha256(f"{index}\x00{text}".encode()).hexdigest()
    return f"call_{digest[:24]}"


def _parse_block(body: str) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) of one block's body, or None if it is not a well-formed call."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict):
        return None
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models emit the arguments already serialised
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return name, json.dumps(arguments, ensure_ascii=False)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Split a model turn into (content without the well-formed tool-call blocks, stripped; OpenAI tool calls).

    Malformed blocks (bad JSON, no name, arguments not an object) stay in the content and give no call;
    this never raises. Each call is `{"id": "call_<hash>", "type": "function",
    "function": {"name": str, "arguments": <JSON string>}}`, its id derived from `text` and its index.
    """
    if TOOL_CALL_START not in text:
        return text.strip(), []
    calls: list[dict[str, Any]] = []
    pieces: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        body = match.group(1) if match.group(1) is not None else match.group(2)
        parsed = _parse_block(body.strip())
        if parsed is None:
            continue
        name, arguments = parsed
        pieces.append(text[last : match.start()])
        last = match.end()
        calls.append(
            {
                "id": tool_call_id(text, len(calls)),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
    pieces.append(text[last:])
    return "".join(pieces).strip(), calls
