"""The token-in/token-out route, `POST /inference/v1/generate`, on both backends, as verifiers' training client
(`TrainClient`: prompts rendered client-side by `renderers`, token ids in and out) calls it.

The servers are the session's calc-qwen3 pair (tests/conftest.py `calc_servers`, shared with test_tool_calls and
others; requests name the base model). A multi-turn episode through `TrainClient`: every turn's recorded prompt
ids are its messages as the renderer renders them, and its recorded logprobs are the trainer's for those tokens
(<= 1e-4, fp32, T = 0.7); the route samples what `/v1/completions` samples for the same ids and seed. Client
mistakes are the same 4xx on both backends.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from tests.samples import trainer_logprobs

pytestmark = pytest.mark.slow
CALC_MODEL = Path(__file__).resolve().parents[2] / "assets" / "calc-qwen3"
QUESTION = [{"role": "user", "content": "What is 37 + 5?"}]
FOLLOW_UP = {"role": "user", "content": "And 2 + 2?"}


@pytest.fixture(scope="module")
def server(calc_server):
    return calc_server


def generate(server, **body) -> httpx.Response:
    request = {"model": str(CALC_MODEL), "token_ids": [72, 105, 33], "sampling_params": {"max_tokens": 4}} | body
    return httpx.post(f"{server.url}/inference/v1/generate", json=request, timeout=120)


async def episode(base_url: str, turns: int = 3) -> list:
    """A chat of `turns` turns through verifiers' `TrainClient` at `base_url`: (messages, response) per turn."""
    from verifiers.v1.clients.train import TrainClient
    from verifiers.v1.configs.client import TrainClientConfig
    from verifiers.v1.dialects.chat import ChatDialect
    from verifiers.v1.types import SamplingConfig

    # api_key_var: an unset variable (the calc servers take no key); the default would read Prime's CLI config.
    key, name = "PRIME_RL_TEST_NO_KEY", str(CALC_MODEL)
    config = TrainClientConfig(base_url=base_url, api_key_var=key, renderer_model_name=name)
    client = TrainClient(config)
    messages, out = list(QUESTION), []
    try:
        for _ in range(turns):
            body = {"model": str(CALC_MODEL), "messages": messages}
            turn = await client.get_response(ChatDialect(), body, SamplingConfig(temperature=0.7, max_tokens=24))
            out.append((list(messages), turn))
            messages += [{"role": "assistant", "content": turn.message.content or ""}, FOLLOW_UP]
    finally:
        await client.close()
    return out


def recorded_vs_trainer(turns: list) -> tuple[float, int]:
    """Checks each turn's recorded tokens; the largest gap between a recorded logprob and the trainer's, and
    the number of tokens."""
    from renderers import create_renderer
    from renderers.base import load_tokenizer

    renderer = create_renderer(load_tokenizer(str(CALC_MODEL)))
    gaps = []
    for messages, turn in turns:
        tokens = turn.tokens
        # What training gets: the turn's messages as the renderer renders them, and one logprob per sampled token;
        # that the server generated from exactly those ids shows in the trainer's logprobs matching.
        assert tokens.prompt_ids == renderer.render(messages, add_generation_prompt=True).token_ids
        assert len(tokens.completion_ids) == len(tokens.completion_logprobs) > 0
        trainer = trainer_logprobs(CALC_MODEL, tokens.prompt_ids, tokens.completion_ids, 0.7)
        gaps += [abs(a - b) for a, b in zip(tokens.completion_logprobs, trainer, strict=True)]
    return max(gaps), len(gaps)


def test_a_multi_turn_episode_through_verifiers_train_client_records_the_servers_tokens_and_the_trainers_logprobs(
    server,
):
    gap, n = recorded_vs_trainer(asyncio.run(episode(f"{server.url}/v1")))
    print(f"{server.backend}: 3 turns through TrainClient, max |recorded - trainer| over {n} tokens: {gap:.1e}")
    assert gap <= 1e-4


def test_train_client_through_the_orchestrators_pool_endpoint_fails_over_and_keeps_the_trainers_logprobs(
    server, free_port
):
    """TrainClient pointed at the orchestrator's pool (servers.endpoint): a pool of a server that is down and
    the calc server. The dead one is taken out and every turn is served by the live one, with its weight step and
    the trainer's logprobs; a body the server refuses is its 4xx; /v1/models is a live server's."""
    from prime_rl.configs.orchestrator import ClientConfig
    from prime_rl.orchestrator.servers.client import InferenceClient
    from prime_rl.orchestrator.servers.endpoint import PoolEndpoint

    dead = f"http://127.0.0.1:{free_port}/v1"  # nothing listens there
    config = ClientConfig(base_url=[dead, f"{server.url}/v1"], max_retries=1, health_timeout=5)

    async def through_the_pool():
        async with InferenceClient(config, str(CALC_MODEL)) as client, PoolEndpoint(client.servers) as endpoint:
            turns = await episode(endpoint.url)
            async with httpx.AsyncClient(timeout=60) as http:
                root = endpoint.url.removesuffix("/v1")
                body = {"token_ids": [72, 105], "sampling_params": {"max_tokens": 3, "ignore_eos": True}}
                answer = await http.post(f"{root}/inference/v1/generate", json=body)
                refused = await http.post(f"{root}/inference/v1/generate", json=body | {"token_ids": []})
                models = await http.get(f"{endpoint.url}/models")
            alive, requests = [s.alive for s in client.pool.servers], [s.requests for s in client.pool.servers]
        return turns, answer, refused, models, alive, requests

    turns, answer, refused, models, alive, requests = asyncio.run(through_the_pool())
    gap, n = recorded_vs_trainer(turns)
    print(f"{server.backend}: 3 turns through the pool endpoint, max |recorded - trainer| over {n} tokens: {gap:.1e}")
    assert gap <= 1e-4
    # The dead one is found down (on renderers' first /v1/models) and out; 3 turns and 2 requests on the live one.
    assert alive == [False, True] and requests == [0, 5]
    assert answer.status_code == 200 and answer.headers["x-weight-step"] == "0"
    assert len(answer.json()["choices"][0]["token_ids"]) == 3
    assert refused.status_code == 400 and "token_ids" in refused.json()["error"]["message"]
    assert models.status_code == 200 and models.json()["data"][0]["id"] == str(CALC_MODEL)


def test_the_route_samples_what_completions_sample_for_the_same_ids_and_seed(server):
    prompt = [72, 105, 33, 32, 87]
    sampling = {"temperature": 0.7, "max_tokens": 12, "seed": 11, "ignore_eos": True}
    answer = generate(server, token_ids=prompt, sampling_params=sampling | {"logprobs": 2}, return_token_ids=True)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-weight-step"] == "0"
    data = answer.json()
    (choice,) = data["choices"]
    assert data["prompt_token_ids"] == prompt and data["output_mode"] == "tokens"
    usage = {k: data["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert usage == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 12
    for token, entry in zip(choice["token_ids"], choice["logprobs"]["content"], strict=True):
        # vLLM's spelling (token_id, top_logprobs: the sampled token first) and renderers' (token)
        assert entry["token_id"] == token and entry["token"] == f"token_id:{token}"
        assert entry["top_logprobs"][0]["token_id"] == token and 2 <= len(entry["top_logprobs"]) <= 3
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]
    body = {"model": str(CALC_MODEL), "prompt": prompt, "logprobs": 0, "return_token_ids": True} | sampling
    completion = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    assert choice["token_ids"] == completion["token_ids"]
    served = [e["logprob"] for e in choice["logprobs"]["content"]]
    assert served == pytest.approx(completion["logprobs"]["token_logprobs"], abs=1e-5)


def test_a_stop_token_is_named_in_stop_reason_and_n_gives_n_choices(server):
    first = generate(server, sampling_params={"temperature": 0, "max_tokens": 8, "ignore_eos": True}).json()
    stop = first["choices"][0]["token_ids"][3]  # greedy: the 4th token drawn again ends the sample there
    data = generate(server, sampling_params={"temperature": 0, "max_tokens": 8, "stop_token_ids": [stop]}).json()
    (choice,) = data["choices"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["token_ids"][-1] == stop and choice["logprobs"] is None  # no logprobs asked for
    many = generate(server, sampling_params={"temperature": 1.0, "max_tokens": 4, "n": 3, "seed": 1}).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]


def test_bad_generate_requests_are_4xx_naming_the_field(server):
    def problem(status: int, **body) -> str:
        answer = generate(server, **body)
        assert answer.status_code == status, (body, answer.status_code, answer.text)
        return json.dumps(answer.json())

    assert "sampling_params" in problem(400, sampling_params=None)
    assert "token_ids" in problem(400, token_ids=[])
    assert "token_ids" in problem(400, token_ids=[-1])
    # vLLM would stop at the context's end: refused as the built-in engine and both backends' OpenAI routes do
    assert "maximum context length" in problem(400, sampling_params={"max_tokens": 5000})
    assert problem(400, sampling_params={"temperature": "hot"})
    assert problem(404, model="no-such-model")
    if server.backend == "builtin":  # vLLM checks ids against its vocabulary when it tokenizes, later
        assert "out of range" in problem(400, token_ids=[10**7])
        assert "stream" in problem(400, stream=True)  # vLLM streams this route
        assert "output_mode" in problem(400, output_mode="text")  # vLLM detokenizes with a tokenizer loaded


def test_the_orchestrators_client_samples_the_route_through_its_pool_with_each_tokens_step(server):
    """`InferenceClient.generate`: the route through the orchestrator's pool (its floor, retries, weight steps):
    the samples the route gives for the same ids and seed, each token stamped with the step that sampled it."""
    from prime_rl.configs.orchestrator import ClientConfig, SamplingConfig
    from prime_rl.orchestrator.servers.client import InferenceClient
    from prime_rl.orchestrator.servers.http import InferenceError

    prompt, sampling = [72, 105, 33, 32, 87], SamplingConfig(temperature=0.7, max_tokens=10)
    nucleus = sampling.model_copy(update={"top_p": 0.8})

    async def sample() -> tuple[list, list | str]:
        async with InferenceClient(ClientConfig(base_url=[f"{server.url}/v1"]), str(CALC_MODEL)) as client:
            completions = await client.generate(prompt, 2, sampling, seed=5)
            try:  # top-p in training: each token's kept set comes back, or the server says why it cannot
                filtered = await client.generate(prompt, 1, nucleus, seed=5, masks=True)
            except InferenceError as e:
                filtered = str(e)
            return completions, filtered

    completions, filtered = asyncio.run(sample())
    if server.backend == "builtin":
        (kept,) = filtered
        assert all(0 < len(k) < 259 for k in kept.kept)  # the nucleus: some of the 259 ids (byte-level vocabulary)
        trainer = trainer_logprobs(CALC_MODEL, prompt, kept.completion_ids, 0.7, kept.kept)
        assert kept.logprobs == pytest.approx(trainer, abs=1e-4)  # scored over the same sets
    else:  # vLLM's CPU build computes no kept sets (inference/vllm/server.py CPU_MASKS): refused, saying so
        assert "HTTP 400" in filtered and "cannot return sampling masks" in filtered, filtered
    params = {"n": 2, "temperature": 0.7, "max_tokens": 10, "seed": 5, "logprobs": 0}
    direct = generate(server, token_ids=prompt, sampling_params=params).json()["choices"]
    assert len(completions) == 2
    for completion, choice in zip(completions, direct, strict=True):
        assert completion.prompt_ids == prompt and completion.completion_ids == choice["token_ids"]
        assert completion.logprobs == pytest.approx([e["logprob"] for e in choice["logprobs"]["content"]], abs=1e-5)
        assert completion.weight_step == 0 and completion.token_steps == [0] * len(completion.completion_ids)
        assert completion.server == 0
