"""`plot`: pictures of one or more runs from their `metrics/*.jsonl` and `eval/summary.jsonl`.

    uv run plot outputs/reverse-text/rl                      # -> outputs/reverse-text/rl/plots/run.{png,svg}
    uv run plot outputs/a outputs/b --out ablation           # runs overlaid, one colour per run

Panels (each skipped when no run has its metric): reward (training, and eval as markers with error bars of one
standard error), completion length, truncated fraction, mismatch KL, teacher KL (distillation), off-policy gap,
step time split (generate, train, hand-off: step - work, `plot_data.handoffs`), tokens/s, and the SFT loss (log
scale, held-out as markers).
A per-step series of 10 or more points is drawn thin under its centred moving average over ~5 % of its steps
(the legend says how many); the reward axis spans at least 0.1; steps are whole numbers. The title names each
run: its W&B name where the orchestrator had one, else its output dir. Data loading: prime_rl.utils.plot_data.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from prime_rl.utils.plot_data import (
    MIN_POINTS_TO_SMOOTH,
    Series,
    eval_rewards,
    handoffs,
    load_run,
    run_name,
    series,
    smooth,
    smoothing_window,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["PANELS", "draw_runs", "eval_rewards", "plot_runs"]

# The reward panel's y-axis spans at least this much (reward units), however close the points are: an eval on
# a few hundred samples has SE ~0.02, so a one-SE change takes a fifth of the height instead of all of it, while
# the whole 0..1 would flatten real gains late in a run (0.90 -> 0.94). When every point lies in [0, 1] the
# widened axis is shifted to stay inside it.
REWARD_MIN_SPAN = 0.1


class Line(NamedTuple):
    label: str
    series_of: Callable[[dict], Series]  # the run's records -> (step, value) pairs
    style: str
    smooth: bool = True  # a noisy per-step series: drawn raw (thin) under its centred moving average


class Panel(NamedTuple):
    lines: list[Line]
    log: bool = False  # log y-axis, where every value drawn is > 0
    min_span: float | None = None  # y-axis at least this wide
    eval: bool = False  # also the run's eval points, with their standard error as bars


PANELS: dict[str, Panel] = {
    "reward": Panel(
        [Line("train", lambda m: series(m["orchestrator"], "reward_mean"), "-")], min_span=REWARD_MIN_SPAN, eval=True
    ),
    "completion length (tokens)": Panel(
        [Line("mean", lambda m: series(m["orchestrator"], "completion_len_mean"), "-")]
    ),
    # A fraction, like a reward: 0.97..1.0 filling the panel would make one truncated sample look like a swing.
    "truncated fraction": Panel(
        [Line("", lambda m: series(m["orchestrator"], "truncated_fraction"), "-")], min_span=0.1
    ),
    "mismatch KL (trainer vs inference)": Panel([Line("", lambda m: series(m["trainer"], "mismatch_kl"), "-")]),
    # On-policy distillation ([orchestrator.teacher]): the student's reverse KL to the teacher on its own samples.
    "teacher KL (student vs teacher)": Panel([Line("", lambda m: series(m["orchestrator"], "teacher_kl"), "-")]),
    # A configured bound, not noise: its steps are drawn as they are.
    "off-policy gap (steps)": Panel([Line("max", lambda m: series(m["orchestrator"], "off_policy_gap"), "-", False)]),
    "step time split (s)": Panel(
        [
            Line("generate", lambda m: series(m["orchestrator"], "time/generate"), "-"),
            Line("train", lambda m: series(m["trainer"], "time/train"), "--"),
            Line("hand-off (step - work)", lambda m: handoffs(m["orchestrator"], m["trainer"]), ":"),
        ]
    ),  # fmt: skip
    "tokens/s": Panel(
        [
            Line("orchestrator", lambda m: series(m["orchestrator"], "tokens_per_s"), "-"),
            Line("trainer", lambda m: series(m["trainer"], "tokens_per_s"), "--"),
        ]
    ),  # fmt: skip
    # Cross-entropy falls by orders of magnitude early and by percents late: only a log axis shows both.
    "SFT loss": Panel(
        [
            Line("train", lambda m: series(m["sft"], "loss"), "-"),
            Line("held-out", lambda m: series(m["sft"], "val/loss"), "--o", False),
        ],
        log=True,
    ),  # fmt: skip
}


def _has_data(panel: Panel, runs: list[dict]) -> bool:
    return any(line.series_of(r) for r in runs for line in panel.lines) or (panel.eval and any(r["eval"] for r in runs))


def _draw_line(ax: Axes, line: Line, data: Series, color: str, label: str) -> list[float]:
    steps, values = (list(x) for x in zip(*data, strict=True))
    window = smoothing_window(len(values)) if line.smooth else 1
    if window == 1:
        marker = {"marker": "."} if len(values) < MIN_POINTS_TO_SMOOTH and "o" not in line.style else {}
        ax.plot(steps, values, line.style, color=color, lw=1.2, ms=5, label=label or None, **marker)  # few: show each
        return values
    ax.plot(steps, values, line.style, color=color, lw=0.8, alpha=0.3)
    smoothed = smooth(values, window)
    note = f"{window}-step moving avg"
    ax.plot(steps, smoothed, line.style, color=color, lw=1.6, zorder=3, label=f"{label} ({note})" if label else note)
    return values


def _draw_eval(ax: Axes, points: list, color: str, prefix: str) -> list[float]:
    """Markers joined by a thin line; error bars of one standard error where the rows have one."""
    with_se = [p for p in points if p.se is not None]
    label = " ".join(x for x in (prefix, "eval ± 1 SE" if with_se else "eval") if x)
    ax.plot([p.step for p in points], [p.mean for p in points], "o-", color=color, lw=0.8, ms=5, mfc="white",
            zorder=4, label=label)  # fmt: skip
    if with_se:
        ax.errorbar([p.step for p in with_se], [p.mean for p in with_se], yerr=[p.se for p in with_se], fmt="none",
                    ecolor=color, elinewidth=1, capsize=3, zorder=4)  # fmt: skip
    return [p.mean + s * (p.se or 0.0) for p in points for s in (-1, 1)]


def _widen(ax: Axes, span: float, values: list[float]) -> None:
    lo, hi = ax.get_ylim()
    if hi - lo < span:
        mid = (lo + hi) / 2
        lo, hi = mid - span / 2, mid + span / 2
    if values and 0.0 <= min(values) and max(values) <= 1.0:
        # Values in [0, 1] (a reward, a fraction): the axis stays inside it, but for a sliver of margin so markers
        # on 0 or 1 show (an all-zero truncated fraction drew from -0.05 otherwise).
        margin = 0.02 * (hi - lo)
        shift = max(0.0, -margin - lo) - max(0.0, hi - 1.0 - margin)
        lo, hi = lo + shift, hi + shift
    ax.set_ylim(lo, hi)


def _plain_log_formatter_class() -> type:
    from matplotlib.ticker import LogFormatter

    class PlainLogFormatter(LogFormatter):
        """Labels the ticks LogFormatter labels, as plain numbers (0.3, 2, 7) rather than 3e-01 or 7x10^0."""

        def __call__(self, x, pos=None):
            return f"{x:g}" if super().__call__(x, pos) else ""

    return PlainLogFormatter


def draw_runs(output_dirs: list[Path]) -> Figure:
    """The figure of the panels that have data for any run (one colour per run)."""
    from matplotlib import rcParams
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    _PlainLogFormatter = _plain_log_formatter_class()  # noqa: N806 (a class, made here: matplotlib loads lazily)

    names = [run_name(Path(d)) for d in output_dirs]
    runs = [load_run(Path(d)) for d in output_dirs]
    if not any(run[k] for run in runs for k in run):
        raise ValueError(f"no metrics under {', '.join(map(str, output_dirs))} (looked for metrics/*.jsonl)")
    panels = [(title, panel) for title, panel in PANELS.items() if _has_data(panel, runs)]
    cols = min(4, len(panels))
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(4.2 * cols, 3.2 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    colors = rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, panel) in zip(axes.flat, panels, strict=False):
        drawn: list[float] = []
        for i, (name, run) in enumerate(zip(names, runs, strict=True)):
            color, prefix = colors[i % len(colors)], name if len(runs) > 1 else ""
            for line in panel.lines:
                if data := line.series_of(run):
                    drawn += _draw_line(ax, line, data, color, " ".join(x for x in (prefix, line.label) if x))
            if panel.eval and run["eval"]:
                drawn += _draw_eval(ax, run["eval"], color, prefix)
        if panel.log and drawn and min(drawn) > 0:
            ax.set_yscale("log")
            # Plain numbers (0.3, 2, 7), not 7x10^0: a loss within one decade has only minor ticks labelled.
            ax.yaxis.set_major_formatter(_PlainLogFormatter(labelOnlyBase=False))
            ax.yaxis.set_minor_formatter(_PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
        if panel.min_span:
            _widen(ax, panel.min_span, drawn)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8, which="both")
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    # Wrapped to the figure's width: several runs' names would run off a one-panel figure.
    fig.suptitle(textwrap.fill(", ".join(names), width=48 * cols), fontsize=11)
    fig.tight_layout()
    return fig


def plot_runs(output_dirs: list[Path], out: Path, formats: tuple[str, ...] = ("png", "svg")) -> list[Path]:
    """Draw the panels that have data for any run; write `out.<format>` for each format; return the paths."""
    fig = draw_runs(output_dirs)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for fmt in formats:
        path = out.with_suffix(f".{fmt}")
        fig.savefig(path, dpi=90)
        written.append(path)
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
