"""The RL loss math on hand-computed examples (the docstring examples of trainer/rl/loss.py)."""

import math

import pytest
import torch

from prime_rl.trainer.rl.loss import aipo_loss, token_entropy, token_logprobs


def test_token_logprobs_position_t_holds_logprob_of_token_t():
    input_ids = torch.tensor([[0, 1, 0]])
    logits = torch.tensor([[[0.0, 0.0], [math.log(3), 0.0], [9.0, 9.0]]])
    out = token_logprobs(logits, input_ids, temperature=1.0)
    assert out.shape == (1, 3)
    torch.testing.assert_close(out, torch.tensor([[0.0, math.log(0.5), math.log(0.75)]]))


def test_token_logprobs_divide_logits_by_temperature():
    input_ids = torch.tensor([[0, 0]])
    logits = torch.tensor([[[math.log(9), 0.0], [0.0, 0.0]]])
    # softmax([ln 9, 0] / 2) = softmax([ln 3, 0]) = [0.75, 0.25]
    torch.testing.assert_close(token_logprobs(logits, input_ids, 2.0), torch.tensor([[0.0, math.log(0.75)]]))


def test_token_logprobs_match_log_softmax_gather_on_random_logits():
    torch.manual_seed(0)
    logits, ids = torch.randn(1, 7, 11), torch.randint(0, 11, (1, 7))
    expected = torch.log_softmax(logits[:, :-1] / 0.7, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, ids, 0.7)[:, 1:], expected)


def test_token_entropy_example():
    logits = torch.tensor([[[0.0, 0.0], [math.log(3), 0.0], [5.0, 1.0]]])
    expected = [0.0, math.log(2), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))]
    torch.testing.assert_close(token_entropy(logits, 1.0), torch.tensor([expected]))


def test_aipo_loss_worked_example_values_and_gradient():
    logprobs = torch.tensor([-1.0, -2.0], requires_grad=True)
    mu = torch.tensor([-1.0, -2.0 - math.log(2)])  # ratios [1, 2]
    advantages = torch.tensor([1.0, -1.0])
    mask = torch.tensor([True, True])
    terms = aipo_loss(logprobs, mu, advantages, mask, max_ratio=1.5, scale=0.5)
    terms.loss.backward()
    assert terms.loss.item() == pytest.approx(-1.0)
    assert terms.loss_sum.item() == pytest.approx(-2.0)  # unscaled
    torch.testing.assert_close(logprobs.grad, torch.tensor([-0.5, 0.75]))
    assert terms.mismatch_kl_sum.item() == pytest.approx(1 - math.log(2))
    assert terms.clipped.item() == 1


def test_aipo_loss_ignores_masked_positions_even_with_overflowing_ratios():
    logprobs = torch.tensor([-0.5, -1.0], requires_grad=True)
    mu = torch.tensor([-1000.0, -1.0])  # a placeholder μ on a prompt token: exp(999.5) = inf
    terms = aipo_loss(logprobs, mu, torch.tensor([3.0, 2.0]), torch.tensor([False, True]), 8.0, 1.0)
    terms.loss.backward()
    assert terms.loss.item() == pytest.approx(2.0)  # only token 1: −1·2·(−1)
    assert terms.mismatch_kl_sum.item() == 0.0
    assert terms.clipped.item() == 0
    torch.testing.assert_close(logprobs.grad, torch.tensor([0.0, -2.0]))


def test_aipo_loss_ratio_is_not_differentiated():
    # With r = π/μ differentiated, the gradient would pick up an extra A·log π·r term; it must be −w·A only.
    logprobs = torch.tensor([-0.2], requires_grad=True)
    aipo_loss(logprobs, torch.tensor([-0.7]), torch.tensor([1.0]), torch.tensor([True]), 8.0, 1.0).loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([-math.exp(0.5)]))
