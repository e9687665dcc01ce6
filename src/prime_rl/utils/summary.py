"""The end-of-run summary of `rl` and `sft`: what happened and where everything is, in a few aligned lines.

Read from the run's files (metrics/*.jsonl, eval/summary.jsonl, weights/, checkpoints/), so that its numbers
are the ones the plots show; of checkpoints/, only this run's (`ThisRun`):

    run summary
      wall time    1m12s
      steps        5/5
      reward       0.031 -> 0.094 (mean of the first 1 and the last 1 of 5 steps)
      best eval    0.120 at step 4
      weights      outputs/debug/weights/step_5
      checkpoints  no checkpoints (add --ckpt)
      plots        outputs/debug/plots/run.png, outputs/debug/plots/run.svg (uv run plot DIR [DIR ...] to ...)
      resume       not possible without checkpoints: add --ckpt (or --ckpt.interval N) to the command
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from prime_rl.protocol import checkpoint_steps, final_weights_dir, stable_steps, weights_dir, weights_root
from prime_rl.utils.console import duration
from prime_rl.utils.metrics import read_metrics

RESUME_FLAG = "--ckpt.resume-step"


def first_last(values: list[float]) -> tuple[float, float, int]:
    """The means of the first and of the last ~10% of `values` (at least one each), and how many each is of."""
    n = max(1, round(len(values) / 10))
    return sum(values[:n]) / n, sum(values[-n:]) / n, n


def trend(name: str, values: list[float]) -> str:
    first, last, n = first_last(values)
    return f"{first:.3f} -> {last:.3f} (mean {name} of the first {n} and the last {n} of {len(values)} steps)"


def resume_command(program: str, argv: list[str], step: str = "latest") -> str:
    """`uv run <program> <the user's arguments> --ckpt.resume-step latest` (an earlier resume step dropped)."""
    args, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == RESUME_FLAG:
            skip = True
        elif not arg.startswith(RESUME_FLAG + "="):
            args.append(arg)
    return shlex.join(["uv", "run", program, *args, RESUME_FLAG, step])


@dataclass(frozen=True)
class ThisRun:
    """Which records are this run's: those written since `started` (unix seconds), and the checkpoint it resumed
    from (None: a fresh start). An earlier run's checkpoints stay in a re-used output dir; they are not this run's
    to report or to advise resuming from."""

    started: float | None = None
    resumed_from: int | None = None


def _where(
    output_dir: Path, program: str, argv: list[str], parts: tuple[str, ...], plots: list[Path], run: ThisRun
) -> list[tuple[str, str]]:
    """The checkpoints, plots and resume rows."""
    complete = checkpoint_steps(output_dir, parts)
    ours = checkpoint_steps(output_dir, parts, since=run.started)
    if run.resumed_from in complete:
        ours = sorted({*ours, run.resumed_from})
    compare = "(uv run plot DIR [DIR ...] to compare runs)"
    plotted = ("plots", f"{', '.join(map(str, plots))} {compare}" if plots else "none")
    if not ours:
        newest = output_dir / "checkpoints" / f"step_{complete[-1]}" if complete else None
        earlier = f"none of this run (add --ckpt); {newest} is an earlier run's"
        return [
            ("checkpoints", earlier if newest else "no checkpoints (add --ckpt)"),
            plotted,
            ("resume", "not possible without checkpoints: add --ckpt (or --ckpt.interval N) to the command"),
        ]
    # `latest` is the newest complete checkpoint in the dir: name the step where an earlier run's is newer.
    step = "latest" if ours[-1] == complete[-1] else str(ours[-1])
    return [
        ("checkpoints", f"{output_dir / 'checkpoints' / f'step_{ours[-1]}'} (newest of this run's {len(ours)})"),
        plotted,
        ("resume", resume_command(program, argv, step) + "  (raise --max-steps to train further)"),
    ]


def _lines(rows: list[tuple[str, str]]) -> list[str]:
    width = max(len(k) for k, _ in rows)
    return ["run summary", *(f"  {k.ljust(width)}  {v}" for k, v in rows)]


def rl_summary(
    output_dir: Path, max_steps: int, wall: float, argv: list[str], plots: list[Path], run: ThisRun = ThisRun()
) -> list[str]:
    """The lines `rl` logs at the end of a finished run; `argv`: the user's arguments (sys.argv[1:])."""
    from prime_rl.utils.plot_data import eval_rewards

    trainer, orchestrator = read_metrics(output_dir, "trainer"), read_metrics(output_dir, "orchestrator")
    done = max((r["step"] for r in trainer), default=-1) + 1
    rows = [("wall time", duration(wall)), ("steps", f"{done}/{max_steps}")]
    rewards = [float(r["reward_mean"]) for r in orchestrator if isinstance(r.get("reward_mean"), int | float)]
    if rewards:
        rows.append(("reward", trend("reward", rewards)))
    if evals := eval_rewards(output_dir):
        step, reward = max(evals, key=lambda e: (e[1], e[0]))
        rows.append(("best eval", f"{reward:.3f} at step {step} (mean reward over the eval environments)"))
    kept = stable_steps(weights_root(output_dir))
    rows.append(("weights", str(weights_dir(output_dir, kept[-1])) if kept else "none written"))
    rows += _where(output_dir, "rl", argv, ("trainer", "orchestrator"), plots, run)
    return _lines(rows)


def sft_summary(
    output_dir: Path,
    max_steps: int,
    wall: float,
    argv: list[str],
    plots: list[Path],
    stopped: str | None = None,
    run: ThisRun = ThisRun(),
) -> list[str]:
    """The lines `sft` logs at the end of a finished run (`stopped`: why it ended before max_steps)."""
    records = read_metrics(output_dir, "sft")
    done = max((r["step"] for r in records), default=-1) + 1
    rows = [("wall time", duration(wall)), ("steps", f"{done}/{max_steps}" + (f" ({stopped})" if stopped else ""))]
    losses = [float(r["loss"]) for r in records if isinstance(r.get("loss"), int | float)]
    if losses:
        rows.append(("loss", trend("loss", losses)))
    held_out = [(r["step"] + 1, float(r["val/loss"])) for r in records if isinstance(r.get("val/loss"), int | float)]
    if held_out:
        steps, loss = min(held_out, key=lambda v: (v[1], v[0]))
        rows.append(("held-out loss", f"best {loss:.4g} after {steps} steps, last {held_out[-1][1]:.4g}"))
    final = final_weights_dir(output_dir)
    rows.append(("weights", f"{final} (-> {final.resolve().name})" if final.exists() else "none written"))
    rows += _where(output_dir, "sft", argv, ("trainer",), plots, run)
    return _lines(rows)
