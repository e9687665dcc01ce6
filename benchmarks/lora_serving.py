"""Serving a LoRA adapter: merged into the weights (what the built-in engine does) vs applied at runtime.

    uv run python benchmarks/lora_serving.py                     # defaults: ~1 min on a 2-core CPU
    uv run python benchmarks/lora_serving.py --hidden 512 --layers 8 --rank 64 --batch 1 32

A tiny Qwen3 (`--hidden`, `--layers`; the defaults make ~11M parameters) gets a peft adapter of rank
`--rank` on every projection (q/k/v/o, gate/up/down), with a random lora_B. Decode throughput, per batch size:
- base: the model without adapter;
- merged: the same model with W = W_base + (alpha/r)·B@A copied in (`engine.weights.merge_adapter`), the
  built-in engine's way: the forward is the base model's;
- runtime: the peft-wrapped model, unmerged: every adapted linear adds x@A^T@B^T (what a server that keeps
  adapters separate computes).
Each variant decodes `--tokens` tokens after a 32-token prompt with transformers' KV cache, greedy; the timed
repetitions interleave (one of each variant per round) and the table shows medians. Then the cost of an
update on the built-in engine: reading + checking the adapter dir (`read_adapter`) and merging it onto the
base (`merge_adapter`), medians over `--reps`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=64, help="decoded tokens per repetition")
    parser.add_argument("--reps", type=int, default=5)
    return parser.parse_args(argv)


def build(root: Path, args: argparse.Namespace):
    """(base model, merged model, peft-wrapped model, adapter dir, LoraConfig of the server)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from prime_rl.configs import LoraConfig
    from prime_rl.inference.engine.weights import load_adapter_dir, lora_targets
    from prime_rl.protocol import mark_stable
    from prime_rl.utils.tiny_model import create_tiny_model

    model_dir = create_tiny_model(root / "model", "qwen3", hidden_size=args.hidden, num_layers=args.layers)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_config = PeftLoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets, task_type="CAUSAL_LM")
    runtime = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), peft_config)
    with torch.no_grad():
        for name, param in runtime.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    adapter_dir = root / "weights" / "step_1"
    runtime.save_pretrained(adapter_dir)
    mark_stable(adapter_dir)
    lora = LoraConfig(rank=args.rank, alpha=2 * args.rank, target_modules=targets)

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    merged = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pristine = {name: t.detach().clone() for name, t in merged.state_dict().items()}
    loaded = load_adapter_dir(adapter_dir, merged, lora, pristine, lora_targets(merged, lora))
    with torch.no_grad():
        for name, tensor in loaded.tensors.items():
            merged.state_dict()[name].copy_(tensor)
    return base, merged, runtime.eval(), adapter_dir, lora, pristine


def decode_seconds(model, batch: int, tokens: int) -> float:
    """Seconds to decode `tokens` greedy tokens for `batch` rows after a 32-token prompt (prefill untimed)."""
    from transformers import DynamicCache

    ids = torch.randint(3, 1000, (batch, 32), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = DynamicCache()
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        start = time.perf_counter()
        for _ in range(tokens):
            next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
            out = model(input_ids=next_ids, past_key_values=out.past_key_values, use_cache=True)
        return time.perf_counter() - start


def main(argv=None) -> None:
    args = parse_args(argv)
    from prime_rl.inference.engine.weights import lora_targets, merge_adapter, model_linears
    from prime_rl.inference.weights import read_adapter

    with tempfile.TemporaryDirectory() as tmp:
        base, merged, runtime, adapter_dir, lora, pristine = build(Path(tmp), args)
        params = sum(p.numel() for p in base.parameters())
        print(f"tiny qwen3: hidden {args.hidden}, {args.layers} layers, {params / 1e6:.1f}M parameters; "
              f"adapter rank {args.rank} on every projection; torch threads {torch.get_num_threads()}")  # fmt: skip
        variants = {"base": base, "merged": merged, "runtime": runtime}
        print(f"\n{'batch':>5} {'variant':>8} {'tokens/s':>10} {'vs merged':>10}")
        for batch in args.batch:
            times = {name: [] for name in variants}
            for model in variants.values():
                decode_seconds(model, batch, 4)  # warm-up
            for _ in range(args.reps):
                for name, model in variants.items():
                    times[name].append(decode_seconds(model, batch, args.tokens))
            rates = {name: batch * args.tokens / statistics.median(t) for name, t in times.items()}
            for name, rate in rates.items():
                print(f"{batch:>5} {name:>8} {rate:>10.0f} {rate / rates['merged']:>9.2f}x")

        linears, targets = model_linears(merged), lora_targets(merged, lora)
        read, merge = [], []
        for _ in range(args.reps):
            start = time.perf_counter()
            adapter = read_adapter(adapter_dir, lora, linears)
            read.append(time.perf_counter() - start)
            start = time.perf_counter()
            merge_adapter(adapter.pairs, adapter.scale, pristine, targets, merged)
            merge.append(time.perf_counter() - start)
        print(
            f"\nupdate ({len(targets)} linear layers): read + check {statistics.median(read) * 1e3:.1f} ms, "
            f"merge {statistics.median(merge) * 1e3:.1f} ms (medians of {args.reps})"
        )


if __name__ == "__main__":
    main()
