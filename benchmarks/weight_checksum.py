"""The weight checksum's cost (protocol.parity) on a Qwen3-0.6B-shaped set of tensors, on this machine's CPU:
`uv run python benchmarks/weight_checksum.py [--dtype bfloat16] [--layers 28]`. Prints parameters, seconds
and GB/s (the figure in docs/design.md §4)."""

from __future__ import annotations

import argparse
import time

import torch

from prime_rl.protocol.parity import checksum_of


def qwen3_06b(layers: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Qwen3-0.6B's tensor shapes (hidden 1024, MLP 3072, 16 query / 8 key-value heads of 128, vocab 151,936)."""
    h, mlp, q, kv, vocab = 1024, 3072, 2048, 1024, 151936
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (q, h), f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, q),
            f"{p}.self_attn.q_norm.weight": (128,), f"{p}.self_attn.k_norm.weight": (128,),
            f"{p}.mlp.gate_proj.weight": (mlp, h), f"{p}.mlp.up_proj.weight": (mlp, h),
            f"{p}.mlp.down_proj.weight": (h, mlp), f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
        }  # fmt: skip
    return {name: torch.randn(shape).to(dtype) for name, shape in shapes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    tensors = qwen3_06b(args.layers, getattr(torch, args.dtype))
    params = sum(t.numel() for t in tensors.values())
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        checksum = checksum_of(tensors.items())
        times.append(time.perf_counter() - start)
    best = min(times)
    print(
        f"{params:,} parameters ({nbytes / 1e9:.2f} GB {args.dtype}), {torch.get_num_threads()} threads: "
        f"checksum {checksum.hex} in {best:.2f} s (best of {args.repeat}), {nbytes / best / 1e9:.2f} GB/s"
    )


if __name__ == "__main__":
    main()
