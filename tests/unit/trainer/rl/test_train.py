"""One trainer step in-process (one gloo rank): what it optimises, what it reports, what it refuses."""

import math

import pytest
import torch

from prime_rl.configs.trainer import TrainerConfig
from prime_rl.protocol import list_steps, rank_file, rollout_step_dir, weights_dir, weights_root
from prime_rl.protocol.records import PackedRow, Sample, write_rank_file
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.logprobs import forward_logprobs
from prime_rl.trainer.micro_batch import MicroBatch
from prime_rl.trainer.model import build_model
from prime_rl.trainer.optim import build_optimizer
from prime_rl.trainer.parallel import apply_fsdp
from prime_rl.trainer.rl.train import load_micro_batches, prune_old_steps, train_step
from tests.samples import on_policy_sample, sample


def _config(tiny_model, tmp_path, **kw) -> TrainerConfig:
    return TrainerConfig(model={"name": str(tiny_model)}, output_dir=tmp_path, **kw)


def _on_policy_batch(model, samples: list[tuple[list[int], float]], prompt_len: int = 3) -> MicroBatch:
    """Samples (token ids, advantage) whose μ logprobs are the model's own, so every ratio is 1."""
    packed = [on_policy_sample(model, ids, prompt_len, advantage) for ids, advantage in samples]
    return MicroBatch.pack(packed, temperature=1.0)


def test_train_step_moves_logprobs_along_advantages_and_reports_on_policy_metrics(tiny_model, tmp_path, one_rank):
    config = _config(tiny_model, tmp_path, optim={"lr": 1e-3})
    model = build_model(str(tiny_model))
    apply_fsdp(model, one_rank, torch.float32)
    good, bad = list(range(10, 22)), list(range(200, 208))
    mb = _on_policy_batch(model, [(good, 1.0), (bad, -1.0)])
    before = forward_logprobs(model, mb, torch.device("cpu")).logprobs.detach()[0]

    stats = train_step(model, build_optimizer(model, config.optim), [mb], config, one_rank)

    after = forward_logprobs(model, mb, torch.device("cpu")).logprobs.detach()[0]
    g, b = slice(3, 12), slice(12 + 3, 20)
    assert after[g].sum() > before[g].sum()
    assert after[b].sum() < before[b].sum()
    assert stats.num_loss_tokens == 9 + 5 and stats.num_samples == 2 and stats.num_tokens == 20
    # On-policy: every ratio is 1, so loss = −Σ A·log π / N, no mismatch, nothing clipped.
    expected_loss = -(before[g].sum() - before[b].sum()).item() / 14
    assert stats.loss == pytest.approx(expected_loss, rel=1e-5)
    assert stats.means["mismatch_kl"] == pytest.approx(0.0, abs=1e-6)
    assert stats.means["clip_frac"] == 0.0
    assert stats.grad_norm > 0 and stats.means["entropy"] > 0 and stats.peak_memory_gib > 0


def test_a_rank_file_token_outside_the_vocabulary_is_a_trainer_error_not_an_index_error(tiny_model, tmp_path, one_rank):
    config = _config(tiny_model, tmp_path)
    model = build_model(str(tiny_model))
    apply_fsdp(model, one_rank, torch.float32)
    vocab = model.get_input_embeddings().num_embeddings
    ids = [5, 6, 7, vocab, 9]
    mb = MicroBatch.pack([sample(ids, advantage=1.0)], 1.0)
    with pytest.raises(TrainerError, match=rf"outside the model's vocabulary \[0, {vocab}\): \[{vocab}\]"):
        train_step(model, build_optimizer(model, config.optim), [mb], config, one_rank)


def test_load_micro_batches_refuses_rollouts_split_over_more_ranks(tiny_model, tmp_path, one_rank):
    mb = PackedRow.padding(4, 1.0)
    write_rank_file(tmp_path, 0, 0, [mb])
    write_rank_file(tmp_path, 0, 1, [mb])
    with pytest.raises(TrainerError, match="num_train_workers must equal the trainer world size"):
        load_micro_batches(_config(tiny_model, tmp_path), 0, one_rank, {})


def test_load_micro_batches_reports_an_unreadable_rank_file(tiny_model, tmp_path, one_rank):
    path = rank_file(tmp_path, 0, 0)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a torch file")
    with pytest.raises(
        TrainerError, match=r"rank_0.safetensors: not a readable rank file \(cut short or overwritten\?\)"
    ):
        load_micro_batches(_config(tiny_model, tmp_path), 0, one_rank, {})


def test_pruning_keeps_newest_weights_and_every_unread_rollout_step(tiny_model, tmp_path):
    for step in range(5):
        rollout_step_dir(tmp_path, step).mkdir(parents=True)
    for step in range(1, 4):
        weights_dir(tmp_path, step).mkdir(parents=True)
    # Trainer just finished step 1; the orchestrator already wrote steps 2..4 (not read yet).
    prune_old_steps(_config(tiny_model, tmp_path, async_level=1, data={"keep_rollouts": 1}), step=1)
    assert list_steps(rollout_step_dir(tmp_path, 0).parent) == [2, 3, 4]
    assert list_steps(weights_root(tmp_path)) == [2, 3]


def _env_batch(model, samples: list[tuple[list[int], int, float]], env_names: list[str]) -> list[Sample]:
    """Samples (token ids, env index, δ) with μ = π − δ on the loss tokens: log r = δ on every one of them."""
    return [on_policy_sample(model, ids, 3, 1.0, shift=delta, env=env) for ids, env, delta in samples]


def test_per_env_metrics_are_means_over_each_envs_tokens_whatever_the_split(tiny_model, tmp_path, one_rank):
    """Env a: 2 samples (9 + 5 loss tokens), log r = 0.1; env b: 1 sample (6 loss tokens), log r = −0.2;
    env c: no sample. Token band high 1.05 masks every token of a (r = 1.105) and none of b (r = 0.82)."""
    envs = ["a", "b", "c"]
    spec = [(list(range(10, 22)), 0, 0.1), (list(range(200, 209)), 1, -0.2), (list(range(40, 48)), 0, 0.1)]
    config = _config(tiny_model, tmp_path, loss={"mask": {"token_high": 1.05}})
    results = []
    for split in ([[0, 1, 2]], [[0], [1, 2]]):  # one micro batch, then two
        model = build_model(str(tiny_model))
        apply_fsdp(model, one_rank, torch.float32)
        samples = _env_batch(model, spec, envs)
        mbs = [MicroBatch.pack([samples[i] for i in part], 1.0, envs) for part in split]
        results.append(train_step(model, build_optimizer(model, config.optim), mbs, config, one_rank).means)
    one, two = results
    k3 = lambda d: math.exp(d) - 1 - d  # noqa: E731  the per-token mismatch KL at log r = d
    assert one["mismatch_kl/a"] == pytest.approx(k3(0.1), rel=1e-4)
    assert one["mismatch_kl/b"] == pytest.approx(k3(-0.2), rel=1e-4)
    assert one["mismatch_kl"] == pytest.approx((14 * k3(0.1) + 6 * k3(-0.2)) / 20, rel=1e-4)
    assert one["is_masked/a"] == 1.0 and one["is_masked/b"] == 0.0
    assert one["is_masked"] == one["is_masked/token"] == pytest.approx(14 / 20)
    assert "mismatch_kl/c" not in one and "is_masked/c" not in one  # no loss tokens of c this step
    assert 0 < one["entropy/a"] and 0 < one["entropy/b"]
    assert one["entropy"] == pytest.approx((14 * one["entropy/a"] + 6 * one["entropy/b"]) / 20, rel=1e-5)
    assert two.keys() == one.keys()
    for key in one:
        assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-9), key
