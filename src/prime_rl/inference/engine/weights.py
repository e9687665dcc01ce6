"""Reading a trainer's `weights/step_n` directory into tensors for the built-in engine's model.

Loading happens here, off the engine's worker thread, so generation keeps running while the files are read.
The dir is checked first against the model's state dict (`prime_rl.inference.weights`, shared with vLLM);
tensors are then cast to the model's device and precision (the trainer may save float32 for a bfloat16
server). The worker only copies the checked tensors into the model between two iterations.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from prime_rl.inference.weights import TensorSpecs, WeightsError, check_weight_dir


@dataclass
class LoadedWeights:
    step: int
    weight_dir: Path
    tensors: dict[str, torch.Tensor]


def model_specs(model: torch.nn.Module) -> TensorSpecs:
    return {name: (tuple(t.shape), t.dtype.is_floating_point) for name, t in model.state_dict().items()}


def load_weight_dir(weight_dir: Path, model: torch.nn.Module) -> LoadedWeights:
    """Read every `*.safetensors` under a complete `step_n` dir that fits `model`."""
    from safetensors.torch import load_file

    weight_dir = Path(weight_dir)
    step, files = check_weight_dir(weight_dir, model.config.to_dict(), model_specs(model))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(file))
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise WeightsError(f"{file}: cannot read: {e}") from None
    params = model.state_dict()
    tensors = {name: t.to(device=params[name].device, dtype=params[name].dtype) for name, t in tensors.items()}
    return LoadedWeights(step=step, weight_dir=weight_dir, tensors=tensors)
