"""Reading a trainer's `weights/step_n` directory into tensors for the built-in engine's model.

Loading happens here, off the engine's worker thread, so generation keeps running while the files are read.
The dir is checked first against the served checkpoint's layout (`prime_rl.inference.weights`, shared with
vLLM): the names and shapes the trainer exports. For an architecture transformers converts at load (MoE
experts fused into 3-D tensors) transformers loads the dir, so the same conversion applies; for the others
the files are read as they are. Tensors are then cast to the model's device and precision (the trainer may
save float32 for a bfloat16 server). The worker only copies the checked tensors in between two iterations.

A LoRA adapter (a server with `model.lora`) is merged here, also off the worker: every targeted linear layer
gets W = W_base + (alpha / r) · B @ A, computed in float32 from the engine's pristine base copy and cast to
the served precision, so each adapter lands on the base (never on the previous merge), layers this adapter
leaves out go back to the base, and the swap is the same copy as a full update. Merged weights decode at
the base model's speed (benchmarks/lora.py serving measured runtime LoRA matmuls slower).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from prime_rl.configs import LoraConfig
from prime_rl.inference.broadcast import BroadcastReceiver
from prime_rl.inference.weights import WeightsError, check_weight_dir, nonfinite, read_adapter, targeted
from prime_rl.protocol.parity import checksum_of
from prime_rl.utils.hf_layout import TensorSpecs, checkpoint_state_dict, iter_safetensors, to_model_layout
from prime_rl.utils.lora import merge_weight


@dataclass
class LoadedWeights:
    step: int
    weight_dir: Path | None  # None: received over the broadcast group
    tensors: dict[str, torch.Tensor]
    checksum: str | None = None  # of the tensors as read or received, before any cast (protocol.parity)


def checkpoint_specs(model: torch.nn.Module) -> TensorSpecs:
    """Names, shapes and dtype kinds of the model's checkpoint layout (computed on meta tensors)."""
    meta = {name: t.to("meta") for name, t in model.state_dict().items()}
    return {name: (tuple(t.shape), t.dtype.is_floating_point) for name, t in checkpoint_state_dict(model, meta).items()}


def load_weight_dir(weight_dir: Path, model: torch.nn.Module, specs: TensorSpecs) -> LoadedWeights:
    """Read a complete `step_n` dir in the checkpoint layout `specs` into tensors of `model`'s state dict."""
    from safetensors.torch import load_file

    weight_dir = Path(weight_dir)
    step, files = check_weight_dir(weight_dir, model.config.to_dict(), specs)
    params = model.state_dict()
    if set(specs) != set(params):  # transformers converts this architecture at load
        from transformers import AutoModelForCausalLM

        try:
            loaded = AutoModelForCausalLM.from_pretrained(weight_dir, config=model.config, dtype=torch.float32)
        except Exception as e:  # transformers raises many types for files it cannot use
            raise WeightsError(f"{weight_dir}: cannot load: {e}") from None
        tensors = loaded.state_dict()
        checksum = checksum_of(iter_safetensors(weight_dir)).hex  # of the files, as the other backends read them
    else:
        tensors = {}
        for file in files:
            try:
                tensors.update(load_file(file))
            except Exception as e:  # safetensors raises its own error types for corrupt files
                raise WeightsError(f"{file}: cannot read: {e}") from None
        checksum = checksum_of(tensors.items()).hex
    return LoadedWeights(step, weight_dir, servable(tensors, params, str(weight_dir)), checksum)


def servable(tensors: dict[str, torch.Tensor], params: dict[str, torch.Tensor], source: str) -> dict:
    """Finite tensors cast to the served parameters' device and precision, else WeightsError naming `source`."""
    # NaN or inf weights would be served and make every logprob NaN (unserialisable: each request a 500).
    if broken := nonfinite(tensors):
        raise WeightsError(f"{source}: non-finite values (NaN or inf) in {', '.join(broken[:5])}")
    return {name: t.to(device=params[name].device, dtype=params[name].dtype) for name, t in tensors.items()}


def model_linears(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """module -> (in_features, out_features) of the model's linear layers (the names peft adapters use)."""
    return {
        name: (m.in_features, m.out_features) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
    }


def lora_targets(model: torch.nn.Module, lora: LoraConfig) -> list[str]:
    """The linear layers an adapter may change (model.lora.target_modules): what every merge rewrites."""
    return [m for m in model_linears(model) if targeted(m, lora.target_modules)]


def load_adapter_dir(
    weight_dir: Path, model: torch.nn.Module, lora: LoraConfig, base: dict[str, torch.Tensor], targets: list[str]
) -> LoadedWeights:
    """Read a checked adapter dir and merge it onto the base: the new weights of every layer in `targets`."""
    adapter = read_adapter(Path(weight_dir), lora, model_linears(model))
    merged = merge_adapter(adapter.pairs, adapter.scale, base, targets, model)
    return LoadedWeights(adapter.step, Path(weight_dir), merged, adapter.checksum)


def merge_adapter(
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    base: dict[str, torch.Tensor],
    targets: list[str],
    model: torch.nn.Module,
) -> dict[str, torch.Tensor]:
    """`{module}.weight` = base + scale · B A for each target (`utils.lora.merged`), cast to the served
    device and precision; targets without a pair get their base weight back."""
    params = model.state_dict()
    merged = {}
    for module in targets:
        name = f"{module}.weight"
        param = params[name]
        weight = base[name].to(device=param.device, dtype=torch.float32)
        if module in pairs:
            weight = merge_weight(weight, *(t.to(param.device) for t in pairs[module]), scale)
        merged[name] = weight.to(param.dtype)
    return merged


def receive_weights(receiver: BroadcastReceiver, request, model: torch.nn.Module, specs: TensorSpecs) -> LoadedWeights:
    """Receive a broadcast weight step (`request`: a BroadcastRequest) into tensors of `model`'s state dict. It
    arrives in the checkpoint's layout (`specs`); an architecture transformers converts at load (fused experts)
    gets that conversion here (`to_model_layout`)."""
    params = model.state_dict()
    device = next(iter(params.values())).device
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors = receiver.receive(request.rendezvous(), request.rank, request.step, device, specs, tied)
    source = f"weight broadcast of step {request.step}"
    checksum = checksum_of(tensors.items()).hex  # in the sender's dtypes, on the receiving device
    if set(specs) != set(params):
        tensors = to_model_layout(model, tensors)
    return LoadedWeights(request.step, None, servable(tensors, params, source), checksum)
