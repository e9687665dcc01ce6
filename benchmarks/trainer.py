"""Trainer throughput: our packed FSDP2 step vs a plain padded `transformers` loop, on the same samples.

    uv run python benchmarks/trainer.py                      # defaults: ~1 min on a 2-core CPU
    uv run python benchmarks/trainer.py --samples 64 --reps 5 --hidden 512

Every variant trains one optimizer step per repetition on the same `--samples` sequences with lengths drawn
uniformly from [min_len, max_len] (loss on the last 3/4 of each, like a completion):
- padded: `AutoModelForCausalLM` + AdamW, micro batches of `--batch` samples padded to their longest
  sample with an attention mask, `labels` = -100 on prompt and padding (the usual HF fine-tuning loop);
- ours: `prime_rl.trainer` as the RL trainer runs it: samples packed first-fit-decreasing into rows of
  `--seq-len` tokens, per-sample causal attention (`packed_attention`), one rank (no FSDP wrapping), AdamW;
- ours-compile: the same with `--compile` (decoder layers compiled; the warm-up step pays the compile).
Each variant lives in its own process (so peak memory is its own) and takes one warm-up step; then the
timed steps interleave, one step of each variant per round, so a machine that slows down mid-run slows
every variant alike. The table shows medians; the speed-up is the median over rounds of the padded step's
time over ours in the same round, which cancels a slow spell that spans a round.
Useful tokens = the samples' real tokens (no padding).
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import add_json_argument, write_json

VARIANTS = {
    "padded": "padded transformers loop",
    "ours": "prime-rl trainer (packed)",
    "ours-compile": "prime-rl trainer (packed, --compile)",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=32, help="samples per optimizer step")
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=2048, help="ours: tokens per packed row")
    p.add_argument("--batch", type=int, default=8, help="padded: samples per micro batch")
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the generated model")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the generated model")
    p.add_argument("--vocab", type=int, default=1024, help="generated model vocabulary (min 1024, its tokenizer)")
    p.add_argument("--reps", type=int, default=3, help="timed steps per variant (median reported)")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    add_json_argument(p, "trainer")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.variant:
        serve_variant(args)
        return
    from prime_rl.utils.tiny_model import create_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        try:
            model = create_tiny_model(
                Path(tmp) / "model", "qwen3", hidden_size=args.hidden, num_layers=args.layers, vocab_size=args.vocab
            )
        except ValueError as e:
            raise SystemExit(f"--vocab: {e}") from None
        children = {v: Child(v, model, sys.argv[1:]) for v in VARIANTS}
        try:
            for child in children.values():  # one at a time: a compile must not overlap another's steps
                print(f"{child.variant}: warm-up step", file=sys.stderr, flush=True)
                child.call("warmup", timeout=900)
            print(f"{args.reps} rounds of one step per variant", file=sys.stderr, flush=True)
            steps = {v: [] for v in VARIANTS}
            for rep in range(args.reps):
                order = list(VARIANTS)[rep % len(VARIANTS) :] + list(VARIANTS)[: rep % len(VARIANTS)]
                for v in order:
                    steps[v].append(children[v].call("step", timeout=600))
            results = {
                v: {**children[v].call("done", timeout=60), "times": [s["time"] for s in steps[v]],
                    "processed": steps[v][-1]["processed"]}
                for v in VARIANTS
            }  # fmt: skip
        finally:
            for child in children.values():
                child.proc.kill()
    print_table(results, args)
    write_json(args, "trainer", {"variants": results})


class Child:
    """One variant's process, driven line by line: each command gets one JSON line back on stdout."""

    def __init__(self, variant: str, model: Path, argv: list[str]):
        cmd = [sys.executable, __file__, *argv, "--variant", variant, "--model", str(model)]
        self.variant = variant
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)  # end of stream: the child exited

    def call(self, command: str, timeout: float) -> dict:
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise SystemExit(f"{self.variant} exited (code {self.proc.wait()}) before {command!r}") from None
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise SystemExit(f"{self.variant}: no answer to {command!r} within {timeout:.0f} s") from None
            if line is None:
                raise SystemExit(f"{self.variant} exited (code {self.proc.wait()}) during {command!r}")
            if line.startswith("{"):  # anything else on stdout is a library's chatter
                return json.loads(line)


def _rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def serve_variant(args: argparse.Namespace) -> None:
    """Child side of `Child`: build, then answer warmup / step / done from stdin."""
    import torch

    from prime_rl.trainer.fake_data import random_samples

    torch.manual_seed(0)
    samples = random_samples(args.samples, args.min_len, args.max_len, 1000, seed=0)
    step = build_padded(args, samples) if args.variant == "padded" else build_ours(args, samples)
    before = _rss_gib()
    for command in sys.stdin:
        command = command.strip()
        if command == "done":
            answer = {"useful": sum(len(s) for s in samples), "peak": _rss_gib(), "before": before}
        else:  # warmup or step
            start = time.perf_counter()
            processed = step()
            answer = {"time": time.perf_counter() - start, "processed": processed}
        print(json.dumps(answer), flush=True)
        if command == "done":
            return


def build_ours(args, samples):
    from prime_rl.configs.trainer import TrainerConfig
    from prime_rl.trainer.fake_data import pack_samples
    from prime_rl.trainer.loading import build_training
    from prime_rl.trainer.parallel import init_distributed
    from prime_rl.trainer.rl.train import train_step

    compile = args.variant == "ours-compile"
    config = TrainerConfig(model={"name": str(args.model)}, device="cpu", optim={"lr": 1e-5}, compile=compile)
    d = init_distributed("cpu")
    model, optimizer, _ = build_training(config, d, max_steps=1)
    rows = pack_samples(samples, args.seq_len, seed=0)

    def step() -> int:
        return train_step(model, optimizer, rows, config, d).num_tokens

    return step


def build_padded(args, samples):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batches = []
    for i in range(0, len(samples), args.batch):
        chunk = samples[i : i + args.batch]
        longest = max(len(s) for s in chunk)
        ids = torch.zeros(len(chunk), longest, dtype=torch.long)
        mask = torch.zeros(len(chunk), longest, dtype=torch.long)
        labels = torch.full((len(chunk), longest), -100, dtype=torch.long)
        for j, s in enumerate(chunk):
            ids[j, : len(s)] = torch.tensor(s)
            mask[j, : len(s)] = 1
            prompt = max(1, len(s) // 4)
            labels[j, prompt : len(s)] = torch.tensor(s[prompt:])
        batches.append((ids, mask, labels))

    def step() -> int:
        for ids, mask, labels in batches:
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss / len(batches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return sum(ids.numel() for ids, _, _ in batches)

    return step


def print_table(results: dict, args) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"trainer step, {args.samples} samples of {args.min_len}-{args.max_len} tokens, "
        f"qwen3 hidden {args.hidden} x {args.layers} layers, vocab {args.vocab}, CPU, median of {args.reps}"
    )
    for col in ("variant", "step (s)", "useful tok/s", "processed tok/step", "peak RSS (GiB)", "RSS growth (GiB)"):
        table.add_column(col, justify="right")
    rates = {}
    for name, label in VARIANTS.items():
        r = results[name]
        t = statistics.median(r["times"])
        rates[name] = r["useful"] / t
        table.add_row(
            label,
            f"{t:.2f}",
            f"{rates[name]:,.0f}",
            f"{r['processed']:,}",
            f"{r['peak']:.2f}",
            f"{r['peak'] - r['before']:.2f}",
        )
    Console(width=140).print(table)
    padded = results["padded"]["times"]
    for name in ("ours", "ours-compile"):
        per_round = statistics.median(p / o for p, o in zip(padded, results[name]["times"], strict=True))
        print(
            f"speed-up of {VARIANTS[name]} over the padded loop (useful tokens/s): {per_round:.2f}x "
            f"(median of per-round ratios; ratio of medians {rates[name] / rates['padded']:.2f}x)"
        )


if __name__ == "__main__":
    main()
