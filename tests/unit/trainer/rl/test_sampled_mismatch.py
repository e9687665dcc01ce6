"""The trainer's half of the parity gate's sampled-token check (trainer/rl/parity.py): at a gate step n, the k3 of
every loss token that weight step n sampled, per sample and server, from the loss the step computes anyway;
written per rank to `parity/sampled_step_n_rank_r.json` for the orchestrator (docs/orchestrator.md)."""

import math
from dataclasses import replace

import pytest
import torch

from prime_rl.configs.trainer import TrainerConfig
from prime_rl.protocol.parity import read_sampled, sampled_file
from prime_rl.protocol.records import PackedRow, Sample, read_rank_file, write_rank_file
from prime_rl.trainer.logprobs import forward_logprobs
from prime_rl.trainer.micro_batch import MicroBatch
from prime_rl.trainer.model import build_model
from prime_rl.trainer.optim import build_optimizer
from prime_rl.trainer.parallel import apply_fsdp
from prime_rl.trainer.rl.parity import SampledMismatch
from prime_rl.trainer.rl.train import rl_loss, train_step
from tests.samples import sample as make_sample


def sample(mu: list[float], steps: list[int], servers: list[int]) -> Sample:
    """3 prompt tokens, then the completion; `mu` the sampler's logprobs of every position."""
    ids = list(range(10, 10 + len(mu)))
    return make_sample(ids, 3, logprobs=mu, policy_steps=[-1] * 3 + steps, servers=[-1] * 3 + servers)


def test_the_rank_file_carries_each_tokens_server(tmp_path):
    a = sample([0.0] * 6, [4, 4, 4], [1, 1, 0])  # a multi-turn sample whose last turn went to server 0
    write_rank_file(tmp_path, 4, 0, [PackedRow.pack([a, replace(a, servers=None)], 1.0)])
    [row] = read_rank_file(tmp_path / "rollouts" / "step_4" / "rank_0.safetensors", 4, 0)
    mb = MicroBatch.from_row(row)
    assert mb.token_server.tolist() == [[-1, -1, -1, 1, 1, 0] + [-1] * 6]


def test_a_gate_step_reports_the_on_policy_tokens_of_each_sample_and_server(tiny_model, tmp_path, one_rank):
    config = TrainerConfig(model={"name": str(tiny_model)}, output_dir=tmp_path, parity={"interval": 2})
    model = build_model(str(tiny_model))
    apply_fsdp(model, one_rank, torch.float32)
    n = 9
    probe = MicroBatch.pack([sample([0.0] * n, [0] * 6, [0] * 6)], 1.0)
    with torch.no_grad():
        pi = forward_logprobs(model, probe, torch.device("cpu")).logprobs[0].tolist()
    # a: server 1, its first 4 tokens sampled by step 4 (0.1 below π: d = 0.1), then 2 by step 3 (a swap: left
    # out); b: server 0, on-policy, its last token 2 above π (d = −2)
    a = sample([p - 0.1 for p in pi[:7]] + pi[7:], [4] * 4 + [3] * 2, [1] * 6)
    b = sample(pi[:8] + [pi[8] + 2.0], [4] * 6, [0] * 6)
    sampled = SampledMismatch(config, rank=0)
    loss_fn = rl_loss(config.loss, sampled)
    for step in (3, 4):  # 3 is no gate step: nothing is collected or written
        mbs = [MicroBatch.pack([a, b], 1.0)]
        train_step(model, build_optimizer(model, config.optim), mbs, config, one_rank, loss_fn, step)
        sampled.write(step)
        model = build_model(str(tiny_model))  # the weights the servers sampled from, again
        apply_fsdp(model, one_rank, torch.float32)
    assert not sampled_file(tmp_path, 3, 0).exists()
    entries = {int(s): rest for s, *rest in read_sampled(tmp_path, 4, ranks=1)}
    k3 = math.expm1(0.1) - 0.1
    assert entries[1][0] == 4 and entries[1][1] == pytest.approx(4 * k3, rel=1e-3)
    assert entries[1][2] == pytest.approx(0.1, rel=1e-3)
    assert entries[0][0] == 6 and entries[0][1] == pytest.approx(math.expm1(-2.0) + 2.0, rel=1e-3)
    assert entries[0][2] == pytest.approx(2.0, rel=1e-4)
    assert read_sampled(tmp_path, 4, ranks=2) is None  # rank 1 has not written: not complete
