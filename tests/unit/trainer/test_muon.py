"""`optim.type = "muon"`: which parameters Muon takes, torch's update, one optimizer for schedule and checkpoints,
and the same update on FSDP-sharded weights (2 gloo ranks: this file is also their worker, under torchrun)."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from prime_rl.configs.training import OptimConfig
from prime_rl.trainer.ckpt import Progress, load_checkpoint, save_checkpoint
from prime_rl.trainer.optim import MultiOptimizer, build_optimizer, build_scheduler

MUON = OptimConfig(type="muon", lr=1e-3, muon_lr=2e-2, weight_decay=0.1, scheduler="cosine", warmup_steps=1)


def _model(path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


def _train(model, optimizer, scheduler, steps) -> None:
    for step in steps:
        ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def _assert_equal_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        q = q.full_tensor() if hasattr(q, "full_tensor") else q
        assert torch.equal(p, q), f"{name}: differs by {(p - q).abs().max().item()}"


def test_muon_takes_the_decoder_matrices_and_adamw_the_rest_of_the_trainable_parameters(tiny_model):
    model = _model(tiny_model)
    model.model.layers[1].mlp.down_proj.weight.requires_grad_(False)
    model.model.norm.weight.requires_grad_(False)
    optimizer = build_optimizer(model, MUON)
    muon, adamw = optimizer.optimizers
    names = {p: n for n, p in model.named_parameters()}
    muon_names = {names[p] for g in muon.param_groups for p in g["params"]}
    adamw_names = {names[p] for g in adamw.param_groups for p in g["params"]}
    assert len(muon_names) == 13 and all(".layers." in n and n.endswith("proj.weight") for n in muon_names)
    assert "model.layers.1.mlp.down_proj.weight" not in muon_names | adamw_names  # frozen: neither
    assert adamw_names == {"model.embed_tokens.weight", "lm_head.weight"} | {
        n for n in names.values() if "norm" in n and n != "model.norm.weight"
    }
    assert adamw.defaults["fused"] and [g["lr"] for g in optimizer.param_groups] == [2e-2, 1e-3]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.1]
    plain = build_optimizer(model, OptimConfig(lr=1e-3))
    assert type(plain) is torch.optim.AdamW and len(plain.param_groups[0]["params"]) == 23  # 25 − 2 frozen


def test_muon_step_is_torchs_muon_bitwise_and_the_schedule_drives_both_lrs(tiny_model):
    ours, theirs = _model(tiny_model), _model(tiny_model)
    optimizer = build_optimizer(ours, MUON)
    scheduler = build_scheduler(optimizer, MUON, max_steps=3)
    assert isinstance(optimizer, MultiOptimizer)
    adamw = optimizer.optimizers[1]
    matrices = [p for n, p in theirs.named_parameters() if ".layers." in n and p.ndim == 2]
    rest = [p for n, p in theirs.named_parameters() if not (".layers." in n and p.ndim == 2)]
    reference = [
        torch.optim.Muon(matrices, lr=2e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(rest, lr=1e-3, weight_decay=0.1, fused=True),
    ]
    lrs = []
    for step in range(3):
        _train(ours, optimizer, scheduler, [step])
        lrs.append([g["lr"] for g in optimizer.param_groups])
        for opt, factor in zip(reference, (2e-2, 1e-3), strict=True):
            opt.param_groups[0]["lr"] = factor * [1.0, 1.0, 0.5][step]  # warmup 1, cosine over 2 steps
        _train(theirs, _Both(reference), None, [step])
    _assert_equal_params(ours, theirs)
    assert [lr for pair in lrs for lr in pair] == pytest.approx([2e-2, 1e-3, 1e-2, 5e-4, 0.0, 0.0])
    assert adamw.state[adamw.param_groups[0]["params"][0]]["step"].item() == 3


class _Both:
    def __init__(self, optimizers):
        self.optimizers = optimizers

    def step(self):
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none=True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def test_a_resumed_muon_run_is_bitwise_an_uninterrupted_one(tiny_model, tmp_path, one_rank):
    from prime_rl.trainer.weights import build_model_files

    def build():
        model = _model(tiny_model)
        optimizer = build_optimizer(model, MUON)
        return model, optimizer, build_scheduler(optimizer, MUON, max_steps=4)

    straight = build()
    _train(*straight, range(4))
    first = build()
    _train(*first, range(2))
    save_checkpoint(tmp_path, 2, *first, Progress(step=2), build_model_files(str(tiny_model)), rank=0)
    resumed = build()
    assert load_checkpoint(tmp_path, 2, *resumed, rank=0).step == 2
    _, optimizer, _ = resumed
    assert all(opt.state is optimizer.state for opt in optimizer.optimizers)  # re-linked after the load
    assert len(optimizer.state) == 25 and "momentum_buffer" in optimizer.state[optimizer.param_groups[0]["params"][0]]
    _train(*resumed, range(2, 4))
    _assert_equal_params(straight[0], resumed[0])
    assert [g["lr"] for g in resumed[1].param_groups] == [g["lr"] for g in straight[1].param_groups]


def test_muon_settings_without_muon_are_a_config_error():
    with pytest.raises(ValidationError, match=r"optim.muon-lr, optim.muon-momentum apply only with optim.type"):
        OptimConfig(muon_lr=0.02, muon_momentum=0.9)
    with pytest.raises(ValidationError, match="muon_ns_steps"):
        OptimConfig(type="muon", muon_ns_steps=100)  # torch refuses 100 or more
    assert OptimConfig(type="muon", muon_lr=0.02).muon_lr == 0.02


@pytest.mark.slow
def test_two_fsdp_ranks_take_bitwise_the_unsharded_muon_step_and_resume_it(tiny_model, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           str(tiny_model), str(tmp_path)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert result.stdout.count("sharded == unsharded") == 2


def _two_rank_worker(model_path: str, out: Path) -> None:
    """Each rank: a plain model and an FSDP-sharded copy see the same batches (identical on both ranks, so the
    averaged gradient is exact); Muon must leave bitwise the same weights, also across a checkpoint."""
    from prime_rl.trainer.parallel import apply_fsdp, close_distributed, init_distributed
    from prime_rl.trainer.weights import build_model_files

    d = init_distributed("cpu")
    plain = _model(model_path)
    sharded, resumed = copy.deepcopy(plain), copy.deepcopy(plain)
    for model in (sharded, resumed):
        apply_fsdp(model, d, torch.float32)
    assert type(sharded.model.layers[0].mlp.up_proj.weight).__name__ == "DTensor"
    runs = []
    for model in (plain, sharded, resumed):
        optimizer = build_optimizer(model, MUON)
        runs.append((model, optimizer, build_scheduler(optimizer, MUON, max_steps=3)))
    _train(*runs[0], range(3))
    _train(*runs[1], range(2))
    save_checkpoint(out, 2, *runs[1], Progress(step=2), build_model_files(model_path), d.rank)
    _train(*runs[1], [2])
    load_checkpoint(out, 2, *runs[2], d.rank)
    _train(*runs[2], [2])
    _assert_equal_params(plain, sharded)
    _assert_equal_params(plain, resumed)
    print(f"rank {d.rank}: sharded == unsharded", flush=True)
    close_distributed()


if __name__ == "__main__":
    _two_rank_worker(sys.argv[1], Path(sys.argv[2]))
