"""The reverse-text example (docs/examples/reverse_text.md) over seeds, thread counts and instruction sets.

    uv run python benchmarks/reverse_text.py                                  # seeds 0,1,2 x threads 1,2
    uv run python benchmarks/reverse_text.py --threads 1 --isa default,avx2 --parallel 2   # 1-thread cases in pairs
    uv run python benchmarks/reverse_text.py --report                         # the table of every case run so far

Each case runs the example's three commands as the doc gives them (`sft`, `rl`, `eval` with the configs of
`configs/examples/reverse_text/`), with `--seed S` for SFT's data order, `--orchestrator.seed S` and
`--inference.seed S` for RL's prompts and sampling, under `OMP_NUM_THREADS=T` and, for an instruction set
other than `default`, `ATEN_CPU_CAPABILITY` (PyTorch's CPU kernels for avx2 / avx512 / default). The eval is
the doc's: 512 held-out prompts (seed 1234) at temperature 1, SFT's weights vs RL's last step.

Per case: SFT steps run (it stops early on its held-out loss) and its last held-out and training loss, the
RL training reward (mean of the first → last 10 % of steps), the eval reward after SFT → after RL and
the gain; then the median and range of each over all cases. `--parallel N` runs N cases at once
(numerics depend on the thread count, not on what else runs; only wall times do). Pair only 1-thread cases:
a 2-thread case beside other work spins its OpenMP threads on a shared core (an SFT step went from 0.26 s
to 20-46 s).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import add_json_argument, mean_ends, write_json

from prime_rl.protocol import final_weights_dir
from prime_rl.utils.metrics import read_metrics
from prime_rl.utils.net import free_port

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = ROOT / "configs" / "examples" / "reverse_text"


def run(cmd: list[str], env: dict, log: Path, timeout: float) -> float:
    start = time.perf_counter()
    with log.open("w") as f:
        result = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[2:5])} exited {result.returncode}; see {log}")
    return time.perf_counter() - start


def run_case(out: Path, seed: int, threads: int, isa: str, sft_args: list[str], rl_args: list[str]) -> dict:
    case = out / f"seed{seed}-t{threads}-{isa}"
    sft, rl, ev = case / "sft", case / "rl", case / "eval"
    case.mkdir(parents=True, exist_ok=True)
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if isa != "default":
        env["ATEN_CPU_CAPABILITY"] = isa
    py = [sys.executable, "-m"]
    times = {"sft": float("nan")}
    final = final_weights_dir(sft)
    if not final.exists():  # a finished SFT phase is reused (re-run with other --rl-args)
        times["sft"] = run(
            [*py, "prime_rl.entrypoints.sft", "@", str(CONFIGS / "sft.toml"), "--output-dir", str(sft),
             "--seed", str(seed), *sft_args], env, case / "sft.out", 3600)  # fmt: skip
    times["rl"] = run(
        [*py, "prime_rl.entrypoints.rl", "@", str(CONFIGS / "rl.toml"), "--output-dir", str(rl),
         "--model.name", str(final),
         "--orchestrator.seed", str(seed), "--inference.seed", str(seed), "--inference.server.port", str(free_port()),
         *rl_args], env, case / "rl.out", 1800)  # fmt: skip
    rl_steps = len(read_metrics(rl, "orchestrator"))
    times["eval"] = run(
        [*py, "prime_rl.entrypoints.eval", "@", str(CONFIGS / "eval.toml"), "--output-dir", str(ev), "--model.name",
         str(final), "--weights-dir", str(rl / "weights"), "--steps", f"0,{rl_steps}"],
        env, case / "eval.out", 900)  # fmt: skip

    sft_metrics = read_metrics(sft, "sft")
    val = [m["val/loss"] for m in sft_metrics if "val/loss" in m]
    rewards = [m["reward_mean"] for m in read_metrics(rl, "orchestrator")]
    summary = {r["step"]: r["reward_mean"] for r in map(json.loads, (ev / "eval" / "summary.jsonl").open())}
    first, last = mean_ends(rewards)
    result = {
        "seed": seed, "threads": threads, "isa": isa,
        "sft_steps": len(sft_metrics),
        "sft_val_loss": val[-1] if val else float("nan"),
        "sft_train_loss": statistics.mean(m["loss"] for m in sft_metrics[-10:]),
        "rl_reward_first": first, "rl_reward_last": last,
        "eval_sft": summary[0], "eval_rl": summary[rl_steps], "eval_gain": summary[rl_steps] - summary[0],
        **{f"time_{k}_s": v for k, v in times.items()},
    }  # fmt: skip
    (case / "result.json").write_text(json.dumps(result))
    return result


COLUMNS = [  # (key, header, format)
    ("sft_steps", "SFT steps", "{:.0f}"),
    ("sft_val_loss", "SFT held-out loss", "{:.3f}"),
    ("sft_train_loss", "SFT train loss (last 10 steps)", "{:.3f}"),
    ("rl_reward_first", "RL reward first 10 %", "{:.3f}"),
    ("rl_reward_last", "RL reward last 10 %", "{:.3f}"),
    ("eval_sft", "eval after SFT", "{:.3f}"),
    ("eval_rl", "eval after RL", "{:.3f}"),
    ("eval_gain", "eval gain", "{:+.3f}"),
    ("time_sft_s", "SFT s", "{:.0f}"),
    ("time_rl_s", "RL s", "{:.0f}"),
]


def table(rows: list[dict]) -> str:
    head = "| seed | threads | ISA | " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    lines = [head, "|" + " --- |" * (3 + len(COLUMNS))]
    for r in rows:
        cells = [fmt.format(r[k]) for k, _, fmt in COLUMNS]
        lines.append(f"| {r['seed']} | {r['threads']} | {r['isa']} | " + " | ".join(cells) + " |")
    for name, pick in (("median", statistics.median), ("min", min), ("max", max)):
        cells = [fmt.format(pick(r[k] for r in rows)) for k, _, fmt in COLUMNS]
        lines.append(f"| **{name}** | | | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--isa", default="default", help="comma list of default / avx2 / avx512")
    parser.add_argument("--parallel", type=int, default=1, help="cases run at once")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "reverse-text-spread")
    parser.add_argument("--sft-args", default="", help="extra sft flags (one string)")
    parser.add_argument("--rl-args", default="", help="extra rl flags (one string)")
    parser.add_argument("--report", action="store_true", help="only print the table of every case in --out")
    add_json_argument(parser, "reverse_text")
    args = parser.parse_args()
    if args.report:
        rows = [json.loads(p.read_text()) for p in sorted(args.out.glob("*/result.json"))]
        print(table(rows))
        write_json(args, "reverse_text", {"cases": rows})
        return

    cases = [(seed, threads, isa) for isa, seed, threads in itertools.product(
        args.isa.split(","), [int(s) for s in args.seeds.split(",")], [int(t) for t in args.threads.split(",")]
    )]  # fmt: skip
    with ThreadPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(
            lambda c: run_case(args.out, *c, args.sft_args.split(), args.rl_args.split()), cases
        ))  # fmt: skip
    print(table(rows))
    write_json(args, "reverse_text", {"cases": rows})


if __name__ == "__main__":
    main()
