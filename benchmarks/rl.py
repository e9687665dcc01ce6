"""The whole RL loop end to end: where a step's time goes, and how much of it is hand-offs between services.

    uv run python benchmarks/rl.py                                   # both models, sync and async_level 1
    uv run python benchmarks/rl.py --models tiny --modes sync --transfers filesystem,broadcast
    uv run python benchmarks/rl.py --models 10m --modes sync --backends builtin,vllm   # vLLM: its CPU build

Each case is one real `rl` run (inference server, orchestrator, 1-rank trainer on this machine's CPU, fp32)
on reverse-text: 8 prompts × 8 samples, ≤ 32 tokens. Per step, from the services' own metrics files:
- generate: the orchestrator's generation requests (and scoring, which overlaps them);
- train: the trainer's forward/backward/optimizer step;
- transfer: filesystem: the trainer writing the weights plus the servers loading them; broadcast: the
  orchestrator's request until the servers answer, the trainer's sending included;
- to served: from the trainer's optimizer step (of step - 1) to the servers answering with its weights,
  everything in between included (wall clocks of one machine);
- work: all of the above plus packing, writing and reading rank files;
- step: wall time between the ends of two orchestrator steps;
- hand-offs: step - work (`prime_rl.utils.plot_data.handoffs`, the plot's hand-off line too). With
  async_level 0 the services alternate, so every instant of a step is one side's work or waiting for the
  other to notice something (bookkeeping outside the timers, such as metrics lines and the orchestrator's
  progress record, counts here too). With async_level 1 they overlap,
  and a negative figure is the overlap.
Medians over the steps after `--warmup`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from prime_rl.utils.metrics import read_metrics  # noqa: E402
from prime_rl.utils.plot_data import ORCHESTRATOR_WORK, TRAINER_WORK, handoffs  # noqa: E402
from prime_rl.utils.tiny_model import create_tiny_model  # noqa: E402

MODELS = {  # name: (hidden, layers); both with the char-level tokenizer reverse-text wants
    "tiny": (128, 4),  # 0.8 M parameters
    "10m": (384, 6),  # 10 M parameters
}


def config_text(
    model: Path, output_dir: Path, steps: int, async_level: int, transfer: str, port: int, backend: str
) -> str:
    return f"""
output_dir = "{output_dir}"
max_steps = {steps}
async_level = {async_level}
weight_transfer = "{transfer}"

[model]
name = "{model}"

[inference]
backend = "{backend}"
enforce_eager = true
server.port = {port}
max_model_len = 256

[orchestrator]
batch_size = 64
rollouts_per_example = 8
seq_len = 256
sampling.max_tokens = 32
sampling.temperature = 1.0
env.id = "reverse-text"

[trainer]
optim.lr = 1e-4
"""


def run_case(model: Path, work: Path, steps: int, async_level: int, transfer: str, port: int, backend: str) -> dict:
    output_dir = work / f"{model.name}-a{async_level}-{transfer}-{backend}"
    cfg = work / f"{output_dir.name}.toml"
    cfg.write_text(config_text(model, output_dir, steps, async_level, transfer, port, backend))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "prime_rl.entrypoints.rl", "@", str(cfg)], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"rl failed for {cfg}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    orch_records, trainer_records = read_metrics(output_dir, "orchestrator"), read_metrics(output_dir, "trainer")
    orch, trainer = {r["step"]: r for r in orch_records}, {r["step"]: r for r in trainer_records}
    handoff = dict(handoffs(orch_records, trainer_records))  # the plot's hand-off line: the same numbers
    rows = []
    for step in range(1, steps):
        o, prev, t = orch[step], orch[step - 1], trainer[step - 1]  # step's weights come from trainer step - 1
        generate = o["time/generate"]
        transfer_s = t.get("time/save_weights", 0.0) + o.get("time/update_weights", 0.0)
        busy = sum(o.get(f"time/{k}", 0.0) for k in ORCHESTRATOR_WORK)
        busy += sum(t.get(f"time/{k}", 0.0) for k in TRAINER_WORK)
        wall = o["time"] - prev["time"]
        # The trainer's optimizer step done → the servers answered with those weights (sync mode: at once).
        w = o["weight_step"]  # the step the servers were given before this step's requests
        latency = o["weights_served_at"] - trainer[w - 1]["optimized_at"] if "weights_served_at" in o and w else None
        rows.append({"generate": generate, "train": t["time/train"], "transfer": transfer_s, "work": busy,
                     "step": wall, "handoffs": handoff[step], "to_served": latency})  # fmt: skip
    return {"rows": rows, "seconds": time.perf_counter() - start}


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows if r[key] is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,10m")
    parser.add_argument("--modes", default="sync,async", help="sync = async_level 0, async = async_level 1")
    parser.add_argument("--transfers", default="filesystem,broadcast")
    parser.add_argument("--backends", default="builtin", help="inference backends: builtin, vllm")
    parser.add_argument("--steps", type=int, default=10, help="measured steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--port", type=int, default=8791)
    parser.add_argument("--json", type=Path, help="also write the per-step rows here")
    args = parser.parse_args()

    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-rl-") as tmp:
        work = Path(tmp)
        for name in args.models.split(","):
            hidden, layers = MODELS[name]
            model = create_tiny_model(work / name, hidden_size=hidden, num_layers=layers, tokenizer_vocab_size=259)
            split = [getattr(args, k).split(",") for k in ("backends", "modes", "transfers")]
            for backend, mode, transfer in itertools.product(*split):
                level = {"sync": 0, "async": 1}[mode]
                case = run_case(model, work, args.steps + args.warmup + 1, level, transfer, args.port, backend)
                rows = case["rows"][args.warmup :]
                results[f"{name}/{backend}/{mode}/{transfer}"] = rows
                print(f"{name:>5} {backend:>7} {mode:>5} {transfer:>10}: {len(rows)} steps measured, "
                      f"run {case['seconds']:.0f}s", file=sys.stderr)  # fmt: skip

    print("| model | backend | mode | transfer | generate | train | transfer | to served | step | hand-offs | share |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for key, rows in results.items():
        name, backend, mode, transfer = key.split("/")
        step, handoffs = median(rows, "step"), median(rows, "handoffs")
        cells = [f"{median(rows, k):.3f} s" for k in ("generate", "train", "transfer", "to_served", "step")]
        print(f"| {name} | {backend} | {mode} | {transfer} | {' | '.join(cells)} | {handoffs:.3f} s | "
              f"{handoffs / step:.1%} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
