"""Mismatch-robust objectives on hand-computed examples: the ratio masks (token band, sequence band, binary TV),
the k2 KL penalty and a custom loss loaded from its import path (the docstring examples of trainer/rl/loss.py)."""

import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from prime_rl.configs.trainer import LossConfig
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.rl.loss import load_custom_loss, policy_loss

# One sample of 4 positions, the first a prompt token: π = [·, 0.9, 0.5, 0.1], μ = [·, 0.3, 0.5, 0.4] on the
# sampled tokens → r = [·, 3, 1, 0.25], |π − μ| = [·, 0.6, 0, 0.3], geometric-mean ratio (3·1·0.25)^⅓ = 0.909.
PI = torch.tensor([[0.5, 0.9, 0.5, 0.1]])
MU = torch.tensor([[0.01, 0.3, 0.5, 0.4]])
MASK = torch.tensor([[False, True, True, True]])
ONE_SAMPLE = torch.zeros(1, 4, dtype=torch.long)


def _loss(mask=None, advantages=(0.0, 1.0, 1.0, 1.0), samples=ONE_SAMPLE, **kw):
    logprobs = PI.log().requires_grad_()
    cfg = LossConfig(mask=mask or {}, **kw)
    terms = policy_loss(logprobs, MU.log(), torch.tensor([advantages]), MASK, samples, cfg, scale=1.0)
    terms.loss.backward()
    return terms, logprobs.grad


def test_no_mask_by_default_every_loss_token_has_a_gradient():
    terms, grad = _loss()
    assert terms.rule_masks == {} and not terms.masked.any()
    # aipo: ∂ℓ/∂log π = −min(r, 8)·A = [−3, −1, −0.25]
    torch.testing.assert_close(grad, torch.tensor([[0.0, -3.0, -1.0, -0.25]]))


def test_token_band_masks_ratios_outside_it_and_only_those():
    terms, grad = _loss(mask={"token_low": 0.5, "token_high": 2.0})
    assert terms.rule_masks["token"].tolist() == [[False, True, False, True]]
    assert terms.masked.tolist() == [[False, True, False, True]]
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, -1.0, 0.0]]))
    # The loss is the kept token's alone: −1·1·ln 0.5 (the masked tokens are not re-weighted).
    assert terms.loss_sum.item() == pytest.approx(-math.log(0.5))


def test_one_sided_token_band():
    terms, _ = _loss(mask={"token_high": 2.0})
    assert terms.masked.tolist() == [[False, True, False, False]]
    terms, _ = _loss(mask={"token_low": 0.5})
    assert terms.masked.tolist() == [[False, False, False, True]]


def test_sequence_band_masks_the_whole_sample_on_its_geometric_mean_ratio():
    inside, grad = _loss(mask={"sequence_low": 0.5, "sequence_high": 2.0})  # 0.909 inside
    assert not inside.masked.any() and grad[0, 1:].abs().min() > 0
    outside, grad = _loss(mask={"sequence_low": 0.95, "sequence_high": 2.0})  # 0.909 < 0.95
    assert outside.rule_masks["sequence"].tolist() == [[False, True, True, True]]
    assert outside.loss_sum.item() == 0.0 and not grad.any()


def test_sequence_band_is_per_sample():
    # Sample 0 = positions 0-1 (ratio 3 alone), sample 1 = positions 2-3 (ratios 1 and 0.25: mean 0.5).
    terms, _ = _loss(mask={"sequence_low": 0.8, "sequence_high": 2.0}, samples=torch.tensor([[0, 0, 1, 1]]))
    assert terms.masked.tolist() == [[False, True, True, True]]
    terms, _ = _loss(mask={"sequence_low": 0.4, "sequence_high": 4.0}, samples=torch.tensor([[0, 0, 1, 1]]))
    assert not terms.masked.any()


def test_binary_tv_masks_tokens_whose_probabilities_differ_by_more_than_tv_max():
    terms, grad = _loss(mask={"tv_max": 0.4})  # |π − μ| = [0.6, 0, 0.3]
    assert terms.rule_masks["tv"].tolist() == [[False, True, False, False]]
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, -1.0, -0.25]]))
    terms, _ = _loss(mask={"tv_max": 0.25})
    assert terms.masked.tolist() == [[False, True, False, True]]


def test_rules_combine_and_each_reports_its_own_tokens():
    terms, _ = _loss(mask={"token_high": 2.0, "tv_max": 0.25})
    assert terms.rule_masks["token"].tolist() == [[False, True, False, False]]
    assert terms.rule_masks["tv"].tolist() == [[False, True, False, True]]
    assert terms.masked.tolist() == [[False, True, False, True]]


@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
def test_masks_apply_to_every_loss_type(loss_type):
    terms, grad = _loss(mask={"token_low": 0.5, "token_high": 2.0}, type=loss_type, clip_low=0.9, clip_high=9.0)
    assert terms.masked.tolist() == [[False, True, False, True]]
    assert grad[0, 1] == 0 and grad[0, 3] == 0 and grad[0, 2] != 0


def test_masks_apply_to_the_kl_and_entropy_terms_too():
    terms, grad = _loss(mask={"token_low": 0.5, "token_high": 2.0}, advantages=(0.0,) * 4, kl_coef=1.0)
    # Only token 2 (r = 1) is kept, and its KL is 0 with gradient 0.
    assert terms.loss_sum.item() == 0.0 and not grad.any()


def test_bands_must_be_ordered():
    with pytest.raises(ValidationError, match="token_low"):
        LossConfig(mask={"token_low": 2.0, "token_high": 0.5})
    with pytest.raises(ValidationError, match="sequence_low"):
        LossConfig(mask={"sequence_low": 1.0, "sequence_high": 1.0})
    with pytest.raises(ValidationError):
        LossConfig(mask={"tv_max": 1.5})


@pytest.mark.parametrize(
    ("band", "edge"),
    [
        ({"token_low": 1.1}, {"token_low": 1.0}),
        ({"token_high": 0.9}, {"token_high": 1.0}),
        ({"sequence_low": 1.01}, {"sequence_low": 1.0}),
        ({"sequence_low": 0.1, "sequence_high": 0.5}, {"sequence_low": 0.1, "sequence_high": 1.0}),
    ],
)
def test_a_band_that_leaves_out_ratio_1_is_refused_since_it_masks_every_on_policy_token(band, edge):
    with pytest.raises(ValidationError, match="masks every token whose ratio pi/mu is 1"):
        LossConfig(mask=band)
    LossConfig(mask=edge)  # a band ending at 1 masks one side of r = 1 only: accepted


def test_k2_penalty_value_and_gradient():
    logprobs = torch.tensor([[-1.0]], requires_grad=True)
    mu = torch.tensor([[-1.0 - math.log(2)]])  # log r = ln 2
    cfg = LossConfig(kl_coef=0.1, kl_type="k2")
    one = torch.ones(1, 1, dtype=torch.bool)
    terms = policy_loss(logprobs, mu, torch.zeros(1, 1), one, torch.zeros(1, 1, dtype=torch.long), cfg, 1.0)
    terms.loss.backward()
    assert terms.loss_sum.item() == pytest.approx(0.1 * 0.5 * math.log(2) ** 2)  # 0.1 · 0.240
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.1 * math.log(2)]]))  # ∂½(log r)²/∂log π = log r


@pytest.fixture
def custom_module(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))


@pytest.mark.parametrize("mask", [{}, {"token_low": 0.5, "token_high": 2.0}])
def test_custom_loss_module_reproduces_aipo_exactly(custom_module, mask):
    g = torch.Generator().manual_seed(0)
    mu = torch.randn(1, 12, generator=g) - 2
    base = mu + 0.8 * torch.randn(1, 12, generator=g)
    advantages = torch.randn(1, 12, generator=g)
    loss_mask = torch.rand(1, 12, generator=g) > 0.2
    samples = torch.tensor([[0] * 5 + [1] * 7])
    results = []
    for cfg in (
        LossConfig(max_ratio=1.5, kl_coef=0.05, mask=mask),
        LossConfig(type="custom", import_path="custom_loss_aipo:aipo", kwargs={"max_ratio": 1.5}, kl_coef=0.05,
                   mask=mask),
    ):  # fmt: skip
        logprobs = base.clone().requires_grad_()
        custom = load_custom_loss(cfg.import_path) if cfg.import_path else None
        terms = policy_loss(logprobs, mu, advantages, loss_mask, samples, cfg, 0.1, custom=custom)
        terms.loss.backward()
        results.append((terms, logprobs.grad))
    (aipo, aipo_grad), (custom, custom_grad) = results
    assert aipo.clipped.item() > 0
    assert torch.equal(aipo.loss, custom.loss) and torch.equal(aipo_grad, custom_grad)
    assert aipo.clipped.item() == custom.clipped.item() and torch.equal(aipo.masked, custom.masked)


def test_custom_loss_errors_name_the_import_path(custom_module):
    with pytest.raises(TrainerError, match="'no_such_module:f' does not import: ModuleNotFoundError"):
        load_custom_loss("no_such_module:f")
    with pytest.raises(TrainerError, match="'custom_loss_aipo:nope' does not import: AttributeError"):
        load_custom_loss("custom_loss_aipo:nope")
    cfg = LossConfig(type="custom", import_path="custom_loss_aipo:wrong_shape")
    logprobs = torch.zeros(1, 3, requires_grad=True)
    mask = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(TrainerError, match=r"wrong_shape' returned torch.float32 \[\]; expected a float tensor"):
        policy_loss(logprobs, logprobs.detach(), mask.float(), mask, torch.zeros(1, 3, dtype=torch.long), cfg, 1.0,
                    custom=load_custom_loss(cfg.import_path))  # fmt: skip


def test_custom_loss_config_needs_its_path_and_only_then():
    with pytest.raises(ValidationError, match="needs loss.import_path"):
        LossConfig(type="custom")
    with pytest.raises(ValidationError, match="are for loss.type = 'custom'"):
        LossConfig(import_path="a.b:c")
    with pytest.raises(ValidationError, match="import_path"):
        LossConfig(type="custom", import_path="not a path")


def test_custom_loss_kwargs_from_flags_keep_their_types(tmp_path):
    from prime_rl.configs import load_config
    from prime_rl.configs.trainer import TrainerConfig

    flags = ["--output-dir", str(tmp_path), "--loss.type", "custom", "--loss.import-path", "custom_loss_aipo:aipo"]
    flags += ["--loss.kwargs.max_ratio", "1.5", "--loss.kwargs.steps", "3", "--loss.kwargs.on", "true"]
    flags += ["--loss.kwargs.name", "x"]
    kwargs = load_config(TrainerConfig, flags).loss.kwargs
    assert kwargs == {"max_ratio": 1.5, "steps": 3, "on": True, "name": "x"}
    assert type(kwargs["steps"]) is int and type(kwargs["on"]) is bool
    assert LossConfig(type="custom", import_path="m:f", kwargs={"n": 1, "flag": True}).kwargs == {"n": 1, "flag": True}
