"""Per-token policy steps on the orchestrator's side: each choice's `weight_steps` spans (or the response's
x-weight-step where a server sends none) become one step per token, kept through a multi-turn episode (-1 on
env replies), written to the rank file's `policy_steps` and measured per token (`token_lag/*`); weight updates
ask servers to continue requests in flight in continuous mode only.

The server is httpx's MockTransport, so these pin the orchestrator's side of the wire format (protocol/spans.py);
the server's side (a swap inside a request) is tested against the built-in engine in tests/unit/inference.
"""

import asyncio
import json
import logging

import httpx
import pytest

from prime_rl.configs.orchestrator import ClientConfig, OrchestratorConfig, SamplingConfig
from prime_rl.envs import Example
from prime_rl.orchestrator.batch import Batch, build_samples, step_metrics
from prime_rl.orchestrator.packing import pack_micro_batches
from prime_rl.orchestrator.rollout import RolloutSource
from prime_rl.orchestrator.servers.client import InferenceClient, InferenceError
from prime_rl.orchestrator.servers.weights import inflight_ask
from prime_rl.protocol.paths import rank_file
from prime_rl.protocol.records import read_rank_file, write_rank_file

BASE = "http://127.0.0.1:9/v1"
MESSAGES = [{"role": "user", "content": "hi"}]


def chat_choice(index: int, ids: list[int], spans: list | None) -> dict:
    content = [{"token": f"token_id:{t}", "logprob": -0.5} for t in ids]
    choice = {"index": index, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop",
              "token_ids": ids, "logprobs": {"content": content}}  # fmt: skip
    return choice if spans is None else choice | {"weight_steps": spans}


class Server:
    """Chat answers tokens [10, 11, 12], sampled by steps 3, 3, 4 (weights swapped inside the request; stamped
    x-weight-step 4); completions answer [20, 21] stamped 5 with no spans (an older server, or vLLM)."""

    def __init__(self, spans: list | None = ((3, 0, 2), (4, 2, 3))):
        self.spans = None if spans is None else [list(s) for s in spans]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path.endswith("/chat/completions"):
            data = {"prompt_token_ids": [1, 2], "choices": [chat_choice(0, [10, 11, 12], self.spans)]}
            return httpx.Response(200, json=data, headers={"x-weight-step": "4"})
        logprobs = {"tokens": ["token_id:20", "token_id:21"], "token_logprobs": [-0.25, -0.25]}
        choice = {"index": 0, "text": "x", "finish_reason": "stop", "token_ids": [20, 21], "logprobs": logprobs,
                  "prompt_token_ids": body["prompt"]}  # fmt: skip
        return httpx.Response(200, json={"choices": [choice]}, headers={"x-weight-step": "5"})


def client_for(handler) -> InferenceClient:
    return InferenceClient(ClientConfig(base_url=[BASE], max_retries=0), "m", transport=httpx.MockTransport(handler))


def test_spans_become_one_step_per_token_and_a_choice_without_them_gets_the_response_step():
    def handler(request):
        choices = [chat_choice(0, [10, 11, 12], [[3, 0, 2], [4, 2, 3]]), chat_choice(1, [13, 14], None)]
        return httpx.Response(200, json={"prompt_token_ids": [1], "choices": choices}, headers={"x-weight-step": "4"})

    swapped, plain = asyncio.run(client_for(handler).chat(MESSAGES, 2, SamplingConfig()))
    assert swapped.token_steps == [3, 3, 4] and swapped.weight_step == 4
    assert plain.token_steps == [4, 4]
    (turn,) = asyncio.run(client_for(Server()).complete([1, 2], 1, SamplingConfig()))
    assert turn.token_steps == [5, 5]


@pytest.mark.parametrize(
    ("spans", "problem"),
    [
        ([[4, 0, 2]], "cover 2 tokens, the choice has 3"),
        ([[4, 0, 2], [3, 2, 3]], "do not cover tokens 0..3 in order"),  # a step going back
        ([[4, 0, 1], [4, 2, 3]], "do not cover tokens 0..3 in order"),  # a gap
        ("3:0-3", "must be a list of"),
    ],
)
def test_malformed_spans_are_an_error_naming_the_server_and_the_choice(spans, problem):
    server = Server()
    server.spans = spans
    client = client_for(server)
    with pytest.raises(InferenceError, match=rf"POST {BASE}/chat/completions returned a malformed completion: "
                                             rf"choice 0: weight_steps .*{problem}"):  # fmt: skip
        asyncio.run(client.chat(MESSAGES, 1, SamplingConfig()))


def test_a_multi_turn_rollouts_token_steps_reach_the_rank_file_and_the_per_token_lag(tiny_model, tmp_path, two_turns):
    """Turn 1 (chat) straddles a swap from step 3 to 4, turn 2 (completions, no spans) is stamped 5."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    source = RolloutSource(two_turns, "two", SamplingConfig(), 512, tokenizer)
    group = asyncio.run(source.group(client_for(Server()), next(two_turns.examples(0)), 1))
    (rollout,) = group.rollouts
    env = len(rollout.completion_ids) - 5  # the env reply's tokens, rendered locally
    assert env > 0 and rollout.token_steps == [3, 3, 4] + [-1] * env + [5, 5]
    assert (rollout.weight_step, rollout.weight_step_max) == (3, 5)

    rollout.advantage = 1.0
    batch = Batch([group])
    samples = build_samples(batch, "zero_reward", ["two"])
    (rows,) = pack_micro_batches(samples, 512, 1, 1.0, env_names=["two"])
    write_rank_file(tmp_path, 5, 0, rows)
    (mb,) = read_rank_file(rank_file(tmp_path, 5, 0), 5, 0)
    assert mb.policy_steps.tolist() == [[-1, -1] + rollout.token_steps]  # prompt [1, 2] has none
    assert mb.loss_mask[0].tolist() == [step >= 0 for step in mb.policy_steps[0].tolist()]

    m = step_metrics(batch, {"step": 1.0}, 5)
    # Step 5 trains tokens sampled by steps [3, 3, 4, 5, 5]: lags [2, 2, 1, 0, 0]; env tokens are not counted.
    assert (m["token_lag/0"], m["token_lag/1"], m["token_lag/2"]) == (2, 1, 2) and "token_lag/3" not in m
    assert m["token_lag_mean"] == pytest.approx(1.0) and m["token_lag_max"] == 2
    assert m["weight_step"] == 3 and m["weight_step_max"] == 5 and m["mixed_policy_fraction"] == 1.0


class OneTurn:
    def examples(self, seed):
        while True:
            yield Example(prompt=MESSAGES, answer="")

    def score(self, conversation, example):
        return 1.0


def test_a_server_without_spans_gives_every_token_the_responses_step():
    source = RolloutSource(OneTurn(), "one", SamplingConfig(), 512)
    group = asyncio.run(source.group(client_for(Server(spans=None)), Example(prompt=MESSAGES, answer=""), 1))
    (rollout,) = group.rollouts
    assert rollout.token_steps == [4, 4, 4] and rollout.weight_step == rollout.weight_step_max == 4
    m = step_metrics(Batch([group]), {"step": 1.0}, 6)
    assert m["token_lag/2"] == 3 and m["token_lag_mean"] == m["token_lag_max"] == m["off_policy_gap"] == 2


class WeightServers:
    """/update_weights on two servers: a answers that it continued requests in flight, b that it finished them."""

    def __init__(self):
        self.bodies = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        step = body["broadcast"]["step"] if "broadcast" in body else 7
        answer = {"step": step, "checksum": "c"}
        if "inflight" in body:
            answer["inflight"] = "continue" if request.url.host == "a" else "finish"
        return httpx.Response(200, json=answer)


def weight_client(config: OrchestratorConfig, servers: WeightServers) -> InferenceClient:
    client_config = ClientConfig(base_url=["http://a:1/v1", "http://b:2/v1"], max_retries=0)
    return InferenceClient(client_config, "m", transport=httpx.MockTransport(servers), inflight=inflight_ask(config))


def test_continuous_mode_asks_servers_to_continue_requests_and_says_once_which_finish_them(caplog):
    continuous = OrchestratorConfig(batch_size=4, rollouts_per_example=2, max_inflight=8)
    servers = WeightServers()
    client = weight_client(continuous, servers)
    for server in client.pool.servers:
        server.receivers = 1
    rendezvous = {"host": "h", "port": 1, "group": "g", "backend": "gloo", "timeout": 5}

    async def updates():
        await client.update_weights("/w/step_7")
        await client.update_weights("/w/step_7")
        return await client.broadcast_weights(8, rendezvous)

    with caplog.at_level(logging.INFO, logger="prime_rl"):
        assert asyncio.run(updates()) == 8
    assert len(servers.bodies) == 6 and all(b["inflight"] == "continue" for b in servers.bodies)
    said = [r.message for r in caplog.records if "swaps weights between requests" in r.message]
    assert len(said) == 1 and said[0].startswith("http://b:2/v1 ")


@pytest.mark.parametrize(
    "config",
    [
        OrchestratorConfig(batch_size=4, rollouts_per_example=2),  # barrier mode
        OrchestratorConfig(batch_size=4, rollouts_per_example=2, max_inflight=8, inflight_updates="finish"),
    ],
)
def test_barrier_mode_and_inflight_finish_ask_nothing(config, caplog):
    servers = WeightServers()
    with caplog.at_level(logging.INFO, logger="prime_rl"):
        assert asyncio.run(weight_client(config, servers).update_weights("/w/step_7")) == 7
    assert servers.bodies == [{"weight_dir": "/w/step_7"}] * 2
    assert not [r for r in caplog.records if "swaps weights between requests" in r.message]


class FailingBroadcast:
    """Two servers in a broadcast whose seat b died: b answers nothing any more, a answers 400 (its transfer
    failed with the group) until it is asked in another group."""

    def __init__(self):
        self.asked = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.host == "b":
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200, json={"step": 3, "weight_receivers": 1})
        body = json.loads(request.content)["broadcast"]
        self.asked.append((body["group"], body["world_size"], body["rank"]))
        if body["group"] == "g":
            return httpx.Response(400, json={"error": {"message": "weight broadcast of step 8 failed (peer gone)"}})
        return httpx.Response(200, json={"step": 8, "checksum": "c"})


def test_a_broadcast_that_fails_drops_the_dead_server_and_keeps_the_one_that_answered(caplog):
    servers = FailingBroadcast()
    client = weight_client(OrchestratorConfig(batch_size=4, rollouts_per_example=2), servers)
    a, b = client.pool.servers
    for server in (a, b):
        server.receivers, server.step = 1, 3
    rendezvous = {"host": "h", "port": 1, "group": "g", "backend": "gloo", "timeout": 5}

    async def failed_then_again():
        first = await client.broadcast_weights(8, rendezvous)
        return first, await client.broadcast_weights(8, rendezvous | {"group": "g2", "senders": 2})

    with caplog.at_level(logging.WARNING, logger="prime_rl"):
        assert asyncio.run(failed_then_again()) == (3, 8)  # a kept step 3, then took 8 in the new group
    assert not b.alive and a.alive and a.step == 8 and a.group == "g2"
    assert client.weights.failed == {(8, "g")}  # never asked again in that group
    # The new group seats the live server alone, after the trainer's 2 senders (a 2-rank trainer's group).
    assert servers.asked == [("g", 3, 1), ("g2", 3, 2)]
    said = " ".join(r.message for r in caplog.records)
    assert "http://b:2/v1 is down, taking it out of the pool" in said and "keeps serving weight step 3" in said
