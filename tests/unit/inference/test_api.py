"""The HTTP routes in-process: wire format, 4xx on bad input (never 500), API-key checks."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from prime_rl.configs import ModelConfig
from prime_rl.configs.inference import InferenceConfig
from prime_rl.inference.api import build_app
from prime_rl.inference.engine import build_engine

MAX_MODEL_LEN = 64
PROMPT = [74, 71, 331, 81, 521, 71, 586]


@pytest.fixture(scope="module")
def engine(tiny_model):
    engine = build_engine(str(tiny_model), device="cpu")
    yield engine
    engine.close()


def make_client(engine, tiny_model, **overrides) -> TestClient:
    config = InferenceConfig(**{"model": ModelConfig(name=str(tiny_model)), "max_model_len": MAX_MODEL_LEN} | overrides)
    return TestClient(build_app(engine, config))


@pytest.fixture(scope="module")
def client(engine, tiny_model):
    return make_client(engine, tiny_model)


def test_health_and_models(client, tiny_model):
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["step"] == 0
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [str(tiny_model)]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_completion_returns_token_ids_and_matching_token_id_logprobs(client, tiny_model):
    body = {
        "model": str(tiny_model),
        "prompt": PROMPT,
        "max_tokens": 6,
        "n": 2,
        "seed": 3,
        "logprobs": 2,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
    }
    data = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in data["choices"]] == [0, 1]
    for choice in data["choices"]:
        assert choice["prompt_token_ids"] == PROMPT
        assert len(choice["token_ids"]) == 6 and choice["finish_reason"] == "length"
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        assert len(logprobs["token_logprobs"]) == 6 and all(lp <= 0 for lp in logprobs["token_logprobs"])
        rows = zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True)
        for token, logprob, top in rows:
            assert top[token] == logprob  # the sampled token is always among the listed alternatives
            assert 2 <= len(top) <= 3
    assert data["usage"] == {"prompt_tokens": 7, "completion_tokens": 12, "total_tokens": 19}


def test_several_prompts_give_n_choices_each(client):
    body = {"prompt": ["hello", "world wide"], "n": 2, "max_tokens": 2, "return_token_ids": True}
    data = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    assert data["choices"][0]["prompt_token_ids"] == data["choices"][1]["prompt_token_ids"]
    assert data["choices"][0]["prompt_token_ids"] != data["choices"][2]["prompt_token_ids"]


def test_chat_uses_the_chat_template_and_fills_the_context_when_max_tokens_is_unset(client, engine):
    messages = [{"role": "user", "content": "hi there"}]
    body = {"messages": messages, "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True}
    data = client.post("/v1/chat/completions", json=body | {"return_token_ids": True}).json()
    template = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert data["prompt_token_ids"] == engine.tokenizer(template, add_special_tokens=False).input_ids
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert [c["token"] for c in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(len(c["top_logprobs"]) == 1 for c in choice["logprobs"]["content"])
    usage = data["usage"]
    assert usage["prompt_tokens"] == len(data["prompt_token_ids"])
    if choice["finish_reason"] == "length":
        assert usage["total_tokens"] == MAX_MODEL_LEN


@pytest.mark.parametrize(
    ("route", "body", "message"),
    [
        ("/v1/completions", b"{not json", "JSON decode error"),
        ("/v1/completions", b"[1, 2]", "the body must be a JSON object"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "body.n"),
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "body.temperature"),
        ("/v1/completions", {"max_tokens": 3}, "body.prompt: Field required"),
        ("/v1/completions", {"prompt": []}, "prompt is empty"),
        ("/v1/completions", {"prompt": [5, 99999]}, "out of range"),
        ("/v1/completions", {"prompt": [5] * 70}, "maximum context length is 64 tokens"),
        ("/v1/completions", {"prompt": [5] * 10, "max_tokens": 60}, "70 tokens (10 in the prompt, 60 in"),
        ("/v1/completions", {"prompt": "hi", "presence_penalty": 1.2}, "presence_penalty=1.2 is not supported"),
        ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "body.temperature"),
        ("/v1/completions", {"prompt": "hi", "n": 65}, "n=65 is more than this server's engine.max_batch_size 64"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids must be in [0, 1024)"),
        ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "body.repetition_penalty"),
        # top_k >= 2**63 with top_p < 1 overflowed inside the engine's batch: a 500 for every request in it.
        ("/v1/completions", {"prompt": "hi", "top_k": 2**63, "top_p": 0.9}, "body.top_k"),
        ("/v1/completions", {"prompt": "hi", "top_k": 2**63, "min_p": 0.1}, "body.top_k"),
        ("/v1/completions", {"prompt": "hi", "min_tokens": 2**63}, "body.min_tokens"),
        ("/v1/completions", {"prompt": "hi", "seed": 2**63}, "body.seed"),  # vLLM's range: int64
        ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, "body.temperature"),  # OpenAI's and vLLM's
        ("/v1/completions", {"prompt": "hi", "repetition_penalty": 1e39}, "body.repetition_penalty"),  # float32 inf
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "4"}]}, "needs tool_call_id"),
        # 600 levels holding a lone surrogate ended in a RecursionError (a 500); any nesting past 128 is refused.
        ("/v1/chat/completions", b'{"messages": ' + b"[" * 600 + b'"\\ud800"' + b"]" * 600 + b"}", "deeper than 128"),
        ("/v1/completions", b'{"prompt": "hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", "deeper than 128"),
        ("/v1/completions", b'{"prompt": "hi", "x": ' + b'{"a": ' * 129 + b"1" + b"}" * 130, "deeper than 128"),
        ("/v1/chat/completions", {"messages": []}, "body.messages"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "body.messages.0.role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text"),
        ("/update_weights", {"weight_dir": "/nonexistent/step_1"}, "no such directory"),
        ("/update_weights", {"path": "x"}, "body.path: Extra inputs are not permitted"),
        ("/update_weights", {}, "give exactly one of weight_dir and broadcast"),
        (
            "/update_weights",
            {"broadcast": {"host": "10.0.0.1", "port": 1, "group": "g", "world_size": 2, "rank": 1, "step": 1}},
            "takes no weights over a process group",
        ),  # fmt: skip
        (
            "/update_weights",
            {"broadcast": {"host": "h", "port": 1, "group": "g", "world_size": 3, "rank": 1, "senders": 2, "step": 1}},
            "rank 1 is no seat of a group of 3 with 2 sender(s)",
        ),  # fmt: skip
        # Each of these was a 500 (issue: no 5xx): a lone surrogate, a path longer than any the OS takes,
        # a request-supplied chat template (code the server would run) without the opt-in.
        ("/v1/completions", b'{"prompt": "hi \\ud800"}', "lone UTF-16 surrogate"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}', "lone UTF-16 surrogate"),
        ("/update_weights", {"weight_dir": "/x" * 50_000}, "body.weight_dir"),
        ("/update_weights", {"weight_dir": "/tmp/" + "x" * 300 + "/step_1"}, "File name too long"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
            "--trust-request-chat-template",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "chat_template": "{% for i in range(9**9) %}{% endfor %}"},
            "--trust-request-chat-template",
        ),
    ],
)
def test_bad_requests_get_400_with_a_message(client, route, body, message):
    if isinstance(body, bytes):
        response = client.post(route, content=body, headers={"content-type": "application/json"})
    else:
        response = client.post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert message in error["message"]


def test_json_nested_to_the_depth_limit_is_accepted(client):
    body = b'{"prompt": "hi", "max_tokens": 1, "x": ' + b"[" * 127 + b'"\\ud83d\\ude00"' + b"]" * 127 + b"}"
    response = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text


def test_a_stream_that_fails_ends_with_an_error_event_then_done():
    """A request the engine fails (or a chunk that cannot be built) once cut the stream: no error, no [DONE]."""
    from prime_rl.inference.engine import RequestFailed
    from prime_rl.inference.openai.stream import sse

    async def chunks_then(error: Exception):
        yield {"choices": [{"index": 0, "text": "a"}]}
        raise error

    async def events(error: Exception) -> list[str]:
        return [event async for event in sse(chunks_then(error), timeout=5).body_iterator]

    for error, code in [(RequestFailed("the engine failed on this request"), 500), (KeyError("x"), 500)]:
        sent = asyncio.run(events(error))
        assert len(sent) == 3 and sent[0].startswith("data: {") and sent[-1] == "data: [DONE]\n\n"
        failure = json.loads(sent[1].removeprefix("data: "))["error"]
        assert failure["code"] == code and failure["type"] == "server_error", failure


def test_unknown_fields_and_unsupported_params_at_their_neutral_value_are_accepted(client):
    body = {"prompt": "hi", "max_tokens": 1, "user": "me", "presence_penalty": 0.0, "best_of": 1}
    assert client.post("/v1/completions", json=body).status_code == 200
    # Chat's max_completion_tokens is unknown to completions (it was read there, and a string was a 500).
    response = client.post("/v1/completions", json=body | {"max_completion_tokens": "x"})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 1


def test_unknown_model_and_route_get_404(client):
    response = client.post("/v1/completions", json={"model": "other", "prompt": "hi"})
    assert response.status_code == 404 and "`other` does not exist" in response.json()["error"]["message"]
    assert client.get("/v2/nothing").status_code == 404


def test_api_key_is_required_everywhere_but_health(engine, tiny_model):
    client = make_client(engine, tiny_model, api_key="secret")
    assert client.get("/health").status_code == 200
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.post("/reload_weights").status_code == 401
    response = client.get("/v1/models", headers={"Authorization": "Bearer secret"})
    assert response.status_code == 200
    body = {"prompt": "hi", "max_tokens": 1}
    assert client.post("/v1/completions", json=body).json()["error"]["type"] == "authentication_error"
    assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer secret"}).status_code == 200


def test_reload_weights_reports_step_zero(client):
    assert client.post("/reload_weights").json()["step"] == 0


def test_oversized_bodies_get_413_whether_declared_or_not(engine, tiny_model):
    client = make_client(engine, tiny_model, max_body_bytes=2048)
    big = {"prompt": "x" * 4000, "max_tokens": 1}
    response = client.post("/v1/completions", json=big)
    assert response.status_code == 413 and "larger than 2048 bytes" in response.json()["error"]["message"]

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * 400
        yield b'"}'

    response = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413


def test_streamed_completion_ends_with_done_and_adds_up_to_the_plain_one(client):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "return_token_ids": True, "logprobs": 0}
    plain = client.post("/v1/completions", json=body).json()["choices"][0]
    with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    choices = [c["choices"][0] for c in chunks]
    assert "".join(c["text"] for c in choices) == plain["text"]
    assert sum((c["token_ids"] for c in choices), []) == plain["token_ids"]
    assert sum((c["logprobs"]["token_logprobs"] for c in choices), []) == pytest.approx(
        plain["logprobs"]["token_logprobs"], abs=1e-5
    )
    assert [c["finish_reason"] for c in choices][-1] == "length"
    assert all(c["finish_reason"] is None for c in choices[:-1])


def test_metrics_are_prometheus_text(client):
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    text = client.get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values["prime_rl_inference_generated_tokens_total"] >= 2
    assert values["prime_rl_inference_requests_total"] >= 1
    assert values["prime_rl_inference_weight_step"] == 0
    assert "prime_rl_inference_running" in values and "prime_rl_inference_waiting" in values
    assert values["prime_rl_inference_max_batch_size"] >= 1  # the batch rows `running` fills (adaptive concurrency)
    assert "prime_rl_inference_tokens_per_second" in values
    assert values['prime_rl_inference_http_requests_total{route="/v1/completions",status="200"}'] >= 1


def test_a_request_past_its_timeout_gets_504_and_stops_decoding(engine, tiny_model):
    client = make_client(engine, tiny_model, request_timeout=0.3, max_model_len=4096)
    body = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 504 and "request_timeout=0.3" in response.json()["error"]["message"]
    with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as streamed:
        lines = [line for line in streamed.iter_lines() if line]
    assert '"code": 504' in lines[-2] and lines[-1] == "data: [DONE]"


def test_paired_surrogates_are_text_and_tiny_temperatures_sample_greedily(client):
    """An escaped emoji is valid text; temperature 1e-39 with logprobs was NaN (unserialisable, a 500)."""
    emoji = b'{"prompt": "hi \\ud83d\\ude00", "max_tokens": 2}'
    assert (
        client.post("/v1/completions", content=emoji, headers={"content-type": "application/json"}).status_code == 200
    )
    tiny = {"prompt": PROMPT, "max_tokens": 4, "temperature": 1e-39, "logprobs": 0}
    greedy = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0}
    answers = [client.post("/v1/completions", json=body) for body in (tiny, greedy)]
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[0].json()["choices"][0]["logprobs"] == answers[1].json()["choices"][0]["logprobs"]


def test_a_trusted_server_renders_a_request_chat_template(engine, tiny_model):
    client = make_client(engine, tiny_model, trust_request_chat_template=True)
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "return_token_ids": True}
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    data = client.post("/v1/chat/completions", json=body | {"chat_template": template}).json()
    assert len(data["prompt_token_ids"]) == 1  # just "x", not the model's ChatML wrapping
