"""The evaluation core (orchestrator/evaluation.py `sample_and_score`, shared by `[[eval]]` and the `eval` command):
a group whose episode failed in the env's own code is left out and counted, never the end of the evaluation; an
evaluation where every group failed is an error naming the last cause."""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest

from prime_rl.configs.orchestrator import OrchestratorConfig
from prime_rl.envs import EnvError, EpisodeFailed
from prime_rl.orchestrator.evaluation import EnvResult, sample_and_score
from prime_rl.orchestrator.rollout import RolloutSource
from prime_rl.orchestrator.servers.client import InferenceClient
from tests.unit.orchestrator.test_batch import OddOnly, handler


class BreaksOnEveryThird(OddOnly):
    def score(self, text, example):
        if example.info["i"] % 3 == 0:
            raise EpisodeFailed(f"the scorer broke on example {example.info['i']}")
        return super().score(text, example)


def evaluate(n_examples: int):
    config = OrchestratorConfig()
    source = RolloutSource(BreaksOnEveryThird(), "third", config.sampling, config.seq_len)
    examples = list(itertools.islice(source.env.examples(0), n_examples))
    client = InferenceClient(config.client, "m", transport=httpx.MockTransport(handler))
    return asyncio.run(sample_and_score(client, source, examples, 2, None))


def test_failed_groups_are_left_out_and_counted():
    groups, failed = evaluate(6)
    assert [g.example.info["i"] for g in groups] == [1, 2, 4, 5]
    assert failed == ["the scorer broke on example 0", "the scorer broke on example 3"]
    summary = EnvResult("third", 0, groups, failed).summary()
    assert summary["failed_groups"] == 2 and summary["samples"] == 8
    assert "failed_groups" not in EnvResult("third", 0, groups).summary()  # a clean evaluation's line unchanged


def test_an_evaluation_where_every_group_failed_is_an_error():
    with pytest.raises(EnvError, match=r"third: every group of the evaluation failed \(1\); the last: the scorer"):
        evaluate(1)
