"""A `renderers` renderer for models whose Hermes tool-call markers are text, not tokens: the model's own chat
template (renderers' DefaultRenderer) with tool calls read from the decoded turn by `utils.tool_calls`, the
parser our server and orchestrator use. renderers' Hermes parser (`qwen3`) finds `<tool_call>` as one token id,
which a byte-level tokenizer (the shipped tiny models, assets/calc-qwen3) does not have, and DefaultRenderer
alone parses no tool calls at all ("does not support tools").

verifiers' training client takes it as a custom renderer:

    [[orchestrator.env]]
    id = "verifiers-env"
    args = { renderer = { name = "custom", import_path = "prime_rl.envs.hermes_renderer.HermesTextRenderer" }, ... }
"""

from __future__ import annotations

import json
from typing import Any

from renderers.base import ParsedToolCall, ToolCallParseStatus
from renderers.configs import DefaultRendererConfig
from renderers.default import DefaultRenderer

from prime_rl.utils.tool_calls import TOOL_CALL_START, parse_tool_calls


class HermesTextParser:
    """renderers' ToolParser protocol over the text: (the ids before the first `<tool_call>`, the calls)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def extract(self, ids: list[int]) -> tuple[list[int], list[ParsedToolCall]]:
        text = self._text(ids)
        start = text.find(TOOL_CALL_START)
        if start < 0:
            return ids, []
        cut = next(i for i in range(len(ids) + 1) if len(self._text(ids[:i])) > start) - 1  # the marker's token
        _, calls = parse_tool_calls(text[start:])
        if not calls:
            return ids[:cut], [ParsedToolCall(raw=text[start:], status=ToolCallParseStatus.INVALID_JSON)]
        parsed = []
        for call in calls:
            function = call["function"]
            arguments = json.loads(function["arguments"])
            parsed.append(ParsedToolCall(raw=json.dumps({"name": function["name"], "arguments": arguments}),
                                         name=function["name"], arguments=arguments, id=call["id"]))  # fmt: skip
        return ids[:cut], parsed


class HermesTextRenderer(DefaultRenderer):
    """DefaultRenderer whose tool calls are Hermes blocks found in the text."""

    config_class = DefaultRendererConfig

    def __init__(self, tokenizer: Any, config: DefaultRendererConfig | None = None):
        super().__init__(tokenizer, config)
        self._tool_parser = HermesTextParser(tokenizer)
