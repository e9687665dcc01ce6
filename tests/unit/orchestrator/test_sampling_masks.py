"""Top-p / top-k training on the orchestrator's side: the request asks for sampling masks only when a filter is
on and the source trains, the kept sets are parsed (chat and completions), kept per completion token through a
multi-turn episode ([] on env replies), packed into the rank file's CSR, and a server without masks is refused."""

import asyncio
import json

import httpx
import pytest

from prime_rl.configs.orchestrator import ClientConfig, OrchestratorConfig, SamplingConfig
from prime_rl.orchestrator.packing import rollout_sample
from prime_rl.orchestrator.rollout import RolloutSource
from prime_rl.orchestrator.servers.client import InferenceClient, InferenceError
from prime_rl.trainer.micro_batch import MicroBatch

BASE = "http://127.0.0.1:9/v1"


class Server:
    """Chat answers tokens [10, 11], completions [20]; with `return_sampling_mask` each token carries a set."""

    def __init__(self, masks: bool = True):
        self.masks, self.bodies = masks, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        give = self.masks and body.get("return_sampling_mask")
        if request.url.path.endswith("/chat/completions"):
            content = [{"token": f"token_id:{t}", "logprob": -0.5} | ({"sampling_mask": [t, 99]} if give else {})
                       for t in (10, 11)]  # fmt: skip
            choice = {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop",
                      "token_ids": [10, 11], "logprobs": {"content": content}}  # fmt: skip
            data = {"prompt_token_ids": [1, 2], "choices": [choice]}
        else:
            logprobs = {"tokens": ["token_id:20"], "token_logprobs": [-0.25]} | (
                {"sampling_mask": [[]]} if give else {}
            )
            choice = {"index": 0, "text": "x", "finish_reason": "stop", "token_ids": [20], "logprobs": logprobs,
                      "prompt_token_ids": body["prompt"]}  # fmt: skip
            data = {"choices": [choice]}
        return httpx.Response(200, json=data, headers={"x-weight-step": "0"})


def client_for(server: Server) -> InferenceClient:
    return InferenceClient(ClientConfig(base_url=[BASE], max_retries=0), "m", transport=httpx.MockTransport(server))


MESSAGES = [{"role": "user", "content": "hi"}]


def test_masks_are_asked_only_when_training_with_a_filter_and_parsed_per_token():
    server = Server()
    client = client_for(server)
    top_p = SamplingConfig(top_p=0.9, top_k=20)
    (chat,) = asyncio.run(client.chat(MESSAGES, 1, top_p, masks=True))
    assert server.bodies[-1]["return_sampling_mask"] is True and server.bodies[-1]["top_k"] == 20
    assert chat.kept == [[10, 99], [11, 99]]
    (done,) = asyncio.run(client.complete([1, 2], 1, top_p, masks=True))
    assert done.kept == [[]]  # nothing filtered at that token: the whole vocabulary
    for sampling, masks in ((top_p, False), (SamplingConfig(top_k=-1), True), (SamplingConfig(), True)):
        (plain,) = asyncio.run(client.chat(MESSAGES, 1, sampling, masks=masks))
        assert "return_sampling_mask" not in server.bodies[-1] and plain.kept is None
        assert server.bodies[-1]["top_k"] == max(sampling.top_k, 0)


def test_a_server_that_returns_no_masks_is_refused_with_the_reason():
    client = client_for(Server(masks=False))
    with pytest.raises(InferenceError, match=r"returned no sampling masks: training with top_p < 1 or top_k > 0"):
        asyncio.run(client.chat(MESSAGES, 1, SamplingConfig(top_k=5), masks=True))
    (eval_like,) = asyncio.run(client.chat(MESSAGES, 1, SamplingConfig(top_k=5)))  # eval: any top_k, no masks
    assert eval_like.kept is None


def test_a_multi_turn_rollout_keeps_sets_on_model_tokens_and_none_on_env_replies(tiny_model, two_turns):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    source = RolloutSource(two_turns, "two", SamplingConfig(top_p=0.5), 512, tokenizer, masks=True)
    group = asyncio.run(source.group(client_for(Server()), next(two_turns.examples(0)), 1))
    (rollout,) = group.rollouts
    env = len(rollout.completion_ids) - 3
    assert rollout.kept == [[10, 99], [11, 99]] + [[]] * env + [[]]
    rollout.advantage = 1.0
    mb = MicroBatch.pack([rollout_sample(rollout)], 1.0)
    assert mb.has_kept_sets and mb.kept_ids.tolist() == [10, 99, 11, 99]
    start = len(rollout.prompt_ids)
    assert mb.kept_offsets[start : start + 3].tolist() == [0, 2, 4]


def test_orchestrator_config_accepts_top_p_and_top_k_for_training():
    config = OrchestratorConfig(sampling=SamplingConfig(top_p=0.8, top_k=50))
    assert config.sampling.filtered
