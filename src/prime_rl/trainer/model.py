"""The policy model: loading an HF causal LM and running it on packed micro batches.

A packed row holds several samples end to end. Each sample must only attend to itself, so the forward
pass gets an explicit block-diagonal causal mask built from `cu_seqlens` (and position ids that restart
at 0 per sample). For `cu_seqlens = [0, 2, 3]` (samples a0 a1 | b0), True = may attend:

        a0 a1 b0
    a0 [ T  .  . ]
    a1 [ T  T  . ]
    b0 [ .  .  T ]

transformers passes a user-supplied 4-D mask through unchanged to the attention kernel; with `sdpa` a
boolean mask means "True = attend", which is why the model is loaded with `attn_implementation="sdpa"`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prime_rl.protocol.records import MicroBatch
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.rl.loss import token_entropy, token_logprobs


def build_model(name: str, activation_checkpointing: bool = False) -> torch.nn.Module:
    """Load `name` (hub id or local dir) in float32 on CPU: fp32 master weights; FSDP moves and shards them."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, attn_implementation="sdpa")
    except (OSError, ValueError) as e:
        raise TrainerError(f"cannot load model {name!r}: {e}") from None
    model.config.use_cache = False
    model.train()  # from_pretrained returns eval mode, which would also switch activation checkpointing off
    if activation_checkpointing:
        apply_ac(model)
    return model


def apply_ac(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (HF's own hook keeps parameter names intact)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def packed_attention_mask(cu_seqlens: torch.Tensor, length: int, device: torch.device) -> torch.Tensor:
    """Boolean [1, 1, L, L] mask: causal within each sample of the packed row, nothing across samples."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    sample_of = torch.repeat_interleave(torch.arange(len(cu) - 1, device=device), cu.diff(), output_size=length)
    same_sample = sample_of[:, None] == sample_of[None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return (same_sample & causal)[None, None]


@dataclass
class PolicyOutput:
    logprobs: torch.Tensor  # [1, L], differentiable; position t = log π(input_ids[t] | sample prefix)
    entropy: torch.Tensor  # [1, L], detached


def forward_logprobs(model: torch.nn.Module, mb: MicroBatch, device: torch.device) -> PolicyOutput:
    """Token logprobs and entropies of the policy on one packed micro batch."""
    input_ids = mb.input_ids.to(device)
    mask = packed_attention_mask(mb.cu_seqlens, mb.num_tokens, device)
    logits = model(
        input_ids=input_ids, position_ids=mb.position_ids.to(device), attention_mask=mask, use_cache=False
    ).logits
    return PolicyOutput(
        logprobs=token_logprobs(logits, input_ids, mb.temperature),
        entropy=token_entropy(logits, mb.temperature),
    )


def sample_starts(mb: MicroBatch) -> torch.Tensor:
    """Bool [1, L]: True at the first token of each packed sample (it has no prefix to be predicted from)."""
    starts = torch.zeros_like(mb.loss_mask)
    starts[0, mb.cu_seqlens[:-1].long()] = True
    return starts
