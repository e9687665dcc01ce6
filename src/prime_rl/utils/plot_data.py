"""What `plot` draws, read from a run's output dir: per-step series, eval points with their standard error,
the run's name, and the smoothing drawn over noisy series. No matplotlib here (prime_rl.utils.plot draws)."""

from __future__ import annotations

import json
import math
import os
import tomllib
from pathlib import Path
from typing import NamedTuple

from prime_rl.protocol.paths import eval_dir, eval_summary_file, metrics_file, run_dir
from prime_rl.utils.metrics import read_metrics

Series = list[tuple[int, float]]

# Fewer points than this are drawn raw: a moving average over a handful of steps hides more than it shows.
MIN_POINTS_TO_SMOOTH = 10


class EvalPoint(NamedTuple):
    step: int
    mean: float
    se: float | None  # standard error of `mean`; None where a row lacks samples/reward_std (older files)


def series(records: list[dict], key: str) -> Series:
    return [(r["step"], float(r[key])) for r in records if isinstance(r.get(key), int | float)]


# The timed work of an RL step: the orchestrator's and the trainer's (whose step n-1 made step n's weights).
ORCHESTRATOR_WORK = ("generate", "pack", "write", "update_weights")
# The trainer's broadcast_weights is left out: it runs while the orchestrator's update_weights waits for the
# servers to receive (it is inside that time), and its wait for the servers to ask is a hand-off.
TRAINER_WORK = ("load_data", "train", "save_weights")


def handoffs(orchestrator: list[dict], trainer: list[dict]) -> Series:
    """Hand-off per step n >= 1, the one definition (plot, benchmarks/loop.py, docs/benchmarks.md): the step's wall
    time (between the ends of orchestrator steps n-1 and n) minus the work in it (ORCHESTRATOR_WORK of step n,
    TRAINER_WORK of trainer step n-1): the time no service works because one waits to notice another. Negative
    where the services overlap (async_level >= 1).

        orchestrator ends at t=10 and t=13, generate+pack+write+update = 1.5; trainer load+train+save = 1.0
        -> step 1: 3.0 - 2.5 = 0.5
    """
    orch = {r["step"]: r for r in orchestrator if isinstance(r.get("time"), int | float)}
    done = {r["step"]: r for r in trainer}
    out = []
    for step in sorted(orch):
        if step - 1 not in orch or step - 1 not in done:
            continue
        work = sum(float(orch[step].get(f"time/{k}", 0.0)) for k in ORCHESTRATOR_WORK)
        work += sum(float(done[step - 1].get(f"time/{k}", 0.0)) for k in TRAINER_WORK)
        out.append((step, orch[step]["time"] - orch[step - 1]["time"] - work))
    return out


def _se(row: dict) -> float | None:
    """Standard error of one env's mean reward. reward_std is the population std (pstdev) of `samples` rewards,
    so std/sqrt(n-1) is the sample std over sqrt(n). It treats samples as independent: with several rollouts
    per example they are not, and the uncertainty over examples is somewhat larger."""
    n, std = row.get("samples"), row.get("reward_std")
    if not isinstance(n, int | float) or not isinstance(std, int | float) or n < 2:
        return None
    return float(std) / math.sqrt(n - 1)


def eval_points(output_dir: Path) -> list[EvalPoint]:
    """Eval reward per step with its standard error: the standalone `eval`'s (eval/summary.jsonl) and the evals
    run during training (metrics/eval.jsonl). Several envs at one step are averaged with equal weight (what
    `eval_rewards`, the status line and W&B show); the mean of E independent env means has
    SE = sqrt(sum SE_e^2) / E, and no SE when any env's row lacks one."""
    by_step: dict[int, list[tuple[float, float | None]]] = {}
    paths = [p for p in (eval_summary_file(eval_dir(output_dir)), metrics_file(output_dir, "eval")) if p.is_file()]
    for line in (line for path in paths for line in path.read_text().splitlines()):
        try:
            row = json.loads(line)
            by_step.setdefault(int(row["step"]), []).append((float(row["reward_mean"]), _se(row)))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a crash
    points = []
    for step, envs in sorted(by_step.items()):
        ses = [se for _, se in envs]
        se = None if None in ses else math.sqrt(sum(s * s for s in ses)) / len(envs)
        points.append(EvalPoint(step, sum(m for m, _ in envs) / len(envs), se))
    return points


def eval_rewards(output_dir: Path) -> Series:
    """Mean eval reward per step, averaged over environments (see `eval_points`)."""
    return [(p.step, p.mean) for p in eval_points(output_dir)]


def run_name(output_dir: Path) -> str:
    """The W&B run name the orchestrator was given (run/orchestrator.toml), else the output dir as the user
    would type it: relative to the working directory when under it (`outputs/reverse-text/rl`)."""
    try:
        config = tomllib.loads((run_dir(output_dir) / "orchestrator.toml").read_text())
        if name := (config.get("wandb") or {}).get("name"):
            return str(name)
    except (OSError, tomllib.TOMLDecodeError):
        pass
    path = Path(output_dir).resolve()
    return os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)


def smoothing_window(n: int) -> int:
    """Centred moving-average window for a series of n points: ~5 % of them, odd so it centres; 1 = raw."""
    return 1 if n < MIN_POINTS_TO_SMOOTH else 2 * max(1, round(n * 0.025)) + 1


def smooth(values: list[float], window: int) -> list[float]:
    """Centred moving average; near the ends it averages the points the window holds there (as pandas'
    rolling(center=True, min_periods=1)): a full-size window shrunk to one point at the end would draw that
    step's noise as a final up- or down-turn."""
    half = window // 2
    out = []
    for i in range(len(values)):
        held = values[max(0, i - half) : i + half + 1]
        out.append(sum(held) / len(held))
    return out


def load_run(output_dir: Path) -> dict:
    run = {service: read_metrics(output_dir, service) for service in ("orchestrator", "trainer", "sft")}
    run["eval"] = eval_points(output_dir)
    return run
