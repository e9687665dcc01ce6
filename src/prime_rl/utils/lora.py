"""LoRA adapters as files and their merge, one rule for every reader (the built-in engine, convert-checkpoint).

An adapter dir is peft's: `adapter_config.json` + `adapter_model.safetensors`, tensors named
`base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]. Merged, the module's
weight is W + (alpha / r) · B A.
"""

from __future__ import annotations

import torch

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER = "default"  # peft's adapter name inside the modules; never visible in files


def merge_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale · B A, in float32 (peft's merge); the caller casts to the dtype it serves or saves.

    E.g. W [[1, 0], [0, 1]], A [[1, 2]], B [[1], [0]], scale 2 → [[3, 4], [0, 1]].
    """
    return weight.float() + scale * (b.float() @ a.float())


def adapter_pairs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module → (A, B) of an adapter file's tensors (peft names)."""
    return {
        name.removeprefix(PEFT_PREFIX).split(".lora_A.")[0]: (a, tensors[name.replace(".lora_A.", ".lora_B.")])
        for name, a in tensors.items()
        if ".lora_A." in name
    }
