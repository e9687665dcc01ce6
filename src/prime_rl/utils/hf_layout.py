"""A model's tensors in its HF checkpoint's layout, which is what every service exchanges.

transformers 5 converts some architectures' checkpoint tensors when it loads them (e.g. a MoE's per-expert
`experts.{i}.gate_proj/up_proj/down_proj` become fused 3-D `experts.gate_up_proj/down_proj`), so a loaded
model's state dict is not the checkpoint's. The trainer exports, and the servers check and load, the
checkpoint's names and shapes (vLLM's loader expects them).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch itself only where a tensor is made: `rl`'s start-up reads headers without it (~5 s)
    import torch

# name -> (shape, is floating point), as read from safetensors headers
TensorSpecs = dict[str, tuple[tuple[int, ...], bool]]


def checkpoint_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` (the model's own names) in its HF checkpoint's names and shapes.

    Reverts transformers' load-time weight conversion with the function `save_pretrained` uses: the
    conversions recorded when `model` was loaded, or, for a model built from its config (e.g. on the
    meta device), the ones registered for its architecture. A no-op for architectures without any.
    """
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, state_dict)


def converted_at_load(model: torch.nn.Module) -> bool:
    """Whether transformers converted `model`'s tensors at load (its state dict's names are not its checkpoint's)."""
    import torch

    meta = {k: torch.empty_like(v, device="meta") for k, v in model.state_dict().items()}
    return set(checkpoint_state_dict(model, meta)) != set(meta)


def element_map(model: torch.nn.Module, key: str, shape: tuple[int, ...]) -> dict[str, torch.Tensor] | None:
    """For the model tensor `key` of `shape`: each checkpoint tensor it is stored as -> the flat indices, into
    the model tensor, of that checkpoint tensor's elements; None where the checkpoint stores it as itself (no
    conversion: most tensors, even of a converted architecture). Learnt by reverting transformers' load-time
    conversion on the model tensor's own element indices, so any rearranging conversion (stacking experts,
    concatenating gate and up) is inverted exactly, with transformers the one owner of the layout."""
    import torch

    stored = checkpoint_state_dict(model, {key: torch.empty(shape, device="meta")})
    if list(stored) == [key] and tuple(stored[key].shape) == tuple(shape):
        return None  # decided on a meta tensor: no index tensor the size of the model tensor
    index = torch.arange(math.prod(shape)).view(shape)
    return {name: where.reshape(-1) for name, where in checkpoint_state_dict(model, {key: index}).items()}


def to_model_layout(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint-layout `tensors` (a weight broadcast's) as the model's own state-dict tensors: the
    conversion transformers applies at load, through `element_map`. Tensors already in the model's layout pass."""
    import torch

    out = {}
    for key, param in model.state_dict().items():
        parts = element_map(model, key, tuple(param.shape))
        if parts is None:
            if key in tensors:
                out[key] = tensors[key]
            continue
        if not all(name in tensors for name in parts):
            continue  # not sent (a tied head); the caller checks completeness against the checkpoint layout
        first = tensors[next(iter(parts))]
        flat = torch.empty(param.numel(), dtype=first.dtype, device=first.device)
        for name, where in parts.items():
            flat[where.to(first.device)] = tensors[name].reshape(-1)
        out[key] = flat.view(param.shape)
    return out


def checkpoint_files(name: str) -> list[Path] | None:
    """The safetensors files of `name`'s checkpoint (a local dir, or a hub id already in the local cache),
    following its index when sharded; None when it has no (complete) safetensors checkpoint."""
    index = checkpoint_file(name, "model.safetensors.index.json")
    filenames = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index else ["model.safetensors"]
    files = [checkpoint_file(name, filename) for filename in filenames]
    return files if all(files) else None


def checkpoint_file(name: str, filename: str) -> Path | None:
    """`filename` of `name`'s checkpoint: in a local dir, or a hub id's cached copy (never downloaded)."""
    if Path(name).is_dir():
        path = Path(name) / filename
        return path if path.is_file() else None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name, filename)
    return Path(cached) if isinstance(cached, str) else None


def header_specs(file: Path) -> TensorSpecs:
    """Names, shapes and dtype kinds in one safetensors file, from its header only (no tensor data read). Opened
    for numpy, which reads the header without importing torch (`rl`'s start-up counts parameters with it)."""
    from safetensors import safe_open

    with safe_open(str(file), framework="numpy") as f:
        parts = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        return {name: (tuple(p.get_shape()), p.get_dtype().startswith(("F", "BF"))) for name, p in parts.items()}


def iter_safetensors(weight_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of every `*.safetensors` file in `weight_dir`, however the
    export split them into files; one tensor in memory at a time."""
    from safetensors import safe_open

    for file in sorted(Path(weight_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)
