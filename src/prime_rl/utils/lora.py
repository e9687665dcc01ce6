"""LoRA adapters as files: peft's adapter dir (`adapter_config.json` + `adapter_model.safetensors`) and its
merge into base weights, W' = W + (alpha / r) · B A, computed in float32 (one rule for every reader)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_scale(adapter_config: dict) -> float:
    return float(adapter_config["lora_alpha"]) / int(adapter_config["r"])


def read_adapter_config(path: Path) -> dict:
    return json.loads((Path(path) / ADAPTER_CONFIG).read_text())


def merge_lora(
    state: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """`state` (the model's own parameter names) with every adapter pair (peft names, `...<module>.lora_A.weight`
    and `.lora_B.weight`) merged into its `<module>.weight`; the merged tensors keep their dtype."""
    merged = dict(state)
    for name, a in adapter.items():
        if ".lora_A." not in name:
            continue
        module = name.removeprefix(PEFT_PREFIX).split(".lora_A.")[0]
        b = adapter[name.replace(".lora_A.", ".lora_B.")]
        w = state[f"{module}.weight"]
        merged[f"{module}.weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return merged
