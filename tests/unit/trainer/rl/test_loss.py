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
    # Sequence normalisation (always, for gspo): each of sample 0's two tokens weighs 1/2.
    assert terms.loss_sum.item() == pytest.approx(-s / 2 - s / 2 + 1.0)
    # Gradient of −s_i,t·A_t / |y_i| w.r.t. log π_t is −s_i·A_t / |y_i| (the sequence ratio, not the token's own 2).
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-s / 2, -s / 2, 1.0]]))
    # With a tight clip (1 ± 0.2) sample 0's ratio √2 is clipped on both tokens.
    tight = policy_loss(logprobs, mu, advantages, mask, samples, _cfg(type="gspo", clip_low=0.2, clip_high=0.2), 1.0)
    assert tight.clipped.item() == 2
    assert tight.loss_sum.item() == pytest.approx(-1.2 / 2 - 1.2 / 2 + 1.0)


def test_gspo_by_default_is_the_papers_sequence_level_objective():
    """J = 1/G Σ_i min(s_i A_i, clip(s_i, 1 − 3e-4, 1 + 4e-4) A_i), s_i = (π(y_i)/μ(y_i))^(1/|y_i|), by hand, in
    value and gradient (autograd of that formula); scale = 1/G as the trainer passes with norm "sequence"."""
    lengths, a = [3, 1, 2], [1.0, -1.0, 1.0]
    # per-token log ratios; sample means: 1e-4 (s inside the band), -1e-3 (below 1 − 3e-4), 6e-4 (above 1 + 4e-4)
    log_r = [[1e-4, 3e-4, -1e-4], [-1e-3], [0.0, 1.2e-3]]
    pi = torch.tensor([[-1.0, -2.0, -0.5, -1.5, -0.7, -3.0]], requires_grad=True)
    mu = pi.detach() - torch.tensor([[x for row in log_r for x in row]])
    samples = torch.tensor([[0, 0, 0, 1, 2, 2]])
    advantages = torch.tensor([[a[i] for i, n in enumerate(lengths) for _ in range(n)]])
    cfg = LossConfig(type="gspo")
    assert (cfg.norm, cfg.clip_low, cfg.clip_high) == ("sequence", 3e-4, 4e-4)
    terms = policy_loss(pi, mu, advantages, torch.ones(1, 6, dtype=torch.bool), samples, cfg, scale=1 / 3)
    terms.loss.backward()

    s = [math.exp(sum(row) / len(row)) for row in log_r]  # [1.0001, 0.999, 1.0006]
    hand = -sum(min(si * ai, min(max(si, 1 - 3e-4), 1 + 4e-4) * ai) for si, ai in zip(s, a, strict=True)) / 3
    assert terms.loss.item() == pytest.approx(hand, rel=1e-6)
    # Clipped: sample 1 (s = 0.999 < 1 − 3e-4 with A < 0) and sample 2's two tokens (s = 1.0006 > 1 + 4e-4, A > 0).
    assert terms.clipped.item() == 3

    ref = pi.detach().clone().requires_grad_()
    paper = 0.0
    for i, (start, end) in enumerate([(0, 3), (3, 4), (4, 6)]):
        si = ((ref[0, start:end] - mu[0, start:end]).mean()).exp()
        paper = paper - torch.minimum(si * a[i], si.clamp(1 - 3e-4, 1 + 4e-4) * a[i]) / 3
    paper.backward()
    torch.testing.assert_close(pi.grad, ref.grad)


def test_gspo_refuses_token_normalisation_and_keeps_clips_the_user_sets():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="'token' with loss.type = 'gspo' weighs each sample"):
        LossConfig(type="gspo", norm="token")
    assert (LossConfig(type="gspo", clip_high=0.01).clip_low, LossConfig(type="gspo", clip_high=0.01).clip_high) == (
        3e-4, 0.01
    )  # fmt: skip
    assert (LossConfig(type="ppo").norm, LossConfig(type="ppo").clip_low) == ("token", 0.2)  # ppo unchanged


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


def test_one_token_with_a_tiny_ratio_adds_at_most_kl_max_to_the_k3_penalty():
    """Uncapped, log r = ln 1e-6 on one token added 1e6 · kl_coef to the step; capped (KL_MAX = 10, verl's bound)
    it adds 10 and no gradient, while a token with a moderate ratio keeps its exact k3 and gradient."""
    from prime_rl.trainer.rl.loss import KL_MAX

    logprobs = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    mu = torch.tensor([[-1.0 + math.log(1e6), -1.0 - math.log(2), -1.0]])  # r = [1e-6, 2, 1]
    mask, samples = torch.ones(1, 3, dtype=torch.bool), _one_sample(3)
    terms = policy_loss(logprobs, mu, torch.zeros(1, 3), mask, samples, _cfg(kl_coef=1.0), scale=1.0)
    terms.loss.backward()
    k3_of_2 = 0.5 + math.log(2) - 1
    assert KL_MAX == 10.0 and terms.loss_sum.item() == pytest.approx(KL_MAX + k3_of_2)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.5, 0.0]]))
    extreme = torch.tensor([[-200.0]], requires_grad=True)  # exp(200) overflows float32: still finite
    terms = policy_loss(extreme, torch.zeros(1, 1), torch.zeros(1, 1), mask[:, :1], samples[:, :1],
                        _cfg(kl_coef=1.0), scale=1.0)  # fmt: skip
    terms.loss.backward()
    assert terms.loss_sum.item() == KL_MAX and extreme.grad.item() == 0.0


def test_sample_index_from_cu_seqlens():
    assert sample_index(torch.tensor([0, 2, 3], dtype=torch.int32), 3).tolist() == [[0, 0, 1]]
