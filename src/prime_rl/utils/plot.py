"""`plot`: pictures of one or more runs from their `metrics/*.jsonl` and `eval/summary.jsonl`.

    uv run plot outputs/reverse-text/rl                      # -> outputs/reverse-text/rl/plots/run.{png,svg}
    uv run plot outputs/a outputs/b --out ablation           # runs overlaid, one colour per run

Panels (each skipped when no run has its metric): reward (training, and eval as dashed markers), completion
length, truncated fraction, mismatch KL, off-policy gap, step time split (generate, train, hand-off: the
waits for weights and rollouts), tokens/s, and the SFT loss.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from prime_rl.protocol.paths import eval_summary_file, metrics_file
from prime_rl.utils.metrics import read_metrics

Series = list[tuple[int, float]]


def _series(records: list[dict], key: str) -> Series:
    return [(r["step"], float(r[key])) for r in records if isinstance(r.get(key), int | float)]


def eval_rewards(output_dir: Path) -> Series:
    """Mean eval reward per step, averaged over environments: the standalone `eval`'s (eval/summary.jsonl)
    and the evals run during training (metrics/eval.jsonl)."""
    by_step: dict[int, list[float]] = {}
    paths = [p for p in (eval_summary_file(output_dir), metrics_file(output_dir, "eval")) if p.is_file()]
    for line in (line for path in paths for line in path.read_text().splitlines()):
        try:
            row = json.loads(line)
            by_step.setdefault(int(row["step"]), []).append(float(row["reward_mean"]))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a crash
    return sorted((step, sum(v) / len(v)) for step, v in by_step.items())


# Panel title -> for each line drawn: (label, function of the run dir's records -> series, style)
Panel = list[tuple[str, Callable[[dict], Series], str]]
PANELS: dict[str, Panel] = {
    "reward": [
        ("train", lambda m: _series(m["orchestrator"], "reward_mean"), "-"),
        ("eval", lambda m: m["eval"], "--o"),
    ],
    "completion length (tokens)": [("mean", lambda m: _series(m["orchestrator"], "completion_len_mean"), "-")],
    "truncated fraction": [("", lambda m: _series(m["orchestrator"], "truncated_fraction"), "-")],
    "mismatch KL (trainer vs inference)": [("", lambda m: _series(m["trainer"], "mismatch_kl"), "-")],
    "off-policy gap (steps)": [("max", lambda m: _series(m["orchestrator"], "off_policy_gap"), "-")],
    "step time split (s)": [
        ("generate", lambda m: _series(m["orchestrator"], "time/generate"), "-"),
        ("train", lambda m: _series(m["trainer"], "time/train"), "--"),
        ("hand-off", lambda m: _handoff(m), ":"),
    ],
    "tokens/s": [
        ("orchestrator", lambda m: _series(m["orchestrator"], "tokens_per_s"), "-"),
        ("trainer", lambda m: _series(m["trainer"], "tokens_per_s"), "--"),
    ],
    "SFT loss": [
        ("train", lambda m: _series(m["sft"], "loss"), "-"),
        ("held-out", lambda m: _series(m["sft"], "val/loss"), "--"),
    ],
}


def _handoff(m: dict) -> Series:
    """Per step: the waits of both sides plus the weight transfer (trainer save, servers load)."""
    total: dict[int, float] = {}
    for service, key in (("orchestrator", "time/wait_weights"), ("trainer", "time/wait"),
                         ("trainer", "time/save_weights"), ("orchestrator", "time/update_weights")):  # fmt: skip
        for step, value in _series(m[service], key):
            total[step] = total.get(step, 0.0) + value
    return sorted(total.items())


def load_run(output_dir: Path) -> dict:
    run = {service: read_metrics(output_dir, service) for service in ("orchestrator", "trainer", "sft")}
    run["eval"] = eval_rewards(output_dir)
    return run


def plot_runs(output_dirs: list[Path], out: Path, formats: tuple[str, ...] = ("png", "svg")) -> list[Path]:
    """Draw the panels that have data for any run; write `out.<format>` for each format; return the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {str(d): load_run(Path(d)) for d in output_dirs}
    if not any(run[k] for run in runs.values() for k in run):
        raise ValueError(f"no metrics under {', '.join(map(str, output_dirs))} (looked for metrics/*.jsonl)")
    drawn = lambda lines: any(f(r) for r in runs.values() for _, f, _ in lines)  # noqa: E731
    panels = [(title, lines) for title, lines in PANELS.items() if drawn(lines)]
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, lines) in zip(axes.flat, panels, strict=False):
        for i, (name, run) in enumerate(runs.items()):
            for label, series_of, style in lines:
                series = series_of(run)
                if series:
                    steps, values = zip(*series, strict=True)
                    legend = " ".join(x for x in (Path(name).name if len(runs) > 1 else "", label) if x)
                    ax.plot(steps, values, style, color=colors[i % len(colors)], label=legend or None, markersize=3)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    # Wrapped to the figure's width: several runs' names would run off a one-panel figure.
    names = ", ".join(Path(d).name for d in output_dirs)
    fig.suptitle(textwrap.fill(names, width=48 * cols), fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for fmt in formats:
        path = out.with_suffix(f".{fmt}")
        fig.savefig(path, dpi=90)
        written.append(path)
    plt.close(fig)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(prog="plot", description=__doc__.split("\n")[0])
    parser.add_argument("output_dirs", nargs="+", type=Path, help="run output dirs (several are overlaid)")
    parser.add_argument("--out", type=Path, help="file name without suffix (default: FIRST_DIR/plots/run)")
    parser.add_argument("--formats", default="png,svg", help="comma-separated: png, svg, pdf")
    args = parser.parse_args()
    missing = [str(d) for d in args.output_dirs if not d.is_dir()]
    if missing:
        sys.exit(f"plot: no such directory: {', '.join(missing)}")
    out = args.out or args.output_dirs[0] / "plots" / "run"
    try:
        for path in plot_runs(args.output_dirs, out, tuple(args.formats.split(","))):
            print(path)
    except ValueError as e:
        sys.exit(f"plot: {e}")


if __name__ == "__main__":
    main()
