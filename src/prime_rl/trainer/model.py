"""The policy model: loading an HF causal LM and running it on packed micro batches.

A packed row holds several samples end to end; `attention.py` keeps each sample attending only to itself.
With `compile`, each decoder layer's forward is compiled once for every row length (dynamic shapes):
inductor fuses the norms, rotary embedding and SwiGLU around the matmuls, the packed attention op stays
opaque, and module hooks (FSDP, activation checkpointing) run outside the compiled code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from prime_rl.protocol.records import MicroBatch
from prime_rl.trainer.attention import attention_implementation
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.rl.loss import target_logprobs_and_entropy, token_logprobs_and_entropy
from prime_rl.trainer.weights import check_export_layout


def build_model(
    name: str, activation_checkpointing: bool = False, device_type: str = "cpu", compile: bool = False
) -> torch.nn.Module:
    """Load `name` (hub id or local dir) in float32 on CPU: fp32 master weights; FSDP moves and shards them."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            name, dtype=torch.float32, attn_implementation=attention_implementation(device_type)
        )
    except (OSError, ValueError) as e:
        raise TrainerError(f"cannot load model {name!r}: {e}") from None
    check_export_layout(model, name)
    model.config.use_cache = False
    model.train()  # from_pretrained returns eval mode, which would also switch activation checkpointing off
    if activation_checkpointing:
        apply_ac(model)
    if compile:
        apply_compile(model, device_type)
    return model


def build_sharded(config, d, max_steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The model of a trainer config (RL or SFT) sharded over `d`, with its optimizer and lr schedule."""
    from prime_rl.trainer.optim import build_optimizer, build_scheduler
    from prime_rl.trainer.parallel import apply_fsdp

    model = build_model(config.model.name, config.activation_checkpointing, d.device.type, config.compile)
    apply_fsdp(model, d, compute_dtype(config.dtype, d.device), config.cpu_offload)
    optimizer = build_optimizer(model, config.optim)
    return model, optimizer, build_scheduler(optimizer, config.optim, max_steps)


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
    """Compile each decoder layer's `forward` (not `__call__`: hooks stay eager, parameter names unchanged)."""
    import os
    import shutil

    from prime_rl.trainer.parallel import decoder_layers

    compilers = [os.environ.get("CXX"), "g++", "c++", "clang++"]
    if device_type == "cpu" and not any(c and shutil.which(c) for c in compilers):
        raise TrainerError("--compile on CPU needs a C++ compiler (g++, or $CXX); install one or drop --compile")
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward, dynamic=True)


@dataclass
class PolicyOutput:
    logprobs: torch.Tensor  # [1, L], differentiable; position t = log π(input_ids[t] | sample prefix)
    entropy: torch.Tensor  # [1, L], detached unless asked for with entropy_grad


def forward_logits(model: torch.nn.Module, mb: MicroBatch, device: torch.device, keep=None) -> torch.Tensor:
    """Logits [1, L, V] of one packed row, every sample attending only to itself; with `keep` (positions,
    long [K]) only those rows, [1, K, V]: the lm_head then never runs on the rest."""
    cu = mb.cu_seqlens.to(device=device, dtype=torch.int32)
    longest = int(mb.cu_seqlens.diff().max())
    return model(
        input_ids=mb.input_ids.to(device),
        position_ids=mb.position_ids.to(device),
        use_cache=False,
        logits_to_keep=0 if keep is None else keep,  # 0 = every position
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=longest,
        max_length_k=longest,
    ).logits


def forward_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    device: torch.device,
    entropy_grad: bool = False,
    where: torch.Tensor | None = None,
) -> PolicyOutput:
    """Token logprobs and entropies of the policy on one packed micro batch.

    With `where` (bool [1, L], e.g. the loss mask) only those positions are computed and the rest are 0:
    the lm_head and the [L, V] log-softmax then skip the prompts, which the loss never reads.
    """
    ids = mb.input_ids.to(device)
    if where is None:
        logits = forward_logits(model, mb, device)
        logprobs, entropy = token_logprobs_and_entropy(logits, ids, mb.temperature, entropy_grad)
        return PolicyOutput(logprobs=logprobs, entropy=entropy)
    # Token t is predicted by the logits at t − 1 of the same sample, so a sample's first token has none.
    targets = (where.to(device) & ~sample_starts(mb).to(device))[0].nonzero().squeeze(-1)
    logits = forward_logits(model, mb, device, keep=targets - 1)
    logprobs, entropy = target_logprobs_and_entropy(logits, ids[:, targets], mb.temperature, entropy_grad)
    index = targets[None]
    zeros = torch.zeros(ids.shape, dtype=logprobs.dtype, device=device)
    return PolicyOutput(logprobs=zeros.scatter(1, index, logprobs), entropy=zeros.scatter(1, index, entropy))


def sample_starts(mb: MicroBatch) -> torch.Tensor:
    """Bool [1, L]: True at the first token of each packed sample (it has no prefix to be predicted from)."""
    starts = torch.zeros_like(mb.loss_mask)
    starts[0, mb.cu_seqlens[:-1].long()] = True
    return starts
