"""OpenAI tool calling end to end on both backends: the real `inference` process on loopback, the `openai`
client, and `assets/calc-qwen3` (a tiny Qwen3 trained to answer "What is a + b?" by calling `add`, then
answering with the tool's result).

The servers are the session's pair in tests/conftest.py (`calc_servers`, LoRA enabled, shared with
test_lora_serving, which leaves them on the base): both start when the first test needs one (the built-in
engine's tests run while vLLM's CPU build is still starting). Requests name the base model. Skipped with the
reason when the asset or vLLM is missing.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

CALC_MODEL = Path(__file__).resolve().parents[2] / "assets" / "calc-qwen3"
(ADD,) = json.loads((CALC_MODEL / "tools.json").read_text())  # the tool the model was trained with
QUESTION = {"role": "user", "content": "What is 37 + 5?"}
GREEDY = {"temperature": 0, "max_tokens": 96}  # byte-level: a call is ~70 tokens
RAW = {"return_token_ids": True, "return_tokens_as_token_ids": True}  # what the orchestrator reads


@pytest.fixture(scope="module")
def server(calc_server):
    return calc_server


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(CALC_MODEL)


def rendered_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt both servers must build: the chat template with the tools, arguments as objects."""
    for m in messages:
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    text = tokenizer.apply_chat_template(messages, tools=[ADD], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def test_the_model_calls_the_tool_then_answers_with_the_tools_result(client, tokenizer):
    first = client.chat.completions.create(
        model=str(CALC_MODEL), messages=[QUESTION], tools=[ADD], extra_body=RAW, logprobs=True, **GREEDY
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content  # the call is all the model said (None or "" by backend)
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 37, "b": 5}
    # The raw sample is untouched: its tokens spell the <tool_call> block, one logprob per token.
    token_ids = choice.model_extra["token_ids"]
    assert "<tool_call>" in tokenizer.decode(token_ids)
    assert [t.token for t in choice.logprobs.content] == [f"token_id:{t}" for t in token_ids]
    assert first.model_extra["prompt_token_ids"] == rendered_ids(tokenizer, [QUESTION])

    # The tool's result goes back as a `tool` message answering the call's id.
    turn = {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]}
    messages = [QUESTION, turn, {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    second = client.chat.completions.create(
        model=str(CALC_MODEL), messages=messages, tools=[ADD], extra_body=RAW, **GREEDY | {"max_tokens": 16}
    )
    answer = second.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert answer.message.content.strip() == "42"
    assert second.model_extra["prompt_token_ids"] == rendered_ids(tokenizer, json.loads(json.dumps(messages)))


def test_a_streamed_tool_call_adds_up_to_the_unstreamed_one(client):
    stream = client.chat.completions.create(
        model=str(CALC_MODEL), messages=[QUESTION], tools=[ADD], stream=True, **GREEDY
    )
    calls: dict[int, dict] = {}
    finish_reasons = []
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:  # OpenAI's protocol: pieces keyed by index
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += (delta.function and delta.function.name) or ""
                call["arguments"] += (delta.function and delta.function.arguments) or ""
            finish_reasons.append(choice.finish_reason)
    assert [c["name"] for c in calls.values()] == ["add"]
    assert json.loads(calls[0]["arguments"]) == {"a": 37, "b": 5}
    assert [r for r in finish_reasons if r] == ["tool_calls"]


def test_malformed_tool_requests_get_400_on_both_backends(server):
    def post(**body) -> httpx.Response:
        request = {"model": str(CALC_MODEL), "messages": [QUESTION], "tools": [ADD], "max_tokens": 1} | body
        return httpx.post(f"{server.url}/v1/chat/completions", json=request, timeout=60)

    assert post(tools=[{"type": "function"}]).status_code == 400  # no function
    assert post(tools=[]).status_code == 400
    assert post(tools=None, tool_choice="auto").status_code == 400  # a choice without tools
    # A tool message without the id of the call it answers (vLLM itself accepts it; our server in front of it
    # refuses it as the built-in engine does), and tool calls on a user turn.
    response = post(messages=[QUESTION, {"role": "tool", "content": "42"}])
    assert response.status_code == 400 and "needs tool_call_id" in response.json()["error"]["message"]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    response = post(messages=[QUESTION | {"tool_calls": [call]}])
    assert response.status_code == 400 and "only assistant messages" in response.json()["error"]["message"]
    if server.backend == "builtin":
        # No constrained decoding in the built-in engine: forcing a call is refused, naming why. (vLLM forces
        # it with structured outputs.)
        response = post(tool_choice="required")
        assert response.status_code == 400 and "constrained decoding" in response.json()["error"]["message"]
