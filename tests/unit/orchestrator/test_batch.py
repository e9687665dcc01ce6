"""generate_batch: exactly batch_size rollouts, zero-advantage groups replaced, truncation options.

The server is httpx's MockTransport (a step's worth of chat answers), so the test is about the batch logic.
"""

import asyncio
import itertools
import json

import httpx

from prime_rl.orchestrator.client import InferenceClient
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.envs import Example
from prime_rl.orchestrator.orchestrator import DataStream, build_samples, generate_batch
from prime_rl.orchestrator.rollout import RolloutSource
from prime_rl.orchestrator.sinks import ProgressLine


class OddOnly:
    """Even examples: every rollout scores 0 (no signal). Odd examples: rollouts answering "a" score 1."""

    def examples(self, seed):
        for i in itertools.count():
            yield Example(prompt=[{"role": "user", "content": str(i)}], answer="a", info={"i": i})

    def score(self, text, example):
        return float(example.info["i"] % 2 == 1 and text == "a")


def handler(request):
    n = json.loads(request.content)["n"]
    choices = [
        {"index": j, "message": {"content": "ab"[j % 2]}, "finish_reason": "length" if j == 1 else "stop",
         "token_ids": [5, 6], "logprobs": {"content": [{"token": "token_id:5", "logprob": -1.0},
                                                       {"token": "token_id:6", "logprob": -1.0}]}}
        for j in range(n)
    ]  # fmt: skip
    return httpx.Response(200, json={"prompt_token_ids": [1], "choices": choices}, headers={"x-weight-step": "0"})


class AllRight(OddOnly):
    def score(self, text, example):
        return 1.0


def run_batch(env=None, **advantage):
    config = OrchestratorConfig(batch_size=8, rollouts_per_example=2, advantage=advantage)
    env = env or OddOnly()
    data = DataStream(env, 0)
    source = RolloutSource(env, "odd", config.sampling, config.seq_len)
    client = InferenceClient(config.client, "m", transport=httpx.MockTransport(handler))
    batch = asyncio.run(generate_batch(client, source, data, config, None, ProgressLine(False, 1)))
    return batch, data, config


def test_zero_advantage_groups_are_replaced_until_the_batch_is_full():
    batch, data, _ = run_batch(skip_zero_advantage=True)
    assert len(batch.rollouts) == 8
    assert [g.example.info["i"] for g in batch.groups] == [1, 3, 5, 7]
    assert batch.skipped == 4 and batch.rounds == 4 and data.drawn == 8


def test_without_skipping_the_batch_keeps_zero_groups():
    batch, data, _ = run_batch()
    assert [g.example.info["i"] for g in batch.groups] == [0, 1, 2, 3] and data.drawn == 4
    assert batch.advantages[0] == [0.0, 0.0] and batch.advantages[1] == [0.5, -0.5]


def test_round_limit_fills_with_zero_groups_to_keep_batch_size():
    batch, _, _ = run_batch(skip_zero_advantage=True, max_rounds=1)
    assert len(batch.rollouts) == 8 and batch.skipped == 0


def test_truncated_completions_can_get_zero_reward_or_be_masked():
    # Choice 1 of each group is cut at max_tokens ("length"); every rollout scores 1.
    batch, _, _ = run_batch(AllRight())
    assert batch.advantages == [[0.0, 0.0]] * 4
    batch, _, _ = run_batch(AllRight(), truncated="zero_reward")
    assert batch.advantages == [[0.5, -0.5]] * 4
    batch, _, _ = run_batch(truncated="mask")
    samples = build_samples(batch, "mask")
    assert [any(s["loss_mask"]) for s in samples] == [True, False] * 4
