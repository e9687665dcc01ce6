"""Tool calling on the built-in engine's chat route, in-process: tools rendered through the chat template,
tool and tool-call messages validated and passed on, `<tool_call>` blocks parsed into `tool_calls`, and the
4xx answers for what the engine cannot do. The tiny model here is random, so the parsing of real model
output is covered by tests/integration/test_tool_calls.py (a model trained to call a tool, both backends).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from prime_rl.configs import ModelConfig
from prime_rl.configs.inference import InferenceConfig, StartupError
from prime_rl.inference.api import build_app
from prime_rl.inference.engine import Delta, build_engine
from prime_rl.inference.openai.serving import assistant_message as _assistant_message
from prime_rl.inference.openai.stream import chat_chunks as _chat_chunks
from prime_rl.inference.vllm.args import vllm_serve_args

# Qwen-style: tools in the system turn, calls as <tool_call> blocks, tool results as a user turn.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALC_MODEL = Path(__file__).resolve().parents[3] / "assets" / "calc-qwen3"
(ADD,) = json.loads((CALC_MODEL / "tools.json").read_text())
QUESTION = {"role": "user", "content": "What is 3 + 4?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}


@pytest.fixture(scope="module")
def engine(tiny_model):
    engine = build_engine(str(tiny_model), device="cpu")
    engine.tokenizer.chat_template = TOOL_TEMPLATE
    yield engine
    engine.close()


def make_client(engine, tiny_model, **overrides) -> TestClient:
    config = InferenceConfig(**{"model": ModelConfig(name=str(tiny_model)), "max_model_len": 512} | overrides)
    return TestClient(build_app(engine, config))


@pytest.fixture(scope="module")
def client(engine, tiny_model):
    return make_client(engine, tiny_model)


def prompt_text(client, engine, body) -> str:
    response = client.post("/v1/chat/completions", json={"max_tokens": 1, "return_token_ids": True} | body)
    assert response.status_code == 200, response.text
    return engine.tokenizer.decode(response.json()["prompt_token_ids"])


def test_tools_and_a_whole_tool_exchange_are_rendered_through_the_chat_template(client, engine):
    messages = [QUESTION, {"role": "assistant", "content": None, "tool_calls": [CALL]}]
    messages.append({"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "7"}]})
    text = prompt_text(client, engine, {"messages": messages, "tools": [ADD]})
    assert text.startswith('<|im_start|>system\n<tools>\n{"type": "function", "function": {"name": "add"')
    # The arguments reach the template as an object (as vLLM passes them), so it can serialise them itself.
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>' in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_tool_choice_none_still_renders_the_tools_as_vllm_does(client, engine):
    text = prompt_text(client, engine, {"messages": [QUESTION], "tools": [ADD], "tool_choice": "none"})
    assert "<tools>" in text


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tool_choice": "required"}, "tool_choice required needs constrained decoding"),
        ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, "function 'add' needs constrained"),
        ({"tools": None, "tool_choice": "auto"}, "tool_choice needs tools"),
        ({"tools": []}, "body.tools: List should have at least 1 item"),
        ({"tools": [{"type": "function"}]}, "body.tools.0.function: Field required"),
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "body.tools.0.type"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "body.tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "parameters"),
        ({"tool_choice": "sometimes"}, "body.tool_choice"),
        ({"messages": [{"role": "tool", "content": "7"}]}, "a tool message needs tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "only assistant messages carry"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [CALL | {"function": {"arguments": "{}"}}]}]},
            "tool_calls.0.function.name: Field required",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [CALL | {"function": {"name": "f", "arguments": "{"}}]}]},
            "function.arguments must be a JSON object",
        ),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]}, "tool_calls.0.id"),
    ],
)
def test_bad_tool_requests_get_400_naming_the_problem(client, body, message):
    response = client.post("/v1/chat/completions", json={"messages": [QUESTION], "tools": [ADD]} | body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


def test_tools_with_a_template_that_does_not_render_them_get_400(engine, tiny_model):
    client = make_client(engine, tiny_model, trust_request_chat_template=True)
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    body = {"messages": [QUESTION], "tools": [ADD], "chat_template": template}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert "chat template does not render them" in response.json()["error"]["message"]


def test_tool_calling_can_be_turned_off_but_the_builtin_engine_parses_only_hermes(engine, tiny_model):
    off = make_client(engine, tiny_model, tool_call_parser=None)
    response = off.post("/v1/chat/completions", json={"messages": [QUESTION], "tools": [ADD], "max_tokens": 1})
    assert response.status_code == 400 and "tool calling is off" in response.json()["error"]["message"]
    body = {"messages": [QUESTION], "tools": [ADD], "tool_choice": "none", "max_tokens": 1}
    assert off.post("/v1/chat/completions", json=body).status_code == 200
    with pytest.raises(StartupError, match="only `hermes`"):
        make_client(engine, tiny_model, tool_call_parser="llama3_json")


def test_vllm_gets_auto_tool_choice_with_the_configured_parser_and_none_turns_it_off():
    args = vllm_serve_args(InferenceConfig(), "127.0.0.1")
    assert "--enable-auto-tool-choice" in args and args[args.index("--tool-call-parser") + 1] == "hermes"
    args = vllm_serve_args(InferenceConfig(tool_call_parser="none"), "127.0.0.1")  # what `--tool-call-parser none` sets
    assert "--enable-auto-tool-choice" not in args and "--tool-call-parser" not in args


TURN = 'Adding.\n<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'


def test_an_answer_with_tool_calls_becomes_an_openai_assistant_message():
    message = _assistant_message(TURN + TURN[8:], True, None)
    assert message["content"] == "Adding."
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"a": 3, "b": 4}] * 2
    assert len(_assistant_message(TURN + TURN[8:], True, False)["tool_calls"]) == 1  # parallel_tool_calls off
    only_calls = _assistant_message(TURN[8:], True, None)
    assert only_calls["content"] is None and len(only_calls["tool_calls"]) == 1
    # Without parsing, or without a call, the text is the content unchanged.
    assert _assistant_message(TURN, False, None) == {"role": "assistant", "content": TURN}
    assert _assistant_message(" 7 ", True, None) == {"role": "assistant", "content": " 7 "}


def test_a_streamed_answer_with_tool_calls_ends_with_them_and_keeps_every_token():
    pieces = [TURN[:12], TURN[12:40], TURN[40:]]

    async def stream():
        for i, text in enumerate(pieces):
            last = i == len(pieces) - 1
            yield [Delta(0, [i], [-0.5], [], text, "stop" if last else None)]

    class Body:
        logprobs, return_token_ids, stream_options, parallel_tool_calls = True, True, None, None
        return_tokens_as_token_ids = True

    class Tokenizer:
        def decode(self, ids):
            return "x"

    async def collect():
        return [c async for c in _chat_chunks({}, Body(), [1, 2], stream(), Tokenizer(), True)]

    chunks = [c["choices"][0] for c in asyncio.run(collect())]
    assert [c["token_ids"] for c in chunks] == [[0], [1], [2]]  # every token as it came
    assert [c["delta"]["content"] for c in chunks] == ["", "", "Adding."]  # the text only once parsed
    assert [c["finish_reason"] for c in chunks] == [None, None, "tool_calls"]
    (call,) = chunks[-1]["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "add", "arguments": '{"a": 3, "b": 4}'}
    assert call["id"] == _assistant_message(TURN, True, None)["tool_calls"][0]["id"]  # same ids as unstreamed


def test_chat_messages_are_checked_by_the_rules_both_backends_apply():
    """The check the vLLM backend runs in front of vLLM (which accepts a tool message without its call's id)."""
    from prime_rl.inference.openai.protocol import chat_messages_problem

    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    ok = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "tool_calls": [call]}]
    assert chat_messages_problem({"messages": ok + [{"role": "tool", "tool_call_id": "c1", "content": "2"}]}) is None
    assert chat_messages_problem({"messages": "not a list"}) is None  # left to the backend's own validation
    problem = chat_messages_problem({"messages": ok + [{"role": "tool", "content": "2"}]})
    assert problem.startswith("invalid request: body.messages.2: ") and "needs tool_call_id" in problem
    problem = chat_messages_problem({"messages": [{"role": "user", "tool_calls": [call]}]})
    assert "only assistant messages carry tool_calls" in problem
    bad_arguments = call | {"function": {"name": "add", "arguments": "[1]"}}
    problem = chat_messages_problem({"messages": [{"role": "assistant", "tool_calls": [bad_arguments]}]})
    assert "must be a JSON object" in problem
