"""What the reverse-text example learns (docs/examples/reverse_text.md): its spread over seeds, thread counts and
instruction sets, and RL objectives side by side on it.

    uv run python benchmarks/learning.py reverse-text                       # seeds 0,1,2 x threads 1,2: ~1 h
    uv run python benchmarks/learning.py reverse-text --threads 1 --isa default,avx2 --parallel 2   # 1-thread pairs
    uv run python benchmarks/learning.py reverse-text --report              # the table of every case run so far
    uv run python benchmarks/learning.py objectives                         # SFT once, then rl per objective and seed
    uv run python benchmarks/learning.py objectives --report                # table and plot of the runs already done

`reverse-text`: the reverse-text example over seeds, thread counts and instruction sets.
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

`objectives`: RL objectives side by side on the reverse-text example: aipo against aipo with masked importance
sampling (a token band and a sequence band on the ratio π/μ), same seeds.
SFT runs once (`configs/examples/reverse_text/sft.toml`, seed 0; reused when its weights/final exists, or
`--sft-weights DIR` names the weights of an SFT run already done, e.g. the example's
outputs/reverse-text/sft/weights/final), then
`rl @ configs/examples/reverse_text/rl.toml` from those weights per objective and seed, with
`--orchestrator.seed S --inference.seed S` (the same prompts and sampling streams for both objectives),
one thread per process by default (`--threads`).
Writes the reward, mismatch KL and masked-fraction curves per step (one faint line per seed, the seeds' mean
bold) to docs/examples/reverse_text_objectives.png and prints per run: reward (mean of the first and last 10 % of
steps, orchestrator), mismatch KL and fraction of loss tokens masked (means over the steps, trainer).
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

from common import ROOT, add_json_argument, add_question, mean_ends, question_parser, write_json

from prime_rl.protocol import final_weights_dir
from prime_rl.utils.metrics import read_metrics
from prime_rl.utils.net import free_port

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


def cases_table(rows: list[dict]) -> str:
    head = "| seed | threads | ISA | " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    lines = [head, "|" + " --- |" * (3 + len(COLUMNS))]
    for r in rows:
        cells = [fmt.format(r[k]) for k, _, fmt in COLUMNS]
        lines.append(f"| {r['seed']} | {r['threads']} | {r['isa']} | " + " | ".join(cells) + " |")
    for name, pick in (("median", statistics.median), ("min", min), ("max", max)):
        cells = [fmt.format(pick(r[k] for r in rows)) for k, _, fmt in COLUMNS]
        lines.append(f"| **{name}** | | | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main_reverse_text(args: argparse.Namespace) -> None:
    if args.report:
        rows = [json.loads(p.read_text()) for p in sorted(args.out.glob("*/result.json"))]
        print(cases_table(rows))
        write_json(args, "reverse_text", {"cases": rows})
        return

    cases = [(seed, threads, isa) for isa, seed, threads in itertools.product(
        args.isa.split(","), [int(s) for s in args.seeds.split(",")], [int(t) for t in args.threads.split(",")]
    )]  # fmt: skip
    with ThreadPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(
            lambda c: run_case(args.out, *c, args.sft_args.split(), args.rl_args.split()), cases
        ))  # fmt: skip
    print(cases_table(rows))
    write_json(args, "reverse_text", {"cases": rows})


# ---- objectives -------------------------------------------------------------------------------------------

OBJECTIVES = {  # name → extra rl flags
    "aipo": [],
    "aipo + masked IS": [
        "--trainer.loss.mask.token-low", "0.5", "--trainer.loss.mask.token-high", "2",
        "--trainer.loss.mask.sequence-low", "0.8", "--trainer.loss.mask.sequence-high", "1.25",
    ],
}  # fmt: skip
ENV = dict(os.environ)  # OMP_NUM_THREADS set in main_objectives
PLOT = ROOT / "docs" / "examples" / "reverse_text_objectives.png"


def slug(objective: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in objective).replace("---", "-")


def objective_rl(out: Path, sft: Path, objective: str, seed: int) -> Path:
    rl = out / f"{slug(objective)}-seed{seed}"
    if not (rl / "result.json").exists():
        py = [sys.executable, "-m", "prime_rl.entrypoints.rl"]
        seconds = run(
            [*py, "@", str(CONFIGS / "rl.toml"), "--output-dir", str(rl / "run"), "--model.name", str(sft),
             "--orchestrator.seed", str(seed), "--inference.seed", str(seed),
             "--inference.server.port", str(free_port()), *OBJECTIVES[objective]],
            ENV, out / f"{rl.name}.out", 1800)  # fmt: skip
        (rl / "result.json").write_text(json.dumps({"objective": objective, "seed": seed, "seconds": seconds}))
    return rl


def summarise(rl: Path) -> dict:
    meta = json.loads((rl / "result.json").read_text())
    rewards = [m["reward_mean"] for m in read_metrics(rl / "run", "orchestrator")]
    trainer = read_metrics(rl / "run", "trainer")
    first, last = mean_ends(rewards)
    return meta | {
        "rewards": rewards,
        "mismatch_kls": [m["mismatch_kl"] for m in trainer],
        "masked": [m["is_masked"] for m in trainer],
        "reward_first": first,
        "reward_last": last,
        "mismatch_kl": statistics.mean(m["mismatch_kl"] for m in trainer),
        "is_masked": statistics.mean(m["is_masked"] for m in trainer),
    }


def objectives_table(rows: list[dict]) -> str:
    lines = [
        "| objective | seed | reward first 10 % | reward last 10 % | mismatch KL (mean) | masked (mean) | RL s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['objective']} | {r['seed']} | {r['reward_first']:.3f} | {r['reward_last']:.3f} | "
            f"{r['mismatch_kl']:.4f} | {r['is_masked']:.2%} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines)


PANELS = (  # (series, y label, log axis)
    ("rewards", "training reward\n(mean per step)", False),
    ("mismatch_kls", "mismatch KL\n(trainer, per token)", True),
    ("masked", "loss tokens masked", False),
)


def plot(rows: list[dict], path: Path) -> None:
    """Per panel one faint line per seed and the seeds' mean in bold, per objective."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 7), dpi=120)
    axes = fig.subplots(len(PANELS), 1, sharex=True)
    for ax, (series, label, log) in zip(axes, PANELS, strict=True):
        for color, objective in zip(("tab:blue", "tab:orange"), OBJECTIVES, strict=False):
            runs = [r[series] for r in rows if r["objective"] == objective]
            if not runs:
                continue
            for values in runs:
                ax.plot(range(len(values)), values, color=color, alpha=0.3, linewidth=0.8)
            n = min(map(len, runs))
            mean = [statistics.mean(r[i] for r in runs) for i in range(n)]
            seeds = f"{len(runs)} seed{'s' if len(runs) > 1 else ''}"
            ax.plot(range(n), mean, color=color, linewidth=2, label=f"{objective} (mean of {seeds})")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if log:  # step 0 samples the trained policy itself (~1e-8): below the axis
            ax.set_yscale("log")
            ax.set_ylim(bottom=1e-4)
    axes[0].set_title("reverse-text RL from the same SFT weights: aipo vs masked IS")
    axes[0].legend(loc="lower right")
    axes[-1].yaxis.set_major_formatter(lambda v, _: f"{v:.1%}")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)


def main_objectives(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    ENV.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    cases = [(objective, int(seed)) for seed in args.seeds.split(",") for objective in OBJECTIVES]
    if not args.report:
        sft = args.out / "sft"
        if args.sft_weights is None and not final_weights_dir(sft).exists():
            seconds = run([sys.executable, "-m", "prime_rl.entrypoints.sft", "@", str(CONFIGS / "sft.toml"),
                           "--output-dir", str(sft), "--seed", "0"], ENV, args.out / "sft.out", 3600)  # fmt: skip
            print(f"SFT: {seconds:.0f} s", flush=True)
        for objective, seed in cases:
            objective_rl(args.out, args.sft_weights or final_weights_dir(sft), objective, seed)
            print(f"rl {objective} seed {seed}: done", flush=True)
    done = [args.out / f"{slug(o)}-seed{s}" for o, s in cases]
    rows = [summarise(p) for p in done if (p / "result.json").exists()]
    print(objectives_table(rows))
    plot(rows, args.plot)
    print(f"plot: {args.plot}")
    write_json(args, "objectives", {"runs": rows})


def main() -> None:
    parser, sub = question_parser(__doc__)
    r = add_question(sub, __doc__, "reverse-text", "the example's spread over seeds, threads and instruction sets")
    r.add_argument("--seeds", default="0,1,2")
    r.add_argument("--threads", default="1,2")
    r.add_argument("--isa", default="default", help="comma list of default / avx2 / avx512")
    r.add_argument("--parallel", type=int, default=1, help="cases run at once")
    r.add_argument("--out", type=Path, default=ROOT / "outputs" / "reverse-text-spread")
    r.add_argument("--sft-args", default="", help="extra sft flags (one string)")
    r.add_argument("--rl-args", default="", help="extra rl flags (one string)")
    r.add_argument("--report", action="store_true", help="only print the table of every case in --out")
    add_json_argument(r, "reverse_text")
    o = add_question(sub, __doc__, "objectives", "aipo vs aipo with masked importance sampling, same seeds")
    o.add_argument("--seeds", default="0,1")
    o.add_argument("--out", type=Path, default=ROOT / "outputs" / "objectives")
    o.add_argument("--plot", type=Path, default=PLOT)
    o.add_argument("--sft-weights", type=Path, help="start rl from these SFT weights (no SFT run)")
    o.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS (1: a 2-thread run beside other work spins)")
    o.add_argument("--report", action="store_true", help="only the table and plot of the runs in --out")
    add_json_argument(o, "objectives")
    args = parser.parse_args()
    {"reverse-text": main_reverse_text, "objectives": main_objectives}[args.question](args)


if __name__ == "__main__":
    main()
