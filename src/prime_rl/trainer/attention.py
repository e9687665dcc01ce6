"""Attention over packed rows: every sample attends causally to itself and never to its neighbours.

A packed row holds several samples end to end (positions restart at 0 per sample). For
`cu_seqlens = [0, 2, 3]` (samples a0 a1 | b0), True = may attend:

        a0 a1 b0
    a0 [ T  .  . ]
    a1 [ T  T  . ]
    b0 [ .  .  T ]

Rather than materialising that L×L mask, the model gets the sample boundaries (`cu_seq_lens_q/k`,
`max_length_q/k`, passed through the HF forward as keyword arguments) and one of these kernels:
- `flash_attention_2` (CUDA with flash-attn installed): transformers' varlen flash-attention path;
- `packed_attention` (registered here) everywhere else:
  - on CPU, the `prime_rl::packed_causal_attention` op: torch's CPU flash-attention kernel per sample;
  - on other devices, causal SDPA per sample.
  Either way attention costs Σ len² rather than L². `packed_attention_mask` is the same rule as an
  explicit mask, kept as the reference the tests compare against.

On CPU the op is opaque to torch.compile, so a compiled decoder layer stays one graph around it whatever
the sample lengths. The kernel computes 512-key blocks whole, so up to 512 tokens it pays for the full
square, not the causal triangle. A sample of at least `SPLIT_FROM` tokens is therefore cut in two halves a | b:
a→a and b→b causal, b→a full, the two parts of b merged by their logsumexps (3/4 of the square; each
part's backward takes the merged output and logsumexp, which is exact). That is 8–18% faster from 384
tokens; finer cuts (query blocks, or a second level of halves) measured slower: smaller kernel calls lose
more than the skipped work saves.
"""

from __future__ import annotations

import torch

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@torch.library.custom_op("prime_rl::packed_causal_attention", mutates_args=(), device_types="cpu")
def packed_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, H, L, D], k/v [1, KV, L, D] (KV divides H) → out [1, L, H, D], logsumexp [1, H, L]."""
    lengths = cu_seqlens.diff().tolist()
    per_sample = zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2), strict=True)
    parts = [_sample_forward(*qkv, scale) for qkv in per_sample]
    # The kernel's out is [1, H, l, D] over [1, l, H, D] memory: concatenating in that layout is one copy.
    out = torch.cat([o.transpose(1, 2) for o, _ in parts], 1)
    return out, torch.cat([lse for _, lse in parts], 2)


SPLIT_FROM = 320  # samples this long or longer are computed in halves (module docstring)


def _sample_forward(q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of one sample: out [1, H, l, D], logsumexp [1, H, l]."""
    n = q.shape[2]
    if n < SPLIT_FROM:
        return _flash(q, k, v, 0.0, True, scale=scale)[:2]
    h = n // 2
    out_a, lse_a = _flash(q[:, :, :h], k[:, :, :h], v[:, :, :h], 0.0, True, scale=scale)[:2]
    out_bb, lse_bb = _flash(q[:, :, h:], k[:, :, h:], v[:, :, h:], 0.0, True, scale=scale)[:2]
    out_ba, lse_ba = _flash(q[:, :, h:], k[:, :, :h], v[:, :, :h], 0.0, False, scale=scale)[:2]
    lse_b = torch.logaddexp(lse_bb, lse_ba)
    out_b = out_bb * (lse_bb - lse_b).exp_().unsqueeze(-1) + out_ba * (lse_ba - lse_b).exp_().unsqueeze(-1)
    return torch.cat([out_a, out_b], 2), torch.cat([lse_a, lse_b], 2)


def _sample_backward(grad, q, k, v, out, lse, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `_sample_forward` for q, k, v, from the sample's (merged) out and logsumexp."""
    n = q.shape[2]
    if n < SPLIT_FROM:
        return _flash_backward(grad, q, k, v, out, lse, 0.0, True, scale=scale)
    h = n // 2
    a, b = slice(None, h), slice(h, None)
    dq_a, dk_a, dv_a = _flash_backward(*(t[:, :, a] for t in (grad, q, k, v, out, lse)), 0.0, True, scale=scale)
    grad_b, q_b, out_b, lse_b = (t[:, :, b] for t in (grad, q, out, lse))
    dq_bb, dk_b, dv_b = _flash_backward(grad_b, q_b, k[:, :, b], v[:, :, b], out_b, lse_b, 0.0, True, scale=scale)
    dq_ba, dk_ba, dv_ba = _flash_backward(grad_b, q_b, k[:, :, a], v[:, :, a], out_b, lse_b, 0.0, False, scale=scale)
    return torch.cat([dq_a, dq_bb + dq_ba], 2), torch.cat([dk_a + dk_ba, dk_b], 2), torch.cat([dv_a + dv_ba, dv_b], 2)


@packed_causal_attention.register_fake
def _(q, k, v, cu_seqlens, scale):
    batch, heads, length, dim = q.shape
    return q.new_empty(batch, length, heads, dim), q.new_empty(batch, heads, length, dtype=torch.float32)


@torch.library.custom_op("prime_rl::packed_causal_attention_backward", mutates_args=(), device_types="cpu")
def packed_causal_attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lengths = cu_seqlens.diff().tolist()
    per_sample = (t.split(lengths, 2) for t in (grad.transpose(1, 2), q, k, v, out.transpose(1, 2), lse))
    grads = [_sample_backward(*tensors, scale) for tensors in zip(*per_sample, strict=True)]
    return tuple(torch.cat(g, 2).contiguous() for g in zip(*grads, strict=True))


@packed_causal_attention_backward.register_fake
def _(grad, q, k, v, out, lse, cu_seqlens, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, scale = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens)
    ctx.scale = scale


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    grads = packed_causal_attention_backward(grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, ctx.scale)
    return *grads, None, None


packed_causal_attention.register_autograd(_backward, setup_context=_setup_context)


def attention_implementation(device_type: str) -> str:
    """`flash_attention_2` on CUDA when flash-attn is importable, else our `packed_attention`."""
    import importlib.util

    if device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    from transformers import AttentionInterface

    AttentionInterface.register("packed_attention", packed_attention)
    return "packed_attention"


def packed_attention(module, query, key, value, attention_mask, cu_seq_lens_q=None, **kwargs):
    """HF attention interface: query/key/value [1, heads, L, dim] → out [1, L, heads, dim].

    Without `cu_seq_lens_q` (a plain HF forward, e.g. generation) it is ordinary SDPA with the given mask.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for unused in ("cu_seq_lens_k", "max_length_q", "max_length_k", "is_causal"):
        kwargs.pop(unused, None)
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
    if query.device.type == "cpu" and not kwargs.get("dropout"):
        return packed_causal_attention(query, key, value, cu_seq_lens_q, scale)[0], None
    # `split`, not slicing: the backward of n slices zero-fills and adds n full-length [1, heads, L, dim]
    # gradients, while split's backward is one concatenation.
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
