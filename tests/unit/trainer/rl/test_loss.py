"""The RL loss math on hand-computed examples (the docstring examples of trainer/rl/loss.py)."""

import math

import pytest
import torch

from prime_rl.configs.trainer import LossConfig
from prime_rl.trainer.logprobs import (
    target_logprobs_and_entropy,
    token_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
)
from prime_rl.trainer.rl.loss import policy_loss, sample_index, token_weights


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


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_logprobs_and_entropy_match_the_separate_functions_with_gradients(temperature):
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (1, 7))
    fused_logits = torch.randn(1, 7, 11, requires_grad=True)
    ref_logits = fused_logits.detach().clone().requires_grad_(True)
    logprobs, entropy = token_logprobs_and_entropy(fused_logits, ids, temperature, entropy_grad=True)
    ref_logprobs = token_logprobs(ref_logits, ids, temperature)
    ref_entropy = token_entropy(ref_logits, temperature, grad=True)
    torch.testing.assert_close(logprobs, ref_logprobs)
    torch.testing.assert_close(entropy, ref_entropy)
    (logprobs.sum() + 0.3 * entropy.sum()).backward()
    (ref_logprobs.sum() + 0.3 * ref_entropy.sum()).backward()
    torch.testing.assert_close(fused_logits.grad, ref_logits.grad)
    assert not token_logprobs_and_entropy(fused_logits, ids, temperature)[1].requires_grad  # logging only


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("chunk_rows", [None, 2, 3])
def test_chunked_logprobs_match_log_softmax_in_value_and_gradient(chunk_rows, entropy_grad):
    """Chunks of 2 or 3 of 7 rows (one ragged), weighted upstream gradients, temperature 0.7."""
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(1, 7, 50, generator=g)).requires_grad_(True)
    targets = torch.randint(0, 50, (1, 7), generator=g)
    w_lp, w_ent = torch.randn(1, 7, generator=g), torch.randn(1, 7, generator=g)
    logprobs, entropy = target_logprobs_and_entropy(logits, targets, 0.7, entropy_grad, chunk_rows)
    (logprobs * w_lp + entropy * w_ent).sum().backward()
    ref = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(ref / 0.7, -1)
    ref_entropy = -(logp.exp() * logp).sum(-1)
    ref_loss = logp.gather(-1, targets[..., None]).squeeze(-1) * w_lp
    if entropy_grad:
        ref_loss = ref_loss + ref_entropy * w_ent
    ref_loss.sum().backward()
    torch.testing.assert_close(logprobs, logp.gather(-1, targets[..., None]).squeeze(-1))
    torch.testing.assert_close(entropy, ref_entropy.detach())
    torch.testing.assert_close(logits.grad, ref.grad)
    assert entropy.requires_grad == entropy_grad


def _cfg(**kw) -> LossConfig:
    return LossConfig(**kw)


def _one_sample(n: int) -> torch.Tensor:
    return torch.zeros(1, n, dtype=torch.long)


def test_aipo_loss_worked_example_values_and_gradient():
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mu = torch.tensor([[-1.0, -2.0 - math.log(2)]])  # ratios [1, 2]
    advantages = torch.tensor([[1.0, -1.0]])
    mask = torch.tensor([[True, True]])
    terms = policy_loss(logprobs, mu, advantages, mask, _one_sample(2), _cfg(max_ratio=1.5), scale=0.5)
    terms.loss.backward()
    assert terms.loss.item() == pytest.approx(-1.0)
    assert terms.loss_sum.item() == pytest.approx(-2.0)  # unscaled
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, 0.75]]))
    assert terms.mismatch_kl_sum.item() == pytest.approx(1 - math.log(2))
    assert terms.clipped.item() == 1


def test_ppo_clip_worked_example_zeroes_the_gradient_of_clipped_tokens():
    # r = [1.5, 0.5, 1.1], A = [1, -1, 1], eps 0.2 → per token [-1.2, 0.8, -1.1]; tokens 0 and 1 clipped.
    mu = torch.tensor([[0.0, 0.0, 0.0]])
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.1]])).requires_grad_()
    advantages = torch.tensor([[1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    terms = policy_loss(logprobs, mu, advantages, mask, _one_sample(3), _cfg(type="ppo"), scale=1.0)
    terms.loss.backward()
    assert terms.loss_sum.item() == pytest.approx(-1.2 + 0.8 - 1.1)
    assert terms.clipped.item() == 2
    # ∂(−r·A)/∂log π = −r·A on the unclipped token, 0 where the clipped branch is taken.
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, -1.1]]))


def test_ppo_asymmetric_clip_uses_clip_high_above_and_clip_low_below():
    mu = torch.zeros(1, 2)
    logprobs = torch.log(torch.tensor([[1.25, 0.75]]))
    advantages = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    cfg = _cfg(type="ppo", clip_low=0.1, clip_high=0.3)
    terms = policy_loss(logprobs, mu, advantages, mask, _one_sample(2), cfg, scale=1.0)
    # 1.25 < 1.3 → unclipped −1.25; 0.75 < 0.9 → clipped at 0.9: −min(−0.75, −0.9) = 0.9
    assert terms.loss_sum.item() == pytest.approx(-1.25 + 0.9)
    assert terms.clipped.item() == 1


def test_gspo_uses_one_sequence_ratio_per_sample():
    # Sample 0 (tokens 0, 1): log ratios [ln 2, 0] → s = √2 on both; sample 1 (token 2): ratio 1.
    mu = torch.tensor([[-1.0 - math.log(2), -1.0, -3.0]])
    logprobs = torch.tensor([[-1.0, -1.0, -3.0]], requires_grad=True)
    advantages = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    samples = torch.tensor([[0, 0, 1]])
    cfg = _cfg(type="gspo", clip_low=0.5, clip_high=0.5)
    terms = policy_loss(logprobs, mu, advantages, mask, samples, cfg, scale=1.0)
    terms.loss.backward()
    s = math.sqrt(2)
    assert terms.loss_sum.item() == pytest.approx(-s - s + 1.0)
    # Gradient of −s_i,t·A_t w.r.t. log π_t is −s_i·A_t (the sequence ratio, not the token's own ratio 2).
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-s, -s, 1.0]]))
    # With a tight clip (1 ± 0.2) sample 0's ratio √2 is clipped on both tokens.
    tight = policy_loss(logprobs, mu, advantages, mask, samples, _cfg(type="gspo"), scale=1.0)
    assert tight.clipped.item() == 2
    assert tight.loss_sum.item() == pytest.approx(-1.2 - 1.2 + 1.0)


def test_sequence_normalisation_weighs_every_sample_equally():
    # Sample 0 has 3 loss tokens, sample 1 has 1: each token of sample 0 weighs 1/3.
    mask = torch.tensor([[False, True, True, True, True]])
    samples = torch.tensor([[0, 0, 0, 0, 1]])
    torch.testing.assert_close(token_weights(mask, samples, "sequence"), torch.tensor([[0, 1 / 3, 1 / 3, 1 / 3, 1.0]]))
    torch.testing.assert_close(token_weights(mask, samples, "token"), mask.float())
    logprobs = torch.full((1, 5), -1.0, requires_grad=True)
    advantages = torch.tensor([[0.0, 3.0, 3.0, 3.0, 1.0]])
    terms = policy_loss(logprobs, logprobs.detach(), advantages, mask, samples, _cfg(norm="sequence"), scale=0.5)
    terms.loss.backward()
    # per token −A·log π = A; sample means: 3 and 1 → sum 4, × scale 0.5 (= 1 / 2 samples)
    assert terms.loss.item() == pytest.approx(2.0)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.5, -0.5, -0.5, -0.5]]))


def test_kl_and_entropy_terms_are_off_by_default_and_add_when_set():
    logprobs = torch.tensor([[-1.0]], requires_grad=True)
    mu = torch.tensor([[-1.0 - math.log(2)]])  # log r = ln 2
    advantages, mask, samples = torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), _one_sample(1)
    entropy = torch.tensor([[0.5]])
    base = policy_loss(logprobs, mu, advantages, mask, samples, _cfg(), 1.0, entropy=entropy)
    assert base.loss_sum.item() == 0.0
    with_terms = policy_loss(logprobs, mu, advantages, mask, samples, _cfg(kl_coef=0.1, entropy_coef=0.2), 1.0,
                             entropy=entropy)  # fmt: skip
    # k3(π‖μ) = exp(−ln 2) + ln 2 − 1 = 0.1931; entropy bonus −0.2·0.5
    assert with_terms.loss_sum.item() == pytest.approx(0.1 * (0.5 + math.log(2) - 1) - 0.1)
    with_terms.loss.backward()
    # ∂k3/∂log π = 1 − exp(−log r) = 0.5
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.05]]))


def test_sample_index_from_cu_seqlens():
    assert sample_index(torch.tensor([0, 2, 3], dtype=torch.int32), 3).tolist() == [[0, 0, 1]]
