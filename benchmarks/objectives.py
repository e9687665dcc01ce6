"""RL objectives side by side on the reverse-text example (docs/examples/reverse_text.md): aipo against aipo with
masked importance sampling (a token band and a sequence band on the ratio π/μ), same seeds.

    uv run python benchmarks/objectives.py                      # SFT once, then rl per objective and seed
    uv run python benchmarks/objectives.py --report             # table and plot of the runs already done

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
import json
import os
import statistics
import sys
from pathlib import Path

from common import add_json_argument, mean_ends, write_json
from reverse_text import run  # benchmarks/ is this script's sys.path[0]

from prime_rl.protocol import final_weights_dir
from prime_rl.utils.metrics import read_metrics
from prime_rl.utils.net import free_port

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = ROOT / "configs" / "examples" / "reverse_text"
OBJECTIVES = {  # name → extra rl flags
    "aipo": [],
    "aipo + masked IS": [
        "--trainer.loss.mask.token-low", "0.5", "--trainer.loss.mask.token-high", "2",
        "--trainer.loss.mask.sequence-low", "0.8", "--trainer.loss.mask.sequence-high", "1.25",
    ],
}  # fmt: skip
ENV = dict(os.environ)  # OMP_NUM_THREADS set in main
PLOT = ROOT / "docs" / "examples" / "reverse_text_objectives.png"


def slug(objective: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in objective).replace("---", "-")


def run_rl(out: Path, sft: Path, objective: str, seed: int) -> Path:
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


def table(rows: list[dict]) -> str:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "objectives")
    parser.add_argument("--plot", type=Path, default=PLOT)
    parser.add_argument("--sft-weights", type=Path, help="start rl from these SFT weights (no SFT run)")
    parser.add_argument(
        "--threads", type=int, default=1, help="OMP_NUM_THREADS (1: a 2-thread run beside other work spins)"
    )
    parser.add_argument("--report", action="store_true", help="only the table and plot of the runs in --out")
    add_json_argument(parser, "objectives")
    args = parser.parse_args()
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
            run_rl(args.out, args.sft_weights or final_weights_dir(sft), objective, seed)
            print(f"rl {objective} seed {seed}: done", flush=True)
    done = [args.out / f"{slug(o)}-seed{s}" for o, s in cases]
    rows = [summarise(p) for p in done if (p / "result.json").exists()]
    print(table(rows))
    plot(rows, args.plot)
    print(f"plot: {args.plot}")
    write_json(args, "objectives", {"runs": rows})


if __name__ == "__main__":
    main()
