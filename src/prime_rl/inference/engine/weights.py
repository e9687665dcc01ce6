"""Reading a trainer's `weights/step_n` directory into tensors that fit the served model.

Loading and checking happen here, off the engine's worker thread, so generation keeps running while
the files are read; the worker only copies the checked tensors into the model between batches.
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
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(file))
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise WeightsError(f"{file}: cannot read: {e}") from None
    check_tensors(tensors, model)
    return LoadedWeights(step=step, weight_dir=weight_dir, tensors=tensors)


def check_tensors(tensors: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    """Raise WeightsError naming the first few missing, unexpected or mis-shaped tensors."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied = getattr(model.config, "tie_word_embeddings", False)
    problems = []
    for name, shape in expected.items():
        if name not in tensors:
            if not (tied and name == "lm_head.weight"):
                problems.append(f"missing {name}")
        elif tuple(tensors[name].shape) != shape:
            problems.append(f"{name} has shape {tuple(tensors[name].shape)}, the model needs {shape}")
    problems += [f"unexpected {name}" for name in tensors if name not in expected]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise WeightsError("weights do not match the served model: " + "; ".join(problems[:5]) + more)
