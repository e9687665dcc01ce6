"""Per-token policy steps on the trainer's side: trainer step n measures each loss token's lag n − (the step
that sampled it) from the rank file's `policy_steps`, reports `token_lag_mean` / `token_lag_max`, and with
`loss.max_token_lag` masks older tokens like the ratio masks do (no gradient, still counted in N, `is_masked/lag`).
"""

import math
from dataclasses import replace

import pytest
import torch

from prime_rl.configs.trainer import LossConfig, TrainerConfig
from prime_rl.protocol.records import PackedRow, Sample, write_rank_file
from prime_rl.trainer.logprobs import forward_logprobs
from prime_rl.trainer.micro_batch import MicroBatch
from prime_rl.trainer.model import build_model
from prime_rl.trainer.optim import build_optimizer
from prime_rl.trainer.parallel import apply_fsdp
from prime_rl.trainer.rl.loss import policy_loss, token_lag
from prime_rl.trainer.rl.train import load_micro_batches, train_step
from tests.samples import on_policy_sample

# One sample of 4 positions, the first a prompt token (as in test_loss_masks.py): r = [·, 3, 1, 0.25].
PI = torch.tensor([[0.5, 0.9, 0.5, 0.1]])
MU = torch.tensor([[0.01, 0.3, 0.5, 0.4]])
MASK = torch.tensor([[False, True, True, True]])
ONE_SAMPLE = torch.zeros(1, 4, dtype=torch.long)


def _loss(lag, **kw):
    logprobs = PI.log().requires_grad_()
    terms = policy_loss(logprobs, MU.log(), torch.tensor([[0.0, 1.0, 1.0, 1.0]]), MASK, ONE_SAMPLE, LossConfig(**kw),
                        scale=1.0, lag=lag)  # fmt: skip
    terms.loss.backward()
    return terms, logprobs.grad


def test_token_lag_is_the_trained_step_minus_each_tokens_policy_step():
    assert token_lag(torch.tensor([[-1, 3, 5, 4]], dtype=torch.int32), 5).tolist() == [[-1, 2, 0, 1]]


def test_a_token_older_than_max_token_lag_gets_no_gradient_and_counts_as_masked():
    # Tokens sampled 2, 1 steps ago and one of unknown step (-1: never masked).
    terms, grad = _loss(torch.tensor([[-1, 2, 1, -1]]), max_token_lag=1)
    assert terms.rule_masks["lag"].tolist() == [[False, True, False, False]]
    assert terms.masked.tolist() == [[False, True, False, False]]
    # aipo: ∂ℓ/∂log π = −min(r, 8)·A = [−3, −1, −0.25]; the lagging token's is gone, the others unchanged.
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, -1.0, -0.25]]))
    assert terms.loss_sum.item() == pytest.approx(-math.log(0.5) - 0.25 * math.log(0.1))


def test_lag_and_ratio_masks_combine_and_report_their_own_tokens():
    terms, _ = _loss(torch.tensor([[-1, 0, 3, 0]]), max_token_lag=2, mask={"token_low": 0.5})  # r = 0.25 < 0.5
    assert terms.rule_masks["lag"].tolist() == [[False, False, True, False]]
    assert terms.rule_masks["token"].tolist() == [[False, False, False, True]]
    assert terms.masked.tolist() == [[False, False, True, True]]


def test_without_max_token_lag_or_without_steps_nothing_is_masked_for_lag():
    terms, grad = _loss(torch.tensor([[-1, 9, 9, 9]]))  # unset: off
    assert "lag" not in terms.rule_masks and not terms.masked.any() and grad[0, 1:].abs().min() > 0
    terms, _ = _loss(None, max_token_lag=0)  # a rank file without policy steps: the rule is there, masks nothing
    assert not terms.rule_masks["lag"].any() and not terms.masked.any()


def _sample(model, ids: list[int], advantage: float, steps: list[int] | None) -> Sample:
    """Token ids with 3 prompt tokens, μ = the model's own logprobs (every ratio 1) and per-token policy steps."""
    return on_policy_sample(model, ids, 3, advantage, policy_steps=None if steps is None else [-1] * 3 + steps)


def _step_5(tiny_model, tmp_path, one_rank, late_advantage: float):
    """Trainer step 5 on a rank file: sample a (9 loss tokens, sampled by steps 5 ×4 then 3 ×5: a swap inside the
    request), sample b (5 loss tokens, step 4), a sample without steps (5 loss tokens) and a padding row."""
    config = TrainerConfig(model={"name": str(tiny_model)}, output_dir=tmp_path, loss={"max_token_lag": 1})
    model = build_model(str(tiny_model))
    apply_fsdp(model, one_rank, torch.float32)
    a = _sample(model, list(range(10, 22)), 1.0, [5] * 4 + [3] * 5)
    a = replace(a, advantages=a.advantages[:7] + [late_advantage] * 5)  # only the lagging tokens' advantage varies
    b = _sample(model, list(range(200, 208)), -1.0, [4] * 5)
    plain = _sample(model, list(range(40, 48)), 0.5, None)
    write_rank_file(tmp_path, 5, 0, [PackedRow.pack([a, b], 1.0), PackedRow.pack([plain], 1.0),
                                     PackedRow.padding(4, 1.0)])  # fmt: skip
    mbs = load_micro_batches(config, 5, one_rank, {})
    assert mbs[0].policy_steps.tolist() == [[-1] * 3 + [5] * 4 + [3] * 5 + [-1] * 3 + [4] * 5]
    assert mbs[1].policy_steps.numel() == 0
    with torch.no_grad():
        before = [forward_logprobs(model, mb, torch.device("cpu")).logprobs[0] for mb in mbs[:2]]
    return train_step(model, build_optimizer(model, config.optim), mbs, config, one_rank, step=5), before


def test_trainer_step_masks_lagging_tokens_and_reports_the_lag(tiny_model, tmp_path, one_rank):
    stats, (ab, plain) = _step_5(tiny_model, tmp_path, one_rank, late_advantage=1.0)
    # 19 loss tokens; lags: a 0 ×4 and 2 ×5 (masked: > 1), b 1 ×5; the plain sample's are unknown (never masked).
    assert stats.num_loss_tokens == 19
    assert stats.means["is_masked/lag"] == stats.means["is_masked"] == pytest.approx(5 / 19)
    assert stats.means["token_lag_mean"] == pytest.approx((5 * 2 + 5 * 1) / 14)
    assert stats.means["token_lag_max"] == 2
    # On-policy (r = 1): loss = −Σ A·log π / N over the kept tokens, N still counting the 5 masked ones.
    kept = ab[3:7].sum() - ab[15:20].sum() + 0.5 * plain[3:8].sum()
    assert stats.loss == pytest.approx(-kept.item() / 19, rel=1e-5)
    # The masked tokens give no gradient: a 100x advantage on them changes nothing.
    again, _ = _step_5(tiny_model, tmp_path / "again", one_rank, late_advantage=100.0)
    assert again.loss == pytest.approx(stats.loss, rel=1e-6) and again.grad_norm == pytest.approx(stats.grad_norm)


def test_without_the_trained_step_no_lag_is_measured(tiny_model, tmp_path, one_rank):
    config = TrainerConfig(model={"name": str(tiny_model)}, output_dir=tmp_path)
    model = build_model(str(tiny_model))
    apply_fsdp(model, one_rank, torch.float32)
    mb = MicroBatch.pack([_sample(model, list(range(10, 22)), 1.0, [0] * 9)], 1.0)
    stats = train_step(model, build_optimizer(model, config.optim), [mb], config, one_rank)
    assert not any(key.startswith("token_lag") for key in stats.means) and "is_masked/lag" not in stats.means


@pytest.mark.parametrize(("async_level", "lag"), [(1, 0), (3, 2)])
def test_max_token_lag_below_async_level_is_refused_since_it_masks_every_token(tmp_path, async_level, lag):
    """Step n's tokens are async_level steps old or older: a smaller max_token_lag would leave no gradient."""
    with pytest.raises(ValueError, match=f"{lag} < async_level \\({async_level}\\) masks every token"):
        TrainerConfig(output_dir=tmp_path, async_level=async_level, loss={"max_token_lag": lag})
    assert TrainerConfig(output_dir=tmp_path, async_level=async_level, loss={"max_token_lag": async_level})
