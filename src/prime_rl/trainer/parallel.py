"""Process group and FSDP2 sharding: one code path for CPU (gloo) and CUDA (NCCL).

Under torchrun the rank and world size come from its environment; launched directly (`trainer ...`)
the trainer is a one-process group held in an in-memory store, so no port is needed.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from prime_rl.configs.training import TrainingConfig
from prime_rl.trainer.errors import TrainerError

logger = logging.getLogger("prime_rl")


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(choice: Literal["auto", "cpu", "cuda"]) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise TrainerError("device = 'cuda' but no CUDA device is available")
    return choice


# What gloo's worker threads get to free their finished collectives before the process exits (close_distributed).
DRAIN_SECONDS = 0.2


def init_distributed(device_type: str) -> Dist:
    """Join (or create) the default process group and pick this rank's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    device_id = device if device.type == "cuda" else None
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, device_id=device_id)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id)
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device)


def parallelize(model: torch.nn.Module, world: Dist, config: TrainingConfig) -> None:
    """Make a trainer config's (RL or SFT) model ready to train on `world`, in the one order that works:
    activation checkpointing wraps each decoder layer, compile then compiles the layer's forward (the
    checkpoint and FSDP hooks stay eager, parameter names unchanged), FSDP shards last."""
    if config.activation_checkpointing:
        apply_ac(model)
    if config.compile:
        apply_compile(model, world.device.type)
    apply_fsdp(model, world, compute_dtype(config.dtype, world.device), config.cpu_offload, config.parallel.replicate)


def compute_dtype(choice: str, device: torch.device) -> torch.dtype:
    """Dtype of the weights in forward/backward; the master copy is always float32."""
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, choice)


def apply_ac(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (HF's own hook keeps parameter names intact)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # newer transformers; the old name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def apply_compile(model: torch.nn.Module, device_type: str) -> None:
    """Compile each decoder layer's `forward` (not `__call__`: hooks stay eager, parameter names unchanged).

    Each layer compiles once for every row length (dynamic shapes): inductor fuses the norms, rotary
    embedding and SwiGLU around the matmuls; the packed attention op stays opaque."""
    compilers = [os.environ.get("CXX"), "g++", "c++", "clang++"]
    if device_type == "cpu" and not any(c and shutil.which(c) for c in compilers):
        raise TrainerError("--compile on CPU needs a C++ compiler (g++, or $CXX); install one or drop --compile")
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward, dynamic=True)


def apply_fsdp(
    model: torch.nn.Module, world: Dist, param_dtype: torch.dtype, cpu_offload: bool = False, replicate: int = 1
) -> None:
    """Shard every decoder layer, then the root (embeddings, final norm, head), over all ranks; with
    `replicate` > 1 (HSDP) over each group of world / replicate consecutive ranks, the groups holding replicas
    (gradients are reduce-scattered within a group, then all-reduced across groups).

    Master weights and optimizer state stay float32; with `param_dtype=bfloat16` the all-gathered
    weights used in forward/backward are bf16 while gradients are reduced in fp32. With `cpu_offload`
    (CUDA only) the sharded parameters, gradients and optimizer state live in host memory.

    One rank computing in fp32 without offload has nothing to shard, cast or move, so the model stays a
    plain module (FSDP's hooks and DTensor dispatch cost ~4% of a CPU step) and is moved to the device.
    Checkpoints and exported weights are the same either way.
    """
    if world.world_size % replicate:
        raise TrainerError(
            f"parallel.replicate = {replicate} does not divide the {world.world_size} trainer rank(s) into equal groups"
        )
    if world.world_size == 1 and param_dtype == torch.float32 and not cpu_offload:
        if not next(model.parameters()).is_meta:  # a model built on meta gets its storage after (loading.py)
            model.to(world.device)
        return
    mesh = device_mesh(world, replicate)
    if replicate > 1:
        logger.info(f"HSDP: {replicate} replicas x {world.world_size // replicate} shards ({world.world_size} ranks)")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if cpu_offload and world.device.type == "cuda" else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)


def device_mesh(world: Dist, replicate: int = 1):
    """The ranks as one shard group, or as replicate x shard (HSDP: row r = ranks r * shard ... r * shard + shard
    - 1, a node's ranks under torchrun)."""
    if replicate == 1:
        return init_device_mesh(world.device.type, (world.world_size,))
    shape = (replicate, world.world_size // replicate)
    return init_device_mesh(world.device.type, shape, mesh_dim_names=("replicate", "shard"))


def set_micro_batch_sync(model: torch.nn.Module, world: Dist, last: bool) -> None:
    """Before each micro batch: on one rank, reduce gradients and reshard only after the last one's backward.

    With several ranks every micro batch reduce-scatters, so no rank ever holds a full unsharded gradient.
    On one rank an unsharded gradient costs nothing extra, and accumulating it in place skips a
    reduce-scatter copy per layer and micro batch, and the next micro batch's first parameter gather.
    (Not resharding after forward would also skip the backward re-gather, but a forward without backward,
    e.g. an evaluation, would then leave stale unsharded weights behind after the optimizer step.)
    """
    if world.world_size == 1 and hasattr(model, "set_requires_gradient_sync"):  # plain module: nothing to do
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks of an HF causal LM (`model.model.layers` for Llama-like models)."""
    base = getattr(model, model.base_model_prefix, model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise TrainerError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    return list(layers)


def all_reduce(values: list[float], device: torch.device, op: Literal["sum", "max"] = "sum") -> list[float]:
    """Reduce a few scalars over all ranks in one collective."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def close_distributed(clean: bool = True) -> None:
    """Leave the process group. After a clean run every rank first meets at a barrier; then it leaves
    gloo's worker threads DRAIN_SECONDS with the GIL free: such a thread frees a finished collective (and the
    tensors it held) after its caller has moved on, taking the GIL to do so, and a thread that wants the GIL once
    the interpreter is shutting down aborts the process ("terminate called without an active exception", exit
    -6 after a run that did everything; the barrier alone still left its own such free behind in 1 of 30 runs).
    After an error the other ranks may sit in another collective: no barrier then, it would wait out the group's
    timeout; the drain stays (a process whose background checkpoint failed on a full disk, left without it,
    exited -6 in 1 of ~15 runs)."""
    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
    time.sleep(DRAIN_SECONDS)
    dist.destroy_process_group()
