"""Training a LoRA adapter vs every weight: the trainer's memory and step time, side by side in one run.

    uv run python benchmarks/lora_training.py                    # ~10M-parameter Qwen3, ~2 min on 2 CPU cores
    uv run python benchmarks/lora_training.py --hidden 512 --layers 16 --rank 64

Each mode runs in its own process (peak memory is per process) with the RL trainer's own code: `build_training`
(model, FSDP on one rank, optimizer) and `rl.train.train_step` on generated packed rows (`fake_data`), the
same rows for both. Reported per mode, medians over the steps after the first:
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


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=320)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per packed row")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--mode", choices=["full", "lora"], help="(internal) run one mode and print JSON")
    parser.add_argument("--model", type=Path, help="(internal) the model dir")
    return parser.parse_args(argv)


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def saved_activations_mib(model, row) -> float:
    """MiB of the tensors the forward of `row` saves for backward (each storage once, parameters excluded)."""
    import torch

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
    import torch

    from prime_rl.configs.trainer import TrainerConfig
    from prime_rl.trainer.fake_data import fake_micro_batches
    from prime_rl.trainer.model import build_training
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
        rows = fake_micro_batches(step, 0, args.micro_batches, args.seq_len, 16, 512, vocab, seed=0)
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


def main() -> None:
    args = parse_args()
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
            cmd = [sys.executable, __file__, "--mode", mode, "--model", str(model), "--rank", str(args.rank)]
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


if __name__ == "__main__":
    main()
