"""weights/step_n: a complete, STABLE HF dir with the base model's parameter names (and shapes, for MoE too)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from prime_rl.protocol import is_stable, weights_dir
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.model import build_model
from prime_rl.trainer.parallel import apply_fsdp
from prime_rl.trainer.weights import build_model_files, check_export_layout, save_weights, write_safetensors
from prime_rl.utils.tiny_model import create_tiny_model


def test_saved_weights_are_a_loadable_hf_dir_identical_to_the_base(tiny_model, tmp_path, one_rank):
    model = build_model(str(tiny_model))
    apply_fsdp(model, one_rank, torch.float32)
    stale = weights_dir(tmp_path, 1)
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_text("half-written by a crashed run")

    path = save_weights(model, build_model_files(str(tiny_model)), tmp_path, step=1)

    assert path == weights_dir(tmp_path, 1) and is_stable(path)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file(), name
    base, saved = load_file(tiny_model / "model.safetensors"), load_file(path / "model.safetensors")
    assert saved.keys() == base.keys()
    for name in base:
        assert torch.equal(saved[name], base[name]), name
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3"
    reloaded = AutoModelForCausalLM.from_pretrained(path)
    assert AutoTokenizer.from_pretrained(path).eos_token == "<|im_end|>"
    ids = torch.tensor([[5, 6, 7]])
    original = AutoModelForCausalLM.from_pretrained(tiny_model)
    torch.testing.assert_close(reloaded(ids).logits, original(ids).logits)


def test_a_complete_weights_dir_is_replaced_whole_never_deleted_under_a_reader(
    tiny_model, tmp_path, one_rank, monkeypatch
):
    """A resumed trainer redoes a step whose weights a server may be loading: the old files stay readable by
    whoever opened them, and the path only ever shows a complete dir (it used to be rmtree'd, then rewritten)."""
    import prime_rl.trainer.weights as weights

    model = build_model(str(tiny_model))
    files = build_model_files(str(tiny_model))
    first = save_weights(model, files, tmp_path, step=2)
    reader = open(first / "model.safetensors", "rb")  # a server in the middle of loading it
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    seen_mid_save = []
    write = weights.write_own_shards

    def observed_write(*args, **kwargs):
        seen_mid_save.append(is_stable(first) and (first / "model.safetensors").is_file())
        return write(*args, **kwargs)

    monkeypatch.setattr(weights, "write_own_shards", observed_write)
    second = save_weights(model, files, tmp_path, step=2)
    assert seen_mid_save == [True]  # while the new files were written, the old dir was whole
    assert second == first and is_stable(second)
    assert torch.equal(load_file(second / "model.safetensors")["model.norm.weight"], model.model.norm.weight)
    assert len(reader.read()) > 0  # the reader finishes reading the old file
    reader.close()
    assert sorted(p.name for p in second.parent.iterdir()) == ["step_2"]  # nothing partial left behind


def test_tied_embeddings_are_stored_once_and_load_back(tiny_model, tmp_path):
    config = AutoConfig.from_pretrained(tiny_model, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config)
    model.config.save_pretrained(tmp_path)
    write_safetensors(model.state_dict(), tmp_path, torch.float32, tied=True)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(reloaded.lm_head.weight, model.model.embed_tokens.weight)


def test_weights_are_saved_in_the_base_models_dtype(tmp_path):
    state = {"w": torch.ones(2, 2), "step": torch.tensor([3])}
    write_safetensors(state, tmp_path, torch.bfloat16, tied=False)
    saved = load_file(tmp_path / "model.safetensors")
    assert saved["w"].dtype == torch.bfloat16 and saved["step"].dtype == torch.int64


@pytest.fixture(scope="module")
def tiny_moes(tmp_path_factory):
    return {arch: create_tiny_model(tmp_path_factory.mktemp(arch), arch) for arch in ("qwen3_moe", "mixtral")}


@pytest.fixture(params=["qwen3_moe", "mixtral", "qwen3", "llama"])
def any_arch(request, tiny_moes):
    """A tiny model of every kind: MoE (transformers fuses its experts at load) and dense (no conversion)."""
    fixture = {"qwen3": "tiny_model", "llama": "tiny_llama"}.get(request.param)
    return request.getfixturevalue(fixture) if fixture else tiny_moes[request.param]


def _tensors(path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def test_state_dict_names_of_moe_models_differ_from_their_checkpoint(tiny_moes):
    """Why the export reverts anything: transformers 5 loads per-expert tensors as one fused 3-D parameter."""
    per_expert = {"qwen3_moe": "mlp.experts.0.gate_proj.weight", "mixtral": "block_sparse_moe.experts.0.w1.weight"}
    for arch, path in tiny_moes.items():
        names, stored = AutoModelForCausalLM.from_pretrained(path).state_dict().keys(), _tensors(path).keys()
        fused, expert = "model.layers.0.mlp.experts.gate_up_proj", f"model.layers.0.{per_expert[arch]}"
        assert fused in names and fused not in stored, arch
        assert expert in stored and expert not in names, arch


def test_exported_weights_have_the_checkpoints_names_shapes_and_values(any_arch, tmp_path, one_rank):
    model = build_model(str(any_arch))
    apply_fsdp(model, one_rank, torch.float32)

    path = save_weights(model, build_model_files(str(any_arch)), tmp_path, step=1)

    base, saved = _tensors(any_arch), _tensors(path)
    assert saved.keys() == base.keys()
    for name in base:
        assert torch.equal(saved[name], base[name]), name
    ids = torch.tensor([[5, 6, 7]])
    reloaded, original = AutoModelForCausalLM.from_pretrained(path), AutoModelForCausalLM.from_pretrained(any_arch)
    torch.testing.assert_close(reloaded(ids).logits, original(ids).logits)


def test_converted_checkpoints_have_the_base_checkpoints_layout(tiny_moes, tmp_path, one_rank):
    from prime_rl.trainer.ckpt import Progress, save_checkpoint
    from prime_rl.trainer.convert import convert

    base = tiny_moes["qwen3_moe"]
    model = build_model(str(base))
    apply_fsdp(model, one_rank, torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    ckpt = save_checkpoint(tmp_path, 1, model, optimizer, scheduler, Progress(), build_model_files(str(base)), 0)

    out = convert(ckpt, tmp_path / "hf")

    expected, converted = _tensors(base), _tensors(out)
    assert converted.keys() == expected.keys()
    for name in expected:
        assert torch.equal(converted[name], expected[name]), name


def test_a_model_whose_export_would_not_match_its_checkpoint_is_refused(tiny_moes, tmp_path):
    # A checkpoint stored with fused experts loads without conversion, so its export is unchanged and exact...
    fused = tmp_path / "fused"
    AutoModelForCausalLM.from_pretrained(tiny_moes["qwen3_moe"]).save_pretrained(fused, save_original_format=False)
    check_export_layout(AutoModelForCausalLM.from_pretrained(fused), str(fused))
    # ...but a model that was converted at load would be exported per expert, which that checkpoint is not.
    model = AutoModelForCausalLM.from_pretrained(tiny_moes["qwen3_moe"])
    with pytest.raises(TrainerError, match=r"Qwen3MoeForCausalLM: .*mlp\.experts\.0\..* inference could not load"):
        check_export_layout(model, str(fused))


def test_a_streamed_safetensors_file_loads_back_exactly(tmp_path):
    """What each rank writes tensor by tensor: the header up front from (name, dtype, shape), then the data."""
    from prime_rl.trainer.weights import safetensors_header

    tensors = {
        "b.weight": torch.randn(3, 5, dtype=torch.bfloat16),
        "a.weight": torch.randn(7),
        "scale": torch.tensor(2.5),  # 0-dim
        "ids": torch.arange(4, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(safetensors_header([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]))
        for t in tensors.values():
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name


def test_the_shard_plan_gives_every_rank_a_contiguous_file_of_about_equal_bytes():
    from prime_rl.trainer.weights import shard_plan

    sizes = [("embed", 400), *[(f"layer{i}", 100) for i in range(8)], ("norm", 1), ("head", 400)]
    for world in (1, 2, 3, 4):
        plan = shard_plan(sizes, world, max_bytes=10**9)
        assert [n for names in plan for n in names] == [n for n, _ in sizes]  # contiguous, in order, all
        assert len(plan) == world
        per_file = [sum(dict(sizes)[n] for n in names) for names in plan]
        assert max(per_file) <= sum(per_file) / world + 400, (world, per_file)  # within one largest tensor
    assert len(shard_plan(sizes, 1, max_bytes=700)) == 3  # big models still split into files <= ~max_bytes
    assert len(shard_plan(sizes[:2], 4, max_bytes=10**9)) == 2  # never an empty file


EXPORT_WORKER = """
import json, sys, torch
from pathlib import Path
from safetensors.torch import save_file
from prime_rl.configs.trainer import TrainerConfig
from prime_rl.protocol.parity import RowSums
from prime_rl.trainer.broadcast import SendPlan
from prime_rl.trainer.loading import build_training
from prime_rl.trainer.parallel import close_distributed, init_distributed
import prime_rl.trainer.weights as weights
from prime_rl.trainer.weights import build_model_files, save_weights
model_dir, out = sys.argv[1], Path(sys.argv[2])
world = init_distributed("cpu")
model = build_training(TrainerConfig(model={"name": model_dir}, output_dir=str(out)), world, 1)[0]
files = build_model_files(model_dir)
write = weights.write_own_shards


def counted(*args, **kwargs):  # the bytes of other ranks' rows this rank received while writing its files
    mine, received = write(*args, **kwargs)
    (out / f"received_{world.rank}.json").write_text(json.dumps(received))
    return mine, received


weights.write_own_shards = counted
save_weights(model, files, out, step=1)
# What this rank would send over the broadcast: its rows of every tensor, and its part of the checksum.
plan, sums = SendPlan.of(model, files.dtype, world), RowSums(torch.device("cpu"))
pieces = {name: t.contiguous() for (name, _, _), t in zip(plan.specs, plan.pieces(model, world.rank, sums))}
checksum = sums.checksum(lambda v: (torch.distributed.all_reduce(v), v)[1]).hex
save_file(pieces, str(out / f"rows_{world.rank}.safetensors"))
names = [name for name, _, _ in plan.specs]
(out / f"plan_{world.rank}.json").write_text(json.dumps({"names": names, "rows": plan.rows, "checksum": checksum}))
close_distributed()
"""


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_three_ranks_export_a_moe_in_its_checkpoints_layout_each_writing_its_own_file(tiny_moes, tmp_path, arch):
    """The fused experts are reverted one gathered tensor at a time as each rank writes its file (no full
    state dict on any rank, and each tensor's rows go to the rank writing it alone): the three files hold exactly
    the base checkpoint's tensors, and the index maps them.
    What each rank would broadcast of the same weights: its own rows of every sharded tensor (uneven over 3 ranks),
    the experts whole from rank 0; put together in rank order they are the files' tensors, and the ranks' summed
    row checksums are the files' checksum."""
    import subprocess
    import sys

    from prime_rl.protocol.parity import read_checksum
    from prime_rl.utils.hf_layout import iter_safetensors

    base = tiny_moes[arch]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", "--no-python",
           sys.executable, "-c", EXPORT_WORKER, str(base), str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    path = weights_dir(tmp_path, 1)
    files = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    stored, saved = _tensors(base), dict(iter_safetensors(path))
    assert saved.keys() == stored.keys() == index.keys() and set(index.values()) == set(files)
    total = sum(t.numel() * t.element_size() for t in saved.values())
    received = [json.loads((tmp_path / f"received_{r}.json").read_text()) for r in range(3)]
    # Each tensor's rows went to the rank writing it alone (an all-gather gave every rank ~2/3 of the model).
    assert min(received) > 0 and sum(received) < total, (received, total)
    plans = [json.loads((tmp_path / f"plan_{r}.json").read_text()) for r in range(3)]
    rows = [load_file(tmp_path / f"rows_{r}.safetensors") for r in range(3)]
    assert plans[0]["rows"] == plans[1]["rows"] == plans[2]["rows"]
    assert plans[0]["checksum"] == plans[2]["checksum"] == read_checksum(path)
    assert sorted(plans[0]["names"]) == sorted(saved)  # every checkpoint tensor, once
    split = {name: counts for name, counts in zip(plans[0]["names"], plans[0]["rows"], strict=True)}
    assert any(len(set(c)) > 1 and min(c) > 0 for c in split.values())  # uneven rows, all three sending
    assert any(c[1:] == [0, 0] for name, c in split.items() if ".experts." in name)  # gathered: rank 0 sends
    for name, counts in split.items():
        parts = [rows[r][name] for r in range(3) if counts[r]]
        whole = torch.cat(parts) if len(parts) > 1 else parts[0] if parts else saved[name][:0]
        assert torch.equal(whole.reshape(saved[name].shape), saved[name]), name
    for name, tensor in stored.items():
        assert torch.equal(saved[name], tensor), name


def test_rows_are_sent_where_they_are_only_when_the_ranks_runs_tile_the_tensor_in_rank_order():
    from prime_rl.trainer.gather import tiling_counts

    assert tiling_counts([(0, 4), (4, 4), (8, 2)], 10) == [4, 4, 2]  # FSDP's uneven chunks
    assert tiling_counts([(0, 5), (5, 5), (0, 0), (0, 0)], 10) == [5, 5, 0, 0]  # HSDP: the second replica sends none
    assert tiling_counts([(0, 3), (0, 0), (3, 0), (3, 7)], 10) == [3, 0, 0, 7]  # an empty chunk anywhere
    assert tiling_counts([(5, 5), (0, 5)], 10) is None  # not in rank order: rank 0 sends it whole
    assert tiling_counts([(0, 4), (5, 5)], 10) is None  # a gap
    assert tiling_counts([(0, 5), None], 10) is None  # a rank whose shard is no run of rows
