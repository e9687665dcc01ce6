"""The trainer: how fast its packed step runs against a padded `transformers` loop, and what each rank holds in
host memory, and for how long, to load a real-size model.

    uv run python benchmarks/trainer.py step                      # defaults: ~1 min on a 2-core CPU
    uv run python benchmarks/trainer.py step --samples 64 --reps 5 --hidden 512
    uv run python benchmarks/trainer.py load                      # Qwen3-0.6B's shape: ~5 min on a 2-core CPU
    uv run python benchmarks/trainer.py load --ranks 2 --layers 4 # quicker

`step`: trainer throughput, our packed FSDP2 step vs a plain padded `transformers` loop, on the same samples.
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

`load`: trainer start-up, what each rank holds in host memory, and how long it takes, to load a real-size model,
whole on every rank then sharded (`model.build_model` + FSDP2) against each rank reading only its shards
(`loading.build_sharded`), at 1, 2 and 4 ranks.
The model is `tiny-model --preset` (random bf16 weights of the real shape, built once into --model-dir).
Each (mode, ranks) runs `torchrun --standalone` on the CPU (gloo); every rank reports its resident memory
after the imports (the floor), its peak (`ru_maxrss`) after the model is loaded and parallelized, and the
seconds between the two. The load's own cost is peak - floor. Modes alternate per rank count.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import (
    add_json_argument,
    add_question,
    markdown_table,
    median,
    preset_model,
    print_line,
    question_parser,
    write_json,
)

from prime_rl.utils.memory import peak_rss_gib

VARIANTS = {
    "padded": "padded transformers loop",
    "ours": "prime-rl trainer (packed)",
    "ours-compile": "prime-rl trainer (packed, --compile)",
}
MODES = ("whole", "sharded")


def main_step(args: argparse.Namespace) -> None:
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


def serve_variant(args: argparse.Namespace) -> None:
    """Child side of `Child`: build, then answer warmup / step / done from stdin."""
    import torch

    from prime_rl.trainer.fake_data import random_samples

    torch.manual_seed(0)
    samples = random_samples(args.samples, args.min_len, args.max_len, 1000, seed=0)
    step = build_padded(args, samples) if args.variant == "padded" else build_ours(args, samples)
    before = peak_rss_gib()
    for command in sys.stdin:
        command = command.strip()
        if command == "done":
            answer = {"useful": sum(len(s) for s in samples), "peak": peak_rss_gib(), "before": before}
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
    from prime_rl.trainer.micro_batch import MicroBatch
    from prime_rl.trainer.parallel import init_distributed
    from prime_rl.trainer.rl.train import train_step

    compile = args.variant == "ours-compile"
    config = TrainerConfig(model={"name": str(args.model)}, device="cpu", optim={"lr": 1e-5}, compile=compile)
    d = init_distributed("cpu")
    model, optimizer, _ = build_training(config, d, max_steps=1)
    rows = [MicroBatch.from_row(row) for row in pack_samples(samples, args.seq_len, seed=0)]

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


# ---- load -------------------------------------------------------------------------------------------------


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def load_worker(mode: str, model: Path) -> None:
    """One rank under torchrun: load `model` as `mode` does and print one JSON line."""
    from prime_rl.configs import parse_config
    from prime_rl.configs.trainer import TrainerConfig
    from prime_rl.trainer.loading import build_sharded
    from prime_rl.trainer.model import build_model
    from prime_rl.trainer.parallel import close_distributed, init_distributed, parallelize

    config = parse_config(TrainerConfig, ["--model.name", str(model), "--output-dir", tempfile.mkdtemp()], prog="b")
    world = init_distributed("cpu")
    floor = rss_kib()
    start = time.perf_counter()
    if mode == "sharded":
        built = build_sharded(config, world)
        assert built is not None, "this checkpoint cannot be loaded sharded"
    else:
        built = build_model(str(model))
        parallelize(built, world, config)
    seconds = time.perf_counter() - start
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in built.parameters())
    peak = peak_rss_gib()
    print_line({"rank": world.rank, "floor_gib": floor / 2**20, "peak_gib": peak, "seconds": seconds,
                "local_params": local})  # fmt: skip
    close_distributed()


def load_run(mode: str, ranks: int, model: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           __file__, "load", "--worker", mode, "--model-dir", str(model)]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{mode} on {ranks} rank(s) failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return sorted(rows, key=lambda r: r["rank"])


def main_load(args: argparse.Namespace) -> None:
    if args.worker:
        return load_worker(args.worker, args.model_dir)
    model = preset_model(args.model_dir or Path(tempfile.mkdtemp()) / args.preset, args.preset, args.layers)
    header = ["mode", "ranks", "peak host GiB (max rank)", "load's own GiB (peak - floor)", "load s (median rank)",
              "rank 0's parameters"]  # fmt: skip
    results, rows = {}, []
    for ranks in args.ranks:
        for mode in MODES:
            per_rank = results[f"{mode}/{ranks}"] = load_run(mode, ranks, model)
            peak = max(r["peak_gib"] for r in per_rank)
            own = max(r["peak_gib"] - r["floor_gib"] for r in per_rank)
            seconds = median(r["seconds"] for r in per_rank)
            local = per_rank[0]["local_params"]
            rows.append([mode, ranks, f"{peak:.2f}", f"{own:.2f}", f"{seconds:.1f}", f"{local:,}"])
            print(markdown_table(header, rows[-1:]), flush=True)
    print(markdown_table(header, rows))
    write_json(args, "loading", {"model": str(model), "runs": results})


def main() -> None:
    parser, sub = question_parser(__doc__)
    p = add_question(sub, __doc__, "step", "the packed trainer step vs a padded transformers loop: tokens/s, memory")
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
    p = add_question(
        sub, __doc__, "load", "each rank's host memory and seconds to load a real-size model, whole vs sharded"
    )
    p.add_argument("--preset", default="qwen3-0.6b", help="tiny-model preset (a real model's shape)")
    p.add_argument("--layers", type=int, help="cut the preset to this many layers (default: all)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--model-dir", type=Path, help="where the model is built (default: a temporary dir)")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    add_json_argument(p, "loading")
    args = parser.parse_args()
    {"step": main_step, "load": main_load}[args.question](args)


if __name__ == "__main__":
    main()
