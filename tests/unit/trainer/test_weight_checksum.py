"""Weight checksums (protocol.parity): the trainer's export and every server's load of the same weights give
the same one; another step, a missing tensor, another dtype do not."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import prime_rl.protocol.parity as parity
from prime_rl.inference.engine.weights import checkpoint_specs, load_weight_dir
from prime_rl.protocol.parity import (
    Checksum,
    RowSums,
    checksum_of,
    read_checksum,
    read_checksums,
    tensor_key,
    tensor_value,
)
from prime_rl.trainer.broadcast import SendPlan
from prime_rl.trainer.model import build_model
from prime_rl.trainer.parallel import apply_fsdp
from prime_rl.trainer.weights import build_model_files, save_weights
from prime_rl.utils.hf_layout import iter_safetensors


def test_the_worked_example_and_what_changes_a_checksum(monkeypatch):
    w = torch.tensor([[1.0], [2.0]])
    assert tensor_value(w) == (1065353216 + 2 * 1073741824) % (2**31 - 1)
    assert checksum_of([("w", w)]).value == tensor_key("w", torch.float32, (2, 1)) * 1065353217 % 2**64

    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(300, 7, generator=g).bfloat16(), "b": torch.randn(5, generator=g), "c": torch.ones(3)}
    base = checksum_of(tensors.items()).hex
    assert checksum_of(reversed(list(tensors.items()))).hex == base  # order-independent
    flipped = tensors["a"].clone()
    flipped.view(torch.int16)[17, 3] ^= 1  # one bit
    assert checksum_of((tensors | {"a": flipped}).items()).hex != base
    assert checksum_of((tensors | {"a": tensors["a"].flip(0)}).items()).hex != base  # rows reordered
    assert checksum_of((tensors | {"b": tensors["b"].double()}).items()).hex != base  # another dtype
    assert checksum_of((tensors | {"c": tensors["c"].bfloat16()}).items()).hex != base
    assert checksum_of((tensors | {"a": tensors["a"].T.contiguous()}).items()).hex != base
    assert checksum_of(list(tensors.items())[:2]).hex != base  # a tensor missing
    monkeypatch.setattr(parity, "CHUNK_ELEMENTS", 64)  # many chunks: the same number
    assert checksum_of(tensors.items()).hex == base


def test_the_device_side_sum_is_the_formula_and_waits_for_the_device_once(monkeypatch):
    """Σ key · value mod 2^64 exactly (keys span all 64 bits), over many tensors, with one read of the device's
    limbs at the end: adding a tensor converts nothing to a Python int."""
    g = torch.Generator().manual_seed(1)
    tensors = [
        (f"layer.{i}.w", torch.randn(int(torch.randint(1, 50, (), generator=g)), 3, generator=g)) for i in range(200)
    ]
    expected = sum(tensor_key(n, t.dtype, t.shape) * tensor_value(t) for n, t in tensors) % 2**64
    assert any(tensor_key(n, t.dtype, t.shape) >> 63 for n, t in tensors)
    reads = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "__int__", lambda t: reads.append("int") or original(t))
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append("item") or original(t))
    checksum = Checksum()
    for name, t in tensors:
        checksum.add(name, t)
    assert reads == [] and checksum.tensors == 200
    assert checksum.value == expected
    half = checksum_of(tensors[:100])
    half.merge(checksum_of(tensors[100:]))
    assert half.value == expected


def test_the_trainers_export_and_every_servers_load_give_one_checksum(tiny_model, tmp_path, one_rank):
    model = build_model(str(tiny_model))
    apply_fsdp(model, one_rank, torch.float32)
    files = build_model_files(str(tiny_model), dtype=torch.bfloat16)
    path = save_weights(model, files, tmp_path, step=1)
    exported = read_checksum(path)
    assert exported is not None and len(exported) == 16

    # The built-in engine's load (the files as read, before its cast to the served dtype) ...
    served = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert load_weight_dir(path, served, checkpoint_specs(served)).checksum == exported
    # ... vLLM's (the pairs fed to load_weights) ...
    assert checksum_of(iter_safetensors(path)).hex == exported
    # ... and the broadcast's (what the trainer sends, in the export dtype).
    plan = SendPlan.of(model, files.dtype, one_rank)
    sums = RowSums(torch.device("cpu"))
    list(plan.pieces(model, 0, sums))
    assert sums.checksum(lambda values: values).hex == exported

    received = dict(iter_safetensors(path))
    missing = dict(received)
    missing.pop("model.norm.weight")
    assert checksum_of(missing.items()).hex != exported
    assert checksum_of({k: v.float() for k, v in received.items()}.items()).hex != exported

    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(1e-2)
    assert read_checksum(save_weights(model, files, tmp_path, step=2)) != exported  # another step
    # A resumed trainer redoing step 1 (CUDA is not bit-reproducible: other weights): the step's file names both
    # publishes, the newest first, so a server still holding the first attempt is not taken for a fault.
    redone = read_checksum(save_weights(model, files, tmp_path, step=1))
    assert redone != exported and read_checksums(path) == [redone, exported]


@pytest.mark.parametrize("bad", ["not json", '{"checksum": 5}', "{}"])
def test_a_dir_without_a_readable_checksum_has_none(tmp_path, bad):
    (tmp_path / "checksum.json").write_text(bad)
    assert read_checksum(tmp_path) is None
    assert read_checksum(tmp_path / "nowhere") is None
