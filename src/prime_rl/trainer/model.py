"""The policy model: loading an HF causal LM and running it on packed micro batches.

A packed row holds several samples end to end. Each sample must only attend to itself (positions restart
at 0 per sample). For `cu_seqlens = [0, 2, 3]` (samples a0 a1 | b0), True = may attend:

        a0 a1 b0
    a0 [ T  .  . ]
    a1 [ T  T  . ]
    b0 [ .  .  T ]

Rather than materialising that L×L block-diagonal mask, the model is loaded with one of two attention
kernels that read the sample boundaries (`cu_seq_lens_q/k`, `max_length_q/k`, passed through the HF
forward as keyword arguments):
- `flash_attention_2` (CUDA with flash-attn installed): transformers' varlen flash-attention path;
- `packed_sdpa` (everywhere else, registered below): causal SDPA run per sample, so attention costs
  Σ len² instead of L² and never sees another sample. `packed_attention_mask` is the same rule as an
  explicit mask, kept as the reference the tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from prime_rl.protocol.records import MicroBatch
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.rl.loss import target_logprobs_and_entropy, token_logprobs_and_entropy


def build_model(name: str, activation_checkpointing: bool = False, device_type: str = "cpu") -> torch.nn.Module:
    """Load `name` (hub id or local dir) in float32 on CPU: fp32 master weights; FSDP moves and shards them."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            name, dtype=torch.float32, attn_implementation=attention_implementation(device_type)
        )
    except (OSError, ValueError) as e:
        raise TrainerError(f"cannot load model {name!r}: {e}") from None
    model.config.use_cache = False
    model.train()  # from_pretrained returns eval mode, which would also switch activation checkpointing off
    if activation_checkpointing:
        apply_ac(model)
    return model


def build_sharded(config, d, max_steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The model of a trainer config (RL or SFT) sharded over `d`, with its optimizer and lr schedule."""
    from prime_rl.trainer.optim import build_optimizer, build_scheduler
    from prime_rl.trainer.parallel import apply_fsdp

    model = build_model(config.model.name, config.activation_checkpointing, d.device.type)
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
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def attention_implementation(device_type: str) -> str:
    """`flash_attention_2` on CUDA when flash-attn is importable, else our per-sample `packed_sdpa`."""
    import importlib.util

    if device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    register_packed_sdpa()
    return "packed_sdpa"


def register_packed_sdpa() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register("packed_sdpa", packed_sdpa_attention)


def packed_sdpa_attention(module, query, key, value, attention_mask, cu_seq_lens_q=None, **kwargs):
    """Causal SDPA over each packed sample separately; query/key/value are [1, heads, L, dim], out [1, L, heads, dim].

    Without `cu_seq_lens_q` (a plain HF forward, e.g. generation) it is ordinary SDPA with the given mask.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for unused in ("cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal"):
        kwargs.pop(unused, None)
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    # `split`, not slicing: the backward of n slices zero-fills and adds n full-length [1, heads, L, dim]
    # gradients (O(n·L) per layer, ~20% of a CPU step), while split's backward is one concatenation.
    lengths = cu_seq_lens_q.diff().tolist()
    outs = [
        sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)[0]
        for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2), strict=True)
    ]
    return torch.cat(outs, dim=1), None


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
