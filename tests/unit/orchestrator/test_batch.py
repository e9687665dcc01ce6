"""Batches: exactly batch_size rollouts, zero-advantage groups replaced, truncation options, environments
mixed by ratio (continuous mode's stream: test_stream.py).

The server is httpx's MockTransport (chat answers, stamped with a weight step), so the tests are about the
batch logic; tests/integration runs the same against real servers.
"""

import asyncio
import itertools
import json

import httpx
import pytest

from prime_rl.configs.orchestrator import EnvConfig, OrchestratorConfig
from prime_rl.envs import Example
from prime_rl.orchestrator.batch import (
    DataStream,
    EnvMix,
    EnvSlot,
    build_samples,
    generate_batch,
    step_metrics,
)
from prime_rl.orchestrator.rollout import RolloutSource
from prime_rl.orchestrator.servers.client import InferenceClient
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


def slot(env, config, name="odd", ratio=1.0):
    source = RolloutSource(env, name, config.sampling, config.seq_len)
    return EnvSlot(EnvConfig(id="x:y", name=name, ratio=ratio), source, DataStream(env, 0))


def run_batch(env=None, **advantage):
    config = OrchestratorConfig(batch_size=8, rollouts_per_example=2, advantage=advantage)
    mix = EnvMix([slot(env or OddOnly(), config)])
    client = InferenceClient(config.client, "m", transport=httpx.MockTransport(handler))
    batch = asyncio.run(generate_batch(client, mix, config, None, ProgressLine(False, 1)))
    return batch, mix.slots[0].data, config


def test_zero_advantage_groups_are_replaced_until_the_batch_is_full():
    batch, data, _ = run_batch(skip_zero_advantage=True)
    assert len(batch.rollouts) == 8
    assert [g.example.info["i"] for g in batch.groups] == [1, 3, 5, 7]
    assert batch.skipped == 4 and batch.rounds == 4 and data.drawn == 8


def test_without_skipping_the_batch_keeps_zero_groups():
    batch, data, _ = run_batch()
    assert [g.example.info["i"] for g in batch.groups] == [0, 1, 2, 3] and data.drawn == 4
    assert batch.groups[0].advantages == [0.0, 0.0] and batch.groups[1].advantages == [0.5, -0.5]


def test_round_limit_fills_with_zero_groups_to_keep_batch_size():
    batch, _, _ = run_batch(skip_zero_advantage=True, max_rounds=1)
    assert len(batch.rollouts) == 8 and batch.skipped == 0


def test_truncated_completions_can_get_zero_reward_or_be_masked():
    # Choice 1 of each group is cut at max_tokens ("length"); every rollout scores 1.
    batch, _, _ = run_batch(AllRight())
    assert [g.advantages for g in batch.groups] == [[0.0, 0.0]] * 4
    batch, _, _ = run_batch(AllRight(), truncated="zero_reward")
    assert [g.advantages for g in batch.groups] == [[0.5, -0.5]] * 4
    batch, _, _ = run_batch(truncated="mask")
    samples = build_samples(batch, "mask")
    assert [any(s.loss_mask) for s in samples] == [True, False] * 4


def test_masked_truncated_rollouts_leave_the_loss_but_keep_their_reward_in_the_baseline():
    # Odd groups: choice 0 ("a", stop) scores 1, choice 1 ("b", cut at max_tokens) 0.
    batch, _, _ = run_batch(truncated="mask")
    assert batch.groups[1].advantages == [0.5, -0.5]  # the cut rollout's 0 is in the baseline (without it: [0.0])
    samples = build_samples(batch, "mask")
    assert [any(s.loss_mask) for s in samples[2:4]] == [True, False]
    assert samples[2].advantages[-1] == 0.5


def test_length_penalty_gives_equal_rewards_a_signal_so_skip_zero_advantage_keeps_them():
    """Every rollout scores 1; choice 0 is 1 token long, choice 1 is 3: shaped by length_penalty the group is
    not all-equal (the shorter wins), so skip_zero_advantage keeps it; without the penalty it is skipped."""

    def lengths(request):
        n = json.loads(request.content)["n"]
        choices = [
            {"index": j, "message": {"content": "a"}, "finish_reason": "stop", "token_ids": [5] * (1 + 2 * j),
             "logprobs": {"content": [{"token": "token_id:5", "logprob": -1.0}] * (1 + 2 * j)}}
            for j in range(n)
        ]  # fmt: skip
        return httpx.Response(200, json={"prompt_token_ids": [1], "choices": choices}, headers={"x-weight-step": "0"})

    def run(**advantage):
        config = OrchestratorConfig(batch_size=4, rollouts_per_example=2, advantage=advantage)
        client = InferenceClient(config.client, "m", transport=httpx.MockTransport(lengths))
        mix = EnvMix([slot(AllRight(), config)])
        return asyncio.run(generate_batch(client, mix, config, None, ProgressLine(False, 1)))

    shaped = run(skip_zero_advantage=True, length_penalty=0.1)
    assert shaped.skipped == 0 and shaped.rounds == 1
    gap = 0.1 * 2 / 128 / 2  # λ × (3 − 1 tokens) / (max_tokens 128 × 1 turn), split around the mean
    assert [g.advantages for g in shaped.groups] == [[pytest.approx(gap), pytest.approx(-gap)]] * 2
    plain = run(skip_zero_advantage=True, max_rounds=2)
    assert plain.skipped == 2 and plain.rounds == 2 and [g.advantages for g in plain.groups] == [[0.0, 0.0]] * 2


def test_two_environments_mix_by_ratio_and_get_their_own_metrics():
    config = OrchestratorConfig(batch_size=80, rollouts_per_example=2)
    mix = EnvMix([slot(OddOnly(), config, "big", 3), slot(AllRight(), config, "small", 1)])
    client = InferenceClient(config.client, "m", transport=httpx.MockTransport(handler))

    async def five_steps():
        return [await generate_batch(client, mix, config, None, ProgressLine(False, 1)) for _ in range(5)]

    batches = asyncio.run(five_steps())
    envs = [g.env for b in batches for g in b.groups]
    assert len(envs) == 200 and envs.count("big") == 150 and envs.count("small") == 50
    assert envs[:8] == ["big", "big", "small", "big"] * 2  # interleaved, not in blocks
    m = step_metrics(batches[0], {"step": 1.0}, 0)
    assert m["groups/big"] == 30 and m["groups/small"] == 10
    assert m["reward/small"] == 1.0 and 0 < m["reward/big"] < 1
    assert m["truncated_fraction/big"] == m["truncated_fraction/small"] == 0.5  # each group's 2nd is cut (handler)
    # Resuming after 73 picks continues the rotation where it stopped.
    again = EnvMix([slot(OddOnly(), config, "big", 3), slot(AllRight(), config, "small", 1)], picks=73)
    assert [again.next().name for _ in range(4)] == envs[73:77]


def test_the_samples_of_one_episodes_trace_share_its_advantage_and_count_once_in_the_baseline():
    """verifiers' episodes (orchestrator/episodes.py): a trace may give several samples (branches); the group's
    baseline is over traces, not samples, so a trace with three branches weighs as much as one with one."""
    from prime_rl.configs.orchestrator import AdvantageConfig
    from prime_rl.orchestrator.batch import advantages_of
    from prime_rl.orchestrator.rollout import Group, Rollout

    def sample(reward: float, unit: int, tokens: int = 2) -> Rollout:
        r = Rollout(Example("x"), [1], [2] * tokens, [True] * tokens, [0.0] * tokens, "", "stop", 0, unit=unit)
        r.reward = reward
        return r

    group = Group(Example("x"), [sample(1.0, 0), sample(1.0, 0), sample(1.0, 0), sample(0.0, 1000)])
    assert advantages_of(group, AdvantageConfig(), 8) == [0.5, 0.5, 0.5, -0.5]  # mean over 2 traces: 0.5
    plain = Group(Example("x"), [sample(1.0, -1), sample(1.0, -1), sample(1.0, -1), sample(0.0, -1)])
    assert advantages_of(plain, AdvantageConfig(), 8) == [0.25, 0.25, 0.25, -0.75]  # unit -1: one each


def test_the_pool_endpoints_sampling_rule_keeps_the_runs_parameters():
    import doctest

    from prime_rl.orchestrator.servers import endpoint

    assert doctest.testmod(endpoint).failed == 0
