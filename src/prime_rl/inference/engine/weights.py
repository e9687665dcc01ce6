"""Reading a trainer's `weights/step_n` directory into tensors that fit the served model.

Loading and checking happen here, off the engine's worker thread, so generation keeps running while
the files are read: the dir's `config.json` (when present) must describe the served architecture, and
every tensor must be present with the served shape and a floating dtype when the model's is floating
(precision may differ: the trainer may save float32 for a bfloat16 server; tensors are cast here). The
worker then only copies the checked tensors into the model between two iterations.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from prime_rl.protocol import is_stable, step_of


class WeightsError(ValueError):
    """A weight directory that cannot be served; the message says why."""


@dataclass
class LoadedWeights:
    step: int
    weight_dir: Path
    tensors: dict[str, torch.Tensor]


def load_weight_dir(weight_dir: Path, model: torch.nn.Module) -> LoadedWeights:
    """Read every `*.safetensors` under a complete `step_n` dir and check it against `model`.

    Every model tensor must be present with the same shape; a missing `lm_head.weight` is fine when the
    model ties it to the input embeddings (the trainer may save it only once).
    """
    from safetensors.torch import load_file

    weight_dir = Path(weight_dir)
    step, files = check_weight_files(weight_dir)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(file))
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise WeightsError(f"{file}: cannot read: {e}") from None
    check_config(weight_dir, model.config.to_dict())
    check_tensors(tensors, model)
    params = model.state_dict()
    tensors = {name: t.to(device=params[name].device, dtype=params[name].dtype) for name, t in tensors.items()}
    return LoadedWeights(step=step, weight_dir=weight_dir, tensors=tensors)


# Config keys that fix the shapes and the computation of the served model.
ARCHITECTURE_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "head_dim",
    "tie_word_embeddings",
)


def check_weight_files(weight_dir: Path) -> tuple[int, list[Path]]:
    """(step, safetensors files) of a complete `weights/step_n` dir, else WeightsError saying what is wrong."""
    step = step_of(weight_dir)
    if step is None:
        raise WeightsError(f"{weight_dir}: not a weights/step_<n> directory")
    if not weight_dir.is_dir():
        raise WeightsError(f"{weight_dir}: no such directory")
    if not is_stable(weight_dir):
        raise WeightsError(f"{weight_dir}: not complete (no STABLE marker)")
    files = sorted(weight_dir.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{weight_dir}: no *.safetensors files")
    return step, files


def check_config(weight_dir: Path, ours: dict) -> None:
    """Raise WeightsError when `weight_dir/config.json` describes another architecture than the served one."""
    import json

    path = weight_dir / "config.json"
    if not path.is_file():
        return  # a bare safetensors dir: the tensor check below still catches shape mismatches
    try:
        theirs = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise WeightsError(f"{path}: cannot read: {e}") from None
    if not isinstance(theirs, dict):
        raise WeightsError(f"{path}: not a JSON object")
    differ = [
        f"{key} is {theirs[key]!r}, the served model has {ours.get(key)!r}"
        for key in ARCHITECTURE_KEYS
        if key in theirs and key in ours and theirs[key] != ours[key]
    ]
    if differ:
        raise WeightsError(f"{path}: another architecture than the served model: " + "; ".join(differ))


def check_tensors(tensors: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    """Raise WeightsError naming the first few missing, unexpected or mis-shaped tensors."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    dtypes = {name: t.dtype for name, t in model.state_dict().items()}
    tied = getattr(model.config, "tie_word_embeddings", False)
    problems = []
    for name, shape in expected.items():
        if name not in tensors:
            if not (tied and name == "lm_head.weight"):
                problems.append(f"missing {name}")
        elif tuple(tensors[name].shape) != shape:
            problems.append(f"{name} has shape {tuple(tensors[name].shape)}, the model needs {shape}")
        elif tensors[name].dtype.is_floating_point != dtypes[name].is_floating_point:
            problems.append(f"{name} has dtype {tensors[name].dtype}, the model needs {dtypes[name]}")
    problems += [f"unexpected {name}" for name in tensors if name not in expected]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise WeightsError("weights do not match the served model: " + "; ".join(problems[:5]) + more)
