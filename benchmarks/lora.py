"""LoRA's costs: serving an adapter (merged vs applied at runtime) and training one (vs every weight).

    uv run python benchmarks/lora.py serving                  # ~1 min on a 2-core CPU
    uv run python benchmarks/lora.py serving --hidden 512 --layers 8 --rank 64 --batch 1 32
    uv run python benchmarks/lora.py training                 # ~10M-parameter Qwen3, ~2 min on 2 CPU cores
    uv run python benchmarks/lora.py training --hidden 512 --layers 16 --rank 64

`serving`: A tiny Qwen3 (`--hidden`, `--layers`; the defaults make ~11M parameters) gets a peft adapter of rank
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

`training`: each mode runs in its own process (peak memory is per process) with the RL trainer's own code:
`build_training` (model, FSDP on one rank, optimizer) and `rl.train.train_step` on generated packed rows
(`fake_data`), the same rows for both. Reported per mode, medians over the steps after the first:
- trainable parameters, and the bytes of the training state (trainable weights' gradients + AdamW's two
  moments): what LoRA saves, whatever the activations;
- the activations autograd keeps for backward on one packed row (unique storages saved by the forward,
  parameters left out): exact, where RSS is not;
- peak RSS growth over the whole run from the process's RSS right after the model was loaded (the
  libraries' own footprint, identical for both, is left out): state + activations + allocator slack;
- step time.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import add_json_argument, add_question, question_parser, write_json


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


def main_serving(args: argparse.Namespace) -> None:
    from prime_rl.inference.engine.weights import lora_targets, merge_adapter, model_linears
    from prime_rl.inference.weights import read_adapter

    with tempfile.TemporaryDirectory() as tmp:
        base, merged, runtime, adapter_dir, lora, pristine = build(Path(tmp), args)
        params = sum(p.numel() for p in base.parameters())
        print(f"tiny qwen3: hidden {args.hidden}, {args.layers} layers, {params / 1e6:.1f}M parameters; "
              f"adapter rank {args.rank} on every projection; torch threads {torch.get_num_threads()}")  # fmt: skip
        variants = {"base": base, "merged": merged, "runtime": runtime}
        print(f"\n{'batch':>5} {'variant':>8} {'tokens/s':>10} {'vs merged':>10}")
        decode = []
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
                decode.append({"batch": batch, "variant": name, "tokens_per_s": rate})

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
        update = {"linears": len(targets), "read_s": statistics.median(read), "merge_s": statistics.median(merge)}
    write_json(args, "lora-serving", {"params": params, "decode": decode, "update": update})


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def saved_activations_mib(model, row) -> float:
    """MiB of the tensors the forward of `row` saves for backward (each storage once, parameters excluded)."""
    from prime_rl.trainer.logprobs import forward_logprobs

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward_logprobs(model, row, torch.device("cpu"), where=row.loss_mask)
    out.logprobs.sum().backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values()) / 2**20


def run_mode(args) -> dict:
    from prime_rl.configs.trainer import TrainerConfig
    from prime_rl.trainer.fake_data import fake_micro_batches
    from prime_rl.trainer.loading import build_training
    from prime_rl.trainer.micro_batch import MicroBatch
    from prime_rl.trainer.parallel import init_distributed
    from prime_rl.trainer.rl.train import train_step

    lora = {"rank": args.rank, "alpha": 2 * args.rank} if args.mode == "lora" else None
    config = TrainerConfig(model={"name": str(args.model), "lora": lora}, device="cpu", optim={"lr": 1e-4})
    torch.manual_seed(0)
    d = init_distributed("cpu")
    model, optimizer, _ = build_training(config, d, max_steps=args.steps)
    loaded = rss_mib()
    vocab = model.config.vocab_size
    times = []
    for step in range(args.steps):
        rows = [
            MicroBatch.from_row(r)
            for r in fake_micro_batches(step, 0, args.micro_batches, args.seq_len, 16, 512, vocab, seed=0)
        ]
        start = time.perf_counter()
        train_step(model, optimizer, rows, config, d)
        times.append(time.perf_counter() - start)
    saved = saved_activations_mib(model, rows[0])
    trainable = [p for p in model.parameters() if p.requires_grad]
    state = sum(p.numel() for p in trainable) * 4 * 3  # fp32 gradient + exp_avg + exp_avg_sq
    return {
        "mode": args.mode,
        "params": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in trainable),
        "state_mib": state / 2**20,
        "saved_mib": saved,
        "peak_growth_mib": rss_mib() - loaded,
        "step_s": statistics.median(times[1:]),
    }


def main_training(args: argparse.Namespace) -> None:
    if args.mode:
        print(json.dumps(run_mode(args)))
        return
    from rich.console import Console
    from rich.table import Table

    from prime_rl.utils.tiny_model import create_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = create_tiny_model(Path(tmp) / "model", "qwen3", hidden_size=args.hidden, num_layers=args.layers)
        rows = []
        for mode in ("full", "lora"):
            cmd = [
                sys.executable,
                __file__,
                "training",
                "--mode",
                mode,
                "--model",
                str(model),
                "--rank",
                str(args.rank),
            ]
            cmd += ["--seq-len", str(args.seq_len), "--micro-batches", str(args.micro_batches)]
            cmd += ["--steps", str(args.steps)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    table = Table(title=f"trainer: full fine-tuning vs LoRA rank {args.rank}, {rows[0]['params'] / 1e6:.1f}M params")
    columns = (
        "mode",
        "trainable",
        "grad + AdamW state (MiB)",
        "saved activations / row (MiB)",
        "peak RSS growth (MiB)",
    )
    for column in (*columns, "step (s)"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["mode"],
            f"{r['trainable']:,}",
            f"{r['state_mib']:.1f}",
            f"{r['saved_mib']:.0f}",
            f"{r['peak_growth_mib']:.0f} MiB",
            f"{r['step_s']:.2f}",
        )
    Console(width=120).print(table)
    write_json(args, "lora-training", {"rows": rows})


def main() -> None:
    parser, sub = question_parser(__doc__)
    s = add_question(sub, __doc__, "serving", "decode speed: base, merged adapter, runtime adapter; the update's cost")
    s.add_argument("--hidden", type=int, default=384)
    s.add_argument("--layers", type=int, default=8)
    s.add_argument("--rank", type=int, default=16)
    s.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    s.add_argument("--tokens", type=int, default=64, help="decoded tokens per repetition")
    s.add_argument("--reps", type=int, default=5)
    add_json_argument(s, "lora-serving")
    t = add_question(sub, __doc__, "training", "trainer memory and step time: every weight vs a LoRA adapter")
    t.add_argument("--hidden", type=int, default=320)
    t.add_argument("--layers", type=int, default=10)
    t.add_argument("--rank", type=int, default=16)
    t.add_argument("--seq-len", type=int, default=1024, help="tokens per packed row")
    t.add_argument("--micro-batches", type=int, default=2)
    t.add_argument("--steps", type=int, default=6)
    t.add_argument("--mode", choices=["full", "lora"], help="(internal) run one mode and print JSON")
    t.add_argument("--model", type=Path, help="(internal) the model dir")
    add_json_argument(t, "lora-training")
    args = parser.parse_args()
    {"serving": main_serving, "training": main_training}[args.question](args)


if __name__ == "__main__":
    main()
