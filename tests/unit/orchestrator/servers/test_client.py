"""The client against httpx's MockTransport: wire format parsing, auth, retries and error messages."""

import asyncio
import json

import httpx
import pytest

from prime_rl.configs.orchestrator import ClientConfig, SamplingConfig
from prime_rl.orchestrator.servers.client import InferenceClient, InferenceError, parse_token_id
from prime_rl.orchestrator.servers.pool import server_root

BASE = "http://127.0.0.1:9/v1"
STEP_4 = {"x-weight-step": "4"}


def chat_response(n: int) -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "m",
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": f"text{i}"},
                "finish_reason": "stop" if i == 0 else "length",
                "token_ids": [10 + i, 11 + i],
                "logprobs": {
                    "content": [
                        {"token": f"token_id:{10 + i}", "logprob": -0.5, "bytes": [], "top_logprobs": []},
                        {"token": f"token_id:{11 + i}", "logprob": -1.5, "bytes": [], "top_logprobs": []},
                    ]
                },
            }
            for i in reversed(range(n))  # servers may list choices in any order
        ],
    }


def make_client(handler, **overrides) -> InferenceClient:
    config = ClientConfig(base_url=[BASE], max_retries=2, **overrides)
    return InferenceClient(config, "tiny", transport=httpx.MockTransport(handler))


async def use(client: InferenceClient, coro_fn):
    async with client:
        return await coro_fn(client)


def test_server_root_strips_v1():
    assert server_root("http://h:8000/v1/") == "http://h:8000"
    assert server_root("http://h:8000") == "http://h:8000"


def test_parse_token_id_rejects_plain_tokens():
    assert parse_token_id("token_id:42") == 42
    with pytest.raises(ValueError, match="return_tokens_as_token_ids"):
        parse_token_id("hello")


def test_chat_sends_wire_format_and_parses_token_ids_and_logprobs(monkeypatch):
    monkeypatch.setenv("MY_KEY", "secret")
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=chat_response(json.loads(request.content)["n"]), headers=STEP_4)

    client = make_client(handler, api_key_var="MY_KEY")
    client.pool.servers[0].step = 2  # what the client last saw; the server's stamp on the response wins
    messages = [{"role": "user", "content": "abc"}]
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, max_tokens=7)
    completions = asyncio.run(use(client, lambda c: c.chat(messages, 2, sampling)))

    (request,) = seen
    assert str(request.url) == f"{BASE}/chat/completions"
    assert request.headers["authorization"] == "Bearer secret"
    body = json.loads(request.content)
    assert body["messages"] == messages and body["model"] == "tiny" and body["n"] == 2
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (0.8, 0.9, 7)
    # Neutral values are sent too, so no server-side default changes the sampled distribution.
    assert (body["top_k"], body["min_p"], body["repetition_penalty"]) == (0, 0.0, 1.0)
    assert (body["presence_penalty"], body["frequency_penalty"]) == (0.0, 0.0)
    assert body["logprobs"] and body["return_tokens_as_token_ids"] and body["return_token_ids"]
    assert [c.completion_ids for c in completions] == [[10, 11], [11, 12]]
    assert all(c.prompt_ids == [1, 2, 3] and c.logprobs == [-0.5, -1.5] for c in completions)
    assert [c.text for c in completions] == ["text0", "text1"]
    assert [c.finish_reason for c in completions] == ["stop", "length"]
    assert all(c.weight_step == 4 for c in completions)


def test_no_auth_header_when_key_var_is_unset(monkeypatch):
    monkeypatch.delenv("UNSET_KEY_VAR", raising=False)
    seen = []

    def handler(request):
        seen.append(request)
        return httpx.Response(200, json={"status": "ok", "step": 3})

    client = make_client(handler, api_key_var="UNSET_KEY_VAR")
    assert asyncio.run(use(client, lambda c: c.server_step())) == 3
    assert "authorization" not in seen[0].headers
    assert str(seen[0].url) == "http://127.0.0.1:9/health"


def test_transient_errors_are_retried(monkeypatch):
    monkeypatch.setattr("prime_rl.orchestrator.servers.http.BACKOFF", 0.01)
    answers = iter(
        [
            httpx.ConnectError("refused"),
            httpx.Response(503, text="busy"),
            httpx.Response(200, json=chat_response(1), headers=STEP_4),
        ]
    )

    def handler(request):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    client = make_client(handler)
    completions = asyncio.run(use(client, lambda c: c.chat([], 1, SamplingConfig())))
    assert completions[0].completion_ids == [10, 11]


def test_persistent_5xx_gives_up_naming_the_url(monkeypatch):
    monkeypatch.setattr("prime_rl.orchestrator.servers.http.BACKOFF", 0.01)
    calls = []

    def handler(request):
        calls.append(request)
        return httpx.Response(500, text="boom")

    client = make_client(handler, health_timeout=0.5)
    with pytest.raises(InferenceError, match=r"POST http://127.0.0.1:9/v1/chat/completions failed after 3 attempt"):
        asyncio.run(use(client, lambda c: c.chat([], 1, SamplingConfig())))
    assert len(calls) == 3 + 1  # and one /health probe while no server was left


def test_client_error_is_not_retried_and_shows_the_server_message():
    calls = []

    def handler(request):
        calls.append(request)
        return httpx.Response(400, json={"error": "max_tokens too large"})

    client = make_client(handler)
    with pytest.raises(InferenceError, match=r"HTTP 400.*max_tokens too large"):
        asyncio.run(use(client, lambda c: c.chat([], 1, SamplingConfig())))
    assert len(calls) == 1


def test_malformed_completion_is_a_clear_error():
    def handler(request):
        data = chat_response(1)
        del data["prompt_token_ids"]
        return httpx.Response(200, json=data)

    client = make_client(handler)
    with pytest.raises(InferenceError, match="malformed completion.*prompt_token_ids"):
        asyncio.run(use(client, lambda c: c.chat([], 1, SamplingConfig())))


def test_update_weights_posts_to_every_server_root():
    seen = []

    def handler(request):
        seen.append((str(request.url), json.loads(request.content)))
        return httpx.Response(200, json={"step": 5, "weight_dir": "/w/step_5", "seconds": 0.1})

    config = ClientConfig(base_url=["http://a:1/v1", "http://b:2/v1"])
    client = InferenceClient(config, "tiny", transport=httpx.MockTransport(handler))
    assert asyncio.run(use(client, lambda c: c.update_weights("/w/step_5"))) == 5
    assert sorted(seen) == [
        ("http://a:1/update_weights", {"weight_dir": "/w/step_5"}),
        ("http://b:2/update_weights", {"weight_dir": "/w/step_5"}),
    ]
    assert client.pool.steps == {"http://a:1/v1": 5, "http://b:2/v1": 5}


def test_wait_for_servers_times_out_naming_the_url():
    def handler(request):
        raise httpx.ConnectError("connection refused")

    client = make_client(handler)
    with pytest.raises(InferenceError, match=r"http://127.0.0.1:9/health not ready after 1s.*ConnectError"):
        asyncio.run(use(client, lambda c: c.wait_for_servers(1.0)))


def test_chat_requests_go_round_robin_and_carry_each_servers_weight_step():
    hosts = []

    def handler(request):
        hosts.append(request.url.host)
        return httpx.Response(
            200, json=chat_response(1), headers={"x-weight-step": "3" if request.url.host == "a" else "4"}
        )

    config = ClientConfig(base_url=["http://a:1/v1", "http://b:2/v1"])
    client = InferenceClient(config, "tiny", transport=httpx.MockTransport(handler))

    async def four_requests(c):
        return [await c.chat([], 1, SamplingConfig()) for _ in range(4)]

    results = asyncio.run(use(client, four_requests))
    assert hosts == ["a", "b", "a", "b"]
    assert [r[0].weight_step for r in results] == [3, 4, 3, 4]


def test_a_completion_without_the_servers_weight_step_is_an_error():
    client = make_client(lambda request: httpx.Response(200, json=chat_response(1)))
    with pytest.raises(InferenceError, match="did not report x-weight-step"):
        asyncio.run(use(client, lambda c: c.chat([], 1, SamplingConfig())))
