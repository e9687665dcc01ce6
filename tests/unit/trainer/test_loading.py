"""Sharded loading (trainer/loading.py): each rank reads only its shards, and the model it trains is exactly the
one a whole load gives: every tensor, the rotary buffers, a tied head still tied (one optimizer entry), LoRA
adapters initialised with B = 0, MoE experts that transformers fuses at load; on 1 rank in-process and on 2 ranks
under real torchrun (gloo). A checkpoint lacking a tensor is refused by name."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from prime_rl.configs.trainer import TrainerConfig
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.loading import build_sharded
from prime_rl.trainer.model import build_model
from prime_rl.utils.tiny_model import create_tiny_model


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    """Qwen3-0.6B's layer shape, one layer, its head tied to the embeddings as the real model's is."""
    return create_tiny_model(
        tmp_path_factory.mktemp("models") / "tied", "qwen3", preset="qwen3-0.6b", num_layers=1, vocab_size=1024
    )


def config(model: Path, tmp_path: Path, lora: bool = False) -> TrainerConfig:
    extra = {"lora": {"rank": 4, "alpha": 8}} if lora else {}
    return TrainerConfig(model={"name": str(model), **extra}, output_dir=tmp_path, device="cpu")


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora"])
def test_one_rank_reads_exactly_the_whole_load(tied_model, tmp_path, one_rank, lora):
    cfg = config(tied_model, tmp_path, lora)
    model = build_sharded(cfg, one_rank)
    whole = build_model(str(tied_model), lora=cfg.model.lora)
    ours = full_state(model)
    assert set(ours) == set(whole.state_dict())
    for key, value in whole.state_dict().items():
        if ".lora_" not in key:
            assert torch.equal(ours[key], value), key
    assert all(torch.equal(b, dict(model.named_buffers())[k]) for k, b in whole.named_buffers())
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert len(list(model.parameters())) == len(list(whole.parameters()))  # the tied head: one entry
    adapters = {k: v for k, v in ours.items() if ".lora_" in k}
    assert len(adapters) == (2 * len(cfg.model.lora.target_modules) if lora else 0)  # A and B, one layer
    assert all((v == 0).all() == ("lora_B" in k) for k, v in adapters.items())
    assert model.training and not any(p.is_meta for p in model.parameters())


WORKER = """
import json, sys, torch
from prime_rl.configs.trainer import TrainerConfig
from prime_rl.trainer.loading import build_sharded
from prime_rl.trainer.model import build_model
from prime_rl.trainer.parallel import close_distributed, init_distributed
model_dir, out, lora = sys.argv[1], sys.argv[2], sys.argv[3] == "lora"
cfg = TrainerConfig(model={"name": model_dir, **({"lora": {"rank": 4, "alpha": 8}} if lora else {})}, output_dir=out)
world = init_distributed("cpu")
model = build_sharded(cfg, world)
local = sum(p.to_local().numel() for p in model.parameters())
whole = build_model(model_dir, lora=cfg.model.lora)
full = {k: v.full_tensor() for k, v in model.state_dict().items()}
differ = [k for k, v in whole.state_dict().items() if ".lora_" not in k and not torch.equal(v, full[k])]
tied = model.lm_head.weight is model.get_input_embeddings().weight or not model.config.tie_word_embeddings
report = {"rank": world.rank, "local": local, "total": sum(p.numel() for p in whole.parameters()), "differ": differ,
          "tied": tied}
with open(f"{out}/rank{world.rank}.json", "w") as f:  # a file each: two ranks' prints can interleave on one pipe
    json.dump(report, f)
close_distributed()
"""


@pytest.mark.parametrize("kind", ["plain", "lora", "moe"])
def test_two_ranks_each_hold_half_and_together_the_whole_load(tied_model, tmp_path, kind):
    model = create_tiny_model(tmp_path / "moe", "qwen3_moe") if kind == "moe" else tied_model
    cmd = [sys.executable, "-m", "prime_rl.launch.torchrun", "--standalone", "--nproc-per-node", "2", "--no-python",
           sys.executable, "-c", WORKER, str(model), str(tmp_path), kind]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert r["differ"] == [] and r["tied"], r
        assert abs(r["local"] - r["total"] / 2) <= r["total"] * 0.01, r  # half, up to uneven row splits
    assert sum(r["local"] for r in ranks) == ranks[0]["total"]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_an_architecture_converted_at_load_reads_its_shards_too(tmp_path, one_rank, arch):
    """transformers fuses these checkpoints' per-expert weights at load: the sharded read places each checkpoint
    tensor through transformers' own reverse conversion, and the model is the whole load's."""
    moe = create_tiny_model(tmp_path / arch, arch)
    model = build_sharded(config(moe, tmp_path), one_rank)
    whole = build_model(str(moe))
    ours = full_state(model)
    assert ours.keys() == whole.state_dict().keys() and any("experts.gate_up_proj" in k for k in ours)
    for key, value in whole.state_dict().items():
        assert torch.equal(ours[key], value), key


def test_a_checkpoint_lacking_a_tensor_is_refused_naming_it(tied_model, tmp_path, one_rank):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tied_model.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(tied_model / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(TrainerError, match=r"lacks 1 of the model's tensors .*\['model\.layers\.0\.mlp\.up_proj"):
        build_sharded(config(broken, tmp_path), one_rank)
