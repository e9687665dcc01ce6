"""Sampling on known logits: which tokens each filter keeps, greedy decoding, reported logprobs."""

from __future__ import annotations

import math
import random

import pytest
import torch

from prime_rl.inference.engine.sampling import (
    SamplingParams,
    filter_logprobs,
    logprobs_of,
    sample_token,
    top_logprobs,
)

LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0])  # probabilities ≈ [.644, .237, .087, .032]


def kept(**filters) -> set[int]:
    out = filter_logprobs(logprobs_of(LOGITS, 1.0), **filters)
    return {i for i, v in enumerate(out.tolist()) if v > float("-inf")}


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [(1.0, {0, 1, 2, 3}), (0.95, {0, 1, 2}), (0.8, {0, 1}), (0.6, {0}), (0.01, {0})],
)
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, expected):
    assert kept(top_p=top_p) == expected


def test_top_k_and_min_p_keep_the_most_likely_tokens():
    assert kept(top_k=2) == {0, 1}
    assert kept(top_k=-1) == {0, 1, 2, 3}
    assert kept(min_p=0.3) == {0, 1}  # .237 ≥ .3 × .644 = .193 > .087


def test_temperature_zero_is_greedy_with_plain_log_softmax_logprob():
    token, logprob, _ = sample_token(LOGITS, SamplingParams(temperature=0.0), None)
    assert token == 0
    assert logprob == pytest.approx(2.0 - math.log(sum(math.exp(x) for x in [2, 1, 0, -1])))
    assert logprob == pytest.approx(-0.4402, abs=1e-4)


def test_logprob_is_under_the_temperature_scaled_distribution_before_filtering():
    params = SamplingParams(temperature=0.5, top_p=0.5)
    token, logprob, _ = sample_token(LOGITS, params, random.Random(0))
    assert token == 0  # top_p 0.5 at temperature 0.5 leaves only the top token
    expected = torch.log_softmax(LOGITS / 0.5, dim=-1)[0].item()
    assert logprob == pytest.approx(expected)  # not 0.0, which the filtered distribution would give
    assert logprob == pytest.approx(-0.1451, abs=1e-4)


def test_samples_only_allowed_tokens_with_their_renormalised_frequencies():
    params = SamplingParams(temperature=1.0, top_p=0.8)
    generator = random.Random(0)
    draws = [sample_token(LOGITS, params, generator)[0] for _ in range(2000)]
    assert set(draws) == {0, 1}
    assert draws.count(0) / len(draws) == pytest.approx(0.644 / 0.881, abs=0.04)


def test_same_seed_gives_same_tokens():
    params = SamplingParams(temperature=1.0)
    a = [sample_token(LOGITS, params, g)[0] for g in [random.Random(7)] for _ in range(20)]
    b = [sample_token(LOGITS, params, g)[0] for g in [random.Random(7)] for _ in range(20)]
    assert a == b


def test_top_logprobs_are_sorted_pairs():
    pairs = top_logprobs(logprobs_of(LOGITS, 1.0), 2)
    assert [t for t, _ in pairs] == [0, 1]
    assert pairs[0][1] == pytest.approx(-0.4402, abs=1e-4)
    assert pairs[1][1] == pytest.approx(-1.4402, abs=1e-4)
    assert top_logprobs(logprobs_of(LOGITS, 1.0), 0) == []
