"""The engine's own forward pass for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3) over a slot KV cache.

transformers' generic forward rebuilds an attention mask from the whole [B, L] padding mask, concatenates
its cache every step and walks a deep module tree; at a CPU engine's sizes that Python work is most of a
decode step. Here one decode step is ~15 tensor ops per layer, and the cache is written in place:

- every layer's cache is one [slots, kv_heads, capacity, head_dim] tensor for keys and one for values;
  running row b owns slot b, its token at position p sits in column p (no left padding, no realignment
  when rows join), and `lengths[b]` says how many columns are its own;
- a prefill runs the new prompts right-padded with a causal mask (a padded position comes after every real
  one, so no real token sees a pad) and copies their keys/values into fresh slots;
- a decode step writes each row's new key/value at its own column and attends to columns < its length;
- a row that leaves is replaced by the last row (one slot copied), so running rows stay in slots 0..B-1.

Weights are the HF module's own: q/k/v and gate/up are concatenated once, and the module's parameters are
re-pointed at views of those tensors, so a weight update that copies into the module's state dict also
updates the fused tensors. `NATIVE_ARCHITECTURES` lists what this covers; anything else runs through
transformers (batch.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

NATIVE_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def native_unsupported(config: Any) -> str | None:
    """Why this model cannot run natively (None = it can)."""
    if config.model_type not in NATIVE_ARCHITECTURES:
        return f"architecture {config.model_type!r} is not one of {', '.join(NATIVE_ARCHITECTURES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (only silu)"
    window = getattr(config, "sliding_window", None)
    uses_window = config.model_type == "mistral" or getattr(config, "use_sliding_window", False)
    if window is not None and uses_window:
        return "sliding-window attention"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return "layers other than full attention"
    return None


class _Layer:
    """One decoder layer's weights (views of the HF module's parameters, fused where it saves an op)."""

    def __init__(self, layer: torch.nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        self.qkv_weight, self.qkv_bias = _fuse(attn.q_proj, attn.k_proj, attn.v_proj)
        self.q_norm = getattr(attn, "q_norm", None)  # Qwen3 normalises each head's queries and keys
        self.k_norm = getattr(attn, "k_norm", None)
        self.o_proj = attn.o_proj
        self.gate_up_weight, self.gate_up_bias = _fuse(mlp.gate_proj, mlp.up_proj)
        self.down_proj = mlp.down_proj
        self.scaling = attn.scaling


def _fuse(*linears: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the linears' weights (and biases) and make each linear's parameters views into them."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(weight[start : start + rows], requires_grad=False)
        if has_bias:
            lin.bias = torch.nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return weight, bias


def _rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)
    return F.rms_norm(x, norm.weight.shape, norm.weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class NativeDecoder:
    """Prefill and decode for up to `slots` rows; the caller keeps rows in slots 0..B-1 (see `move`)."""

    def __init__(self, model: torch.nn.Module, slots: int, device: torch.device):
        config = model.config
        self.model, self.device, self.slots = model, device, slots
        self.base = model.model
        self.layers = [_Layer(layer) for layer in self.base.layers]
        self.q_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)

    def reserve(self, columns: int) -> None:
        """Make every slot hold at least `columns` positions (grows by doubling, keeps what is cached)."""
        if columns <= self.capacity:
            return
        capacity = max(columns, 2 * self.capacity, 64)
        dtype = self.layers[0].qkv_weight.dtype
        shape = (self.slots, self.kv_heads, capacity, self.head_dim)
        keys = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in self.layers]
        values = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in self.layers]
        for new, old in zip(keys + values, self.keys + self.values, strict=False):
            new[:, :, : self.capacity] = old
        self.keys, self.values, self.capacity = keys, values, capacity

    def prefill(self, prompts: list[list[int]], slots: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """Run `prompts` once and cache prompt `source[i]` in slot `slots[i]`; logits [len(slots), V] of the
        last prompt token, per slot. (A request with n samples passes its prompt once and its index n times.)"""
        width = max(len(p) for p in prompts)
        self.reserve(width)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
        ids = ids.to(self.device)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        positions = torch.arange(width, device=self.device)[None]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.keys[i][slots, :, :width] = k[source]
            self.values[i][slots, :, :width] = v[source]
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.layers[i].scaling, enable_gqa=self.kv_heads != self.q_heads
            )

        hidden = self._forward(ids, positions, attend)
        self.lengths[slots] = lengths[source]
        last = hidden[torch.arange(len(prompts), device=self.device), lengths - 1]
        return self._logits(last)[source]

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token for each of the rows in slots 0..B-1 (`tokens` [B]); logits [B, V]."""
        rows = tokens.shape[0]
        lengths = self.lengths[:rows]
        columns = int(lengths.max()) + 1
        self.reserve(columns)
        index = torch.arange(rows, device=self.device)
        # Additive mask over the cached columns: a row sees its own `length + 1` columns.
        visible = torch.arange(columns, device=self.device)[None] <= lengths[:, None]
        bias = torch.zeros(visible.shape, dtype=self.keys[0].dtype, device=self.device)
        bias = bias.masked_fill_(~visible, float("-inf"))[:, None, None, :]
        group = self.q_heads // self.kv_heads

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = self.keys[i], self.values[i]
            keys[index, :, lengths] = k[:, :, 0]
            values[index, :, lengths] = v[:, :, 0]
            keys, values = keys[:rows, :, :columns], values[:rows, :, :columns]
            # Grouped heads as a [B, kv_heads, group, dim] query block: two batched matmuls, no K/V repeat.
            q = q.reshape(rows, self.kv_heads, group, self.head_dim)
            scores = torch.matmul(q, keys.transpose(-1, -2)) * self.layers[i].scaling + bias
            out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(values.dtype), values)
            return out.reshape(rows, self.q_heads, 1, self.head_dim)

        hidden = self._forward(tokens[:, None], lengths[:, None], attend)
        self.lengths[:rows] += 1
        return self._logits(hidden[:, -1])

    def move(self, src: list[int], dst: list[int]) -> None:
        """Copy the cache of slots `src` into slots `dst` (rows leaving the batch make room this way)."""
        if not src:
            return
        s = torch.tensor(src, device=self.device)
        d = torch.tensor(dst, device=self.device)
        for cache in self.keys + self.values:
            cache[d] = cache[s]
        self.lengths[d] = self.lengths[s]

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        x = self.base.embed_tokens(ids)
        rows, width, _ = x.shape
        cos, sin = self.base.rotary_emb(x, positions.expand(rows, width))
        cos, sin = cos[:, None], sin[:, None]
        qd, kd = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.input_norm)
            q, k, v = F.linear(h, layer.qkv_weight, layer.qkv_bias).split([qd, kd, kd], dim=-1)
            q = q.view(rows, width, self.q_heads, self.head_dim)
            k = k.view(rows, width, self.kv_heads, self.head_dim)
            if layer.q_norm is not None:
                q, k = _rms_norm(q, layer.q_norm), _rms_norm(k, layer.k_norm)
            q = _rotate(q.transpose(1, 2), cos, sin)
            k = _rotate(k.transpose(1, 2), cos, sin)
            v = v.view(rows, width, self.kv_heads, self.head_dim).transpose(1, 2)
            out = attend(i, q, k, v).transpose(1, 2).reshape(rows, width, qd)
            x = x + layer.o_proj(out)
            gate, up = F.linear(_rms_norm(x, layer.post_norm), layer.gate_up_weight, layer.gate_up_bias).chunk(2, -1)
            x = x + layer.down_proj(F.silu(gate) * up)
        return x

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(_rms_norm(hidden, self.base.norm))
