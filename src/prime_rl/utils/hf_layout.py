"""A model's tensors in its HF checkpoint's layout, which is what every service exchanges.

transformers 5 converts some architectures' checkpoint tensors when it loads them (e.g. a MoE's per-expert
`experts.{i}.gate_proj/up_proj/down_proj` become fused 3-D `experts.gate_up_proj/down_proj`), so a loaded
model's state dict is not the checkpoint's. The trainer exports, and the servers check and load, the
checkpoint's names and shapes (vLLM's loader expects them).
"""

from __future__ import annotations

import torch


def checkpoint_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` (the model's own names) in its HF checkpoint's names and shapes.

    Reverts transformers' load-time weight conversion with the function `save_pretrained` uses: the
    conversions recorded when `model` was loaded, or, for a model built from its config (e.g. on the
    meta device), the ones registered for its architecture. A no-op for architectures without any.
    """
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, state_dict)


def is_converted(model: torch.nn.Module) -> bool:
    """Whether the model's state dict differs from its checkpoint's layout (checked on meta tensors)."""
    names = {name: t.to("meta") for name, t in model.state_dict().items()}
    return set(checkpoint_state_dict(model, names)) != set(names)
