"""Checking and merging LoRA adapter dirs (inference/weights.py, engine/weights.py) and vLLM's LoRA flags."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from prime_rl.configs import LoraConfig
from prime_rl.configs.inference import InferenceConfig, StartupError
from prime_rl.inference.control import requested_model
from prime_rl.inference.engine.weights import merge_adapter
from prime_rl.inference.vllm.args import max_lora_rank, vllm_serve_args
from prime_rl.inference.weights import (
    WeightsError,
    check_adapter_dir,
    check_weight_dir,
    linear_shapes,
    nonfinite,
    read_adapter,
    targeted,
)
from prime_rl.protocol import mark_stable

LINEARS = {"model.layers.0.self_attn.q_proj": (4, 6), "model.layers.0.mlp.down_proj": (8, 4)}
LORA = LoraConfig(rank=2, alpha=4, target_modules=["q_proj", "down_proj"])


def write_adapter(path, tensors=None, **config):
    """A peft-style adapter dir (rank 2 on q_proj and down_proj of LINEARS) with `config` overrides."""
    path.mkdir(parents=True)
    names = "base_model.model.model.layers.0.{}.lora_{}.weight"
    if tensors is None:
        tensors = {
            names.format("self_attn.q_proj", "A"): torch.ones(2, 4),
            names.format("self_attn.q_proj", "B"): torch.ones(6, 2),
            names.format("mlp.down_proj", "A"): torch.ones(2, 8),
            names.format("mlp.down_proj", "B"): torch.ones(4, 2),
        }
    save_file(tensors, path / "adapter_model.safetensors")
    body = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "down_proj"], "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(body | config))
    mark_stable(path)
    return path


def test_a_peft_style_adapter_dir_is_checked_and_read(tmp_path):
    checked = check_adapter_dir(write_adapter(tmp_path / "step_3"), LORA, LINEARS)
    assert (checked.step, checked.rank, checked.scale) == (3, 2, 2.0)
    assert checked.modules == sorted(LINEARS)
    adapter = read_adapter(tmp_path / "step_3", LORA, LINEARS)
    assert adapter.pairs["model.layers.0.mlp.down_proj"][1].shape == (4, 2)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"r": 4}, "rank r=4 exceeds the served maximum model.lora.rank=2"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target_modules ['lm_head'] are not served"),
        ({"target_modules": "q_proj"}, "target_modules must be a non-empty list"),
        ({"use_dora": True}, "unsupported LoRA options use_dora=True"),
        ({"lora_alpha": "4"}, "lora_alpha must be a positive number"),
        ({"peft_type": "IA3"}, "peft_type 'IA3'; only LORA adapters are served"),
    ],
)
def test_an_adapter_config_the_server_cannot_serve_is_refused(tmp_path, config, message):
    with pytest.raises(WeightsError, match="adapter_config.json: " + message.replace("[", r"\[").replace("]", r"\]")):
        check_adapter_dir(write_adapter(tmp_path / "step_1", **config), LORA, LINEARS)


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 5)}, "has shape (2, 5)"),
        ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 4)}, "lora_B is missing"),
        ({"base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.ones(2, 4)}, "no linear layer"),
        ({"model.layers.0.self_attn.q_proj.weight": torch.ones(6, 4)}, "unexpected model.layers.0"),
    ],
)
def test_adapter_tensors_that_do_not_fit_the_served_model_are_refused(tmp_path, tensors, message):
    with pytest.raises(WeightsError, match="adapter does not match the served model: .*" + message.split("(")[0]):
        check_adapter_dir(write_adapter(tmp_path / "step_1", tensors), LORA, LINEARS)


def test_non_finite_adapter_values_are_refused(tmp_path):
    tensors = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.full((2, 4), float("inf")),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(6, 2),
    }
    with pytest.raises(WeightsError, match="non-finite values"):
        read_adapter(write_adapter(tmp_path / "step_1", tensors), LORA, LINEARS)


def test_each_kind_of_server_refuses_the_other_kind_of_dir(tmp_path):
    full = tmp_path / "step_1"
    full.mkdir()
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.ones(6, 4)}, full / "model.safetensors")
    mark_stable(full)
    with pytest.raises(WeightsError, match="no adapter_config.json; this server serves LoRA adapters"):
        check_adapter_dir(full, LORA, LINEARS)
    with pytest.raises(WeightsError, match="a LoRA adapter .* start it with --model.lora"):
        check_weight_dir(write_adapter(tmp_path / "step_2"), {}, {})


def test_linear_layers_and_targets_follow_the_checkpoint_and_peft_names():
    specs = {
        "model.embed_tokens.weight": ((10, 4), True),
        "model.norm.weight": ((4,), True),
        "lm_head.weight": ((10, 4), True),
    }
    assert linear_shapes(specs | {"model.layers.0.self_attn.q_proj.weight": ((6, 4), True)}) == {
        "lm_head": (4, 10),
        "model.layers.0.self_attn.q_proj": (4, 6),
    }
    assert targeted("model.layers.0.self_attn.q_proj", ["q_proj"])
    assert targeted("model.layers.0.self_attn.q_proj", ["self_attn.q_proj"])
    assert not targeted("model.layers.0.self_attn.q_proj", ["proj"])


def test_merging_adds_the_scaled_product_onto_the_base_and_restores_untouched_targets():
    model = torch.nn.Module()
    model.a, model.b = torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False)
    base = {"a.weight": torch.eye(2), "b.weight": torch.eye(2)}
    pairs = {"a": (torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0], [0.0]]))}
    merged = merge_adapter(pairs, 2.0, base, ["a", "b"], model)
    assert merged["a.weight"].tolist() == [[3.0, 4.0], [0.0, 1.0]]
    assert merged["b.weight"].tolist() == [[1.0, 0.0], [0.0, 1.0]]  # no pair: the base, whatever was merged before


def test_vllm_gets_lora_flags_with_the_rank_rounded_up_to_one_it_accepts():
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 320, 321)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(StartupError, match="up to 512"):
        max_lora_rank(513)
    config = InferenceConfig(model={"name": "m", "lora": {"rank": 12}})
    args = vllm_serve_args(config, "127.0.0.1", cuda=False)
    assert args[args.index("--enable-lora") :][:5] == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "1"]
    assert "--enable-lora" not in vllm_serve_args(InferenceConfig(model={"name": "m"}), "127.0.0.1", cuda=False)


def test_the_model_a_generation_request_names_is_read_from_its_body():
    assert requested_model(b'{"model": "policy-lora", "prompt": [1]}') == "policy-lora"
    assert requested_model(b'{"prompt": [1]}') is None
    assert requested_model(b"[1]") is None
    assert requested_model(b"{") is None


def test_nonfinite_names_exactly_the_tensors_holding_a_nan_or_an_inf():
    """The float64 sum is finite exactly when every value is: values at each dtype's largest finite magnitude,
    whose sum overflows the dtype itself, stay finite; one inf, inf beside -inf, one NaN do not."""
    big = {dtype: torch.finfo(dtype).max for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    tensors = {f"max_{d}": torch.full((1000,), m, dtype=d) for d, m in big.items()}
    tensors |= {f"neg_{d}": torch.full((1000,), -m, dtype=d) for d, m in big.items()}
    tensors["f64_overflowing_sum"] = torch.full((4,), 1e308, dtype=torch.float64)  # sums to inf, values finite
    tensors["ids"] = torch.arange(10)  # not floating: never checked
    broken = {
        "inf": torch.tensor([1.0, float("inf")]),
        "inf_minus_inf": torch.tensor([float("inf"), float("-inf")], dtype=torch.bfloat16),
        "nan": torch.tensor([0.0, float("nan")], dtype=torch.float16),
        "f64_nan": torch.tensor([float("nan")], dtype=torch.float64),
    }
    assert nonfinite(tensors) == []
    assert nonfinite(tensors | broken) == list(broken)
    assert nonfinite({}) == []
