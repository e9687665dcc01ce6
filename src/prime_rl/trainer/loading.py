"""Sharded loading: each trainer rank reads only its own shards of the HF checkpoint.

The model is built on the meta device (its parameters only: buffers such as rotary frequencies are computed as
a plain load computes them), parallelized (activation checkpointing, compile, FSDP2: `parallel.parallelize`),
given storage for this rank's shards (`to_empty`), and then each rank reads the rows of every tensor it owns
from the safetensors files: torch.distributed.checkpoint's HF reader reads those slices and casts them to the
float32 masters as it copies. A rank holds about 1/N of the model plus the slice being read, where a plain
load holds the whole fp32 model on every rank before FSDP shards it (eight copies on an 8-GPU node).

LoRA adapters (not in the checkpoint) are initialised as peft initialises them; tied embeddings are checked to
be tied still. Architectures transformers converts at load (fused MoE experts: the checkpoint's names are not
the model's) are read through transformers' own reverse conversion (`read_converted`); checkpoints without
safetensors are loaded whole by `model.build_model`.
"""

from __future__ import annotations

import logging
import math
import resource
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from accelerate import init_empty_weights
from huggingface_hub import snapshot_download
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.tensor import distribute_tensor
from torch.optim import Optimizer
from transformers import AutoConfig, AutoModelForCausalLM

from prime_rl.configs import LoraConfig
from prime_rl.configs.training import TrainingConfig
from prime_rl.trainer.attention import attention_implementation
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.model import build_model, disable_dropout, prepare
from prime_rl.trainer.optim import build_optimizer, build_scheduler
from prime_rl.trainer.parallel import Dist, parallelize
from prime_rl.utils.hf_layout import checkpoint_files, converted_at_load, element_map, header_specs
from prime_rl.utils.lora import ADAPTER

logger = logging.getLogger("prime_rl")

LORA_BASE = ".base_layer."  # peft's name for the wrapped layer: `q_proj.base_layer.weight` is `q_proj.weight`


def build_training(config: TrainingConfig, world: Dist, max_steps: int) -> tuple[nn.Module, Optimizer, Any]:
    """The model of a trainer config (RL or SFT) parallelized over `world`, with its optimizer and lr schedule."""
    start = time.perf_counter()
    model, how = build_sharded(config, world), "read its shards of"
    if model is None:  # loaded whole on every rank, then sharded
        model, how = build_model(config.model.name, world.device.type, config.model.lora), "loaded all of"
        parallelize(model, world, config)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    logger.info(
        f"rank {world.rank} {how} {config.model.name} in {time.perf_counter() - start:.1f}s "
        f"({world.world_size} rank(s); peak host memory {peak:.2f} GiB)"
    )
    optimizer = build_optimizer(model, config.optim)
    return model, optimizer, build_scheduler(optimizer, config.optim, max_steps)


def checkpoint_dir(name: str) -> Path | None:
    """The local dir holding `name`'s safetensors (a local checkpoint, or a hub id's snapshot, downloaded if it
    is not cached yet); None when it has none."""
    files = checkpoint_files(name)
    if files is None and not Path(name).is_dir():
        try:
            snapshot_download(name, allow_patterns=["*.safetensors", "*.safetensors.index.json", "*.json"])
        except Exception as e:  # offline, no such repo: the plain load reports it in its own words
            logger.debug(f"no safetensors snapshot of {name!r}: {e}")
            return None
        files = checkpoint_files(name)
    if files is None or len({f.parent for f in files}) != 1:
        return None
    return files[0].parent


def build_empty(name: str, device_type: str, lora: LoraConfig | None) -> nn.Module:
    """`name`'s model with parameters on the meta device and real buffers, prepared as `model.build_model`
    prepares a loaded one (dropout off, checks, LoRA layers)."""
    try:
        config = AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise TrainerError(f"cannot load model {name!r}: {e}") from None
    disable_dropout(config)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=attention_implementation(device_type)
        )
    model.tie_weights()  # out of the context, whose parameter registration would untie them again
    with init_empty_weights(include_buffers=False):  # the LoRA layers' parameters too
        prepare(model, name, lora)
    return model


def build_sharded(config: TrainingConfig, world: Dist) -> nn.Module | None:
    """`config`'s model parallelized over `world`, every rank reading only its shards; None where the
    checkpoint cannot be read so (see the module docstring)."""
    name = config.model.name
    path = checkpoint_dir(name)
    if path is None:
        return None
    model = build_empty(name, world.device.type, config.model.lora)
    converted = converted_at_load(model)
    buffers = {k: b.clone() for k, b in model.named_buffers()}  # to_empty drops their values
    aliases = ties(model)
    if getattr(model.config, "tie_word_embeddings", False) and not aliases:
        raise TrainerError(f"{type(model).__name__}: its config ties the head to the embeddings, the model does not")
    parallelize(model, world, config)
    model.to_empty(device="cpu" if config.cpu_offload and world.device.type == "cuda" else world.device)
    retie(model, aliases)
    with torch.no_grad():
        for key, value in buffers.items():
            model.get_buffer(key).copy_(value)
    (read_converted if converted else read_shards)(model, path, {k.replace(LORA_BASE, ".") for k in aliases})
    init_adapters(model)
    return model


def read_shards(model: nn.Module, path: Path, tied: set[str]) -> None:
    """Collective: fill every checkpoint tensor of `model` (its local shards) from the safetensors in `path`.
    A parameter the checkpoint lacks is an error, but for LoRA adapters and `tied` ones (read through the
    name they are tied to)."""
    reader = HuggingFaceStorageReader(str(path))
    stored = reader.read_metadata().state_dict_metadata
    state = {key.replace(LORA_BASE, "."): value for key, value in model.state_dict().items()}
    missing = sorted(k for k in state if k not in stored and k not in tied and ".lora_" not in k)
    if missing:
        raise TrainerError(f"{path}: the checkpoint lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}")
    dcp.load({k: v for k, v in state.items() if k in stored and k not in tied}, storage_reader=reader)


def read_converted(model: nn.Module, path: Path, tied: set[str]) -> None:
    """`read_shards` for an architecture transformers converts at load (e.g. per-expert checkpoint weights fused
    into one 3-D tensor per layer): which elements of a model tensor each checkpoint tensor holds comes from
    `hf_layout.element_map`; each rank reads only the checkpoint tensors that land in its rows (its experts),
    one at a time, and places them. A tensor stored as itself (attention, embeddings) is read as its rows."""
    files = sorted(path.glob("*.safetensors"))
    located = {key: file for file in files for key in header_specs(file)}
    with ExitStack() as stack, torch.no_grad():
        opened = {file: stack.enter_context(safe_open(file, framework="pt")) for file in files}
        for key, param in model.state_dict().items():
            key = key.replace(LORA_BASE, ".")
            if key in tied or ".lora_" in key:
                continue
            parts = element_map(model, key, tuple(param.shape))
            if missing := sorted(k for k in ([key] if parts is None else parts) if k not in located):
                raise TrainerError(f"{path}: the checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
            local = param.to_local() if hasattr(param, "to_local") else param
            if local.numel() == 0:
                continue
            rows = shard_like(torch.arange(param.shape[0]), param)
            rows = rows.to_local() if hasattr(rows, "to_local") else rows
            first, count = int(rows[0]), len(rows)
            if parts is None:  # stored as itself: this rank's rows only
                local.copy_(opened[located[key]].get_slice(key)[first : first + count])
                continue
            per_row = param.numel() // param.shape[0]
            for name, where in parts.items():
                row = where // per_row
                mine = (row >= first) & (row < first + count)
                if mine.any():
                    tensor = opened[located[name]].get_tensor(name).reshape(-1)[mine]
                    flat = local.view(-1)
                    flat[(where[mine] - first * per_row).to(flat.device)] = tensor.to(flat.device, flat.dtype)


def ties(model: nn.Module) -> dict[str, str]:
    """Parameter names that are another name's tensor (a head tied to the embeddings) -> that name."""
    first: dict[int, str] = {}
    aliases = {}
    for key, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[key] = first[id(param)]
        else:
            first[id(param)] = key
    return aliases


def retie(model: nn.Module, aliases: dict[str, str]) -> None:
    """Tie `aliases` again: `to_empty` gives every module its own new tensor (one optimizer entry each, and
    FSDP would train only one of them)."""
    for alias, source in aliases.items():
        module, _, attr = alias.rpartition(".")
        setattr(model.get_submodule(module), attr, model.get_parameter(source))


def init_adapters(model: nn.Module) -> None:
    """LoRA's A and B as peft initialises them (A as nn.Linear's default, B = 0: the policy starts as the base),
    each drawn whole from the seeded generator and then cut to this rank's shard, so that any rank count
    starts from the same adapter."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "lora_A", None), nn.ModuleDict) and ADAPTER in module.lora_A:
                a = module.lora_A[ADAPTER].weight
                whole = torch.empty(a.shape, dtype=a.dtype)
                nn.init.kaiming_uniform_(whole, a=math.sqrt(5))
                a.copy_(shard_like(whole, a))
                module.lora_B[ADAPTER].weight.zero_()


def shard_like(whole: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`whole` laid out as `param` (this rank's piece of it where `param` is a DTensor; no communication)."""
    if not hasattr(param, "device_mesh"):
        return whole.to(param.device)

    return distribute_tensor(whole.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
