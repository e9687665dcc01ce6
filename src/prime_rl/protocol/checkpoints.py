"""Checkpoint cadence, pruning and resume resolution, for the trainer and the orchestrator alike (docs/design.md §2).

`checkpoints/step_n/` holds two parts, each complete on its own:

    trainer/          the trainer's state after n optimizer steps (complete once it holds STABLE)
    orchestrator.json the orchestrator's progress when about to produce step n (written atomically)

Cadence: both parts are due every `interval` steps and at the end of the run (`checkpoint_due`). The
orchestrator's progress is a few KB, so it also records it at every other step: only the newest such record
is kept, and it lets a restarted orchestrator go on exactly where it stopped instead of redoing steps.

Resume: `latest` is the newest complete part of each service, so the trainer may resume at an earlier step
than the orchestrator; the rollouts of the steps in between stay on disk for it (`prune_rollouts`).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from prime_rl.protocol.files import is_stable, prune_steps
from prime_rl.protocol.paths import (
    STABLE,
    checkpoint_dir,
    checkpoints_root,
    list_steps,
    orchestrator_checkpoint_file,
    rollouts_dir,
    trainer_checkpoint_dir,
)

PARTS = ("trainer", "orchestrator")


def checkpoint_due(step: int, max_steps: int, interval: int | None) -> bool:
    """Is a checkpoint at `step` due? At every `interval` steps and at the end: (7 steps, interval 3) -> 3, 6, 7."""
    return step > 0 and (step == max_steps or (interval is not None and step % interval == 0))


class ResumeAtEnd(ValueError):
    """`--ckpt.resume-step` names a checkpoint at or past `max_steps`: the run would train nothing."""


def checkpoint_steps(output_dir: Path, parts: Iterable[str] = PARTS, since: float | None = None) -> list[int]:
    """Steps under checkpoints/ whose requested parts are all complete (trainer: STABLE, orchestrator: file);
    `since` (unix seconds): only those completed since then, i.e. written by the run that started then (a fresh run
    leaves an earlier run's checkpoints where they are)."""
    parts = tuple(parts)
    complete = []
    for step in list_steps(checkpoints_root(output_dir)):
        markers = []
        if "trainer" in parts:
            markers.append(trainer_checkpoint_dir(output_dir, step) / STABLE)
            if not is_stable(trainer_checkpoint_dir(output_dir, step)):
                continue
        if "orchestrator" in parts:
            markers.append(orchestrator_checkpoint_file(output_dir, step))
            if not markers[-1].is_file():
                continue
        if since is not None and any(_mtime(m) < since for m in markers):
            continue
        complete.append(step)
    return complete


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # gone since it was listed
        return 0.0


def check_resume_before_end(resume_step: int | None, max_steps: int, output_dir: Path) -> None:
    """ResumeAtEnd, in one line, when the resumed checkpoint is already at (or past) the run's last step."""
    if resume_step is not None and resume_step >= max_steps:
        raise ResumeAtEnd(
            f"--ckpt.resume-step: {checkpoints_root(output_dir)}/step_{resume_step} is at or past --max-steps "
            f"{max_steps}, so there is nothing to train; raise --max-steps (above {resume_step}) to go on"
        )


def resolve_resume_step(output_dir: Path, resume_step: int | str | None, part: str) -> int | None:
    """The checkpoint step `part` should resume from, or None to start fresh; ValueError if it is missing."""
    if resume_step is None:
        return None
    steps = checkpoint_steps(output_dir, (part,))
    if resume_step == "latest":
        if not steps:
            raise ValueError(f"--ckpt.resume-step latest: no complete {part} checkpoint under {output_dir}/checkpoints")
        return steps[-1]
    if int(resume_step) not in steps:
        raise ValueError(
            f"--ckpt.resume-step {resume_step}: no complete {part} checkpoint at "
            f"{output_dir}/checkpoints/step_{resume_step} (complete: {steps or 'none'})"
        )
    return int(resume_step)


def prune_checkpoints(output_dir: Path, part: str, keep: int | None, max_steps: int, interval: int | None) -> list[int]:
    """Delete `part` of all but the `keep` newest checkpoints, and every off-cadence record but the newest.

    Off-cadence records are the orchestrator's per-step ones: not due at this run's cadence and with no trainer
    checkpoint beside them (one an earlier run saved at its end pairs with the trainer's and stays).
    Only `part` is touched: the other service's part beside it stays, and a step dir goes once it is empty.
    """
    steps = checkpoint_steps(output_dir, (part,))
    paired = set(checkpoint_steps(output_dir, ("trainer",)))
    due = [s for s in steps if s in paired or checkpoint_due(s, max_steps, interval)]
    kept = set(due if keep is None else due[-keep:]) | set(steps[-1:])
    removed = [s for s in steps if s not in kept]
    for step in removed:
        if part == "trainer":
            target = trainer_checkpoint_dir(output_dir, step)
            (target / STABLE).unlink(missing_ok=True)  # never let a reader take a half-deleted dir as complete
            shutil.rmtree(target, ignore_errors=True)
        else:
            orchestrator_checkpoint_file(output_dir, step).unlink(missing_ok=True)
        try:
            checkpoint_dir(output_dir, step).rmdir()
        except OSError:
            pass  # the other part is still there
    return removed


def prune_rollouts(output_dir: Path, read_through: int, keep: int, resumable: bool) -> list[int]:
    """Delete rollout steps the trainer has read (all ranks are past `read_through`), keeping the `keep` newest.

    Never deleted: unread steps and, when the trainer checkpoints (`resumable`), the steps from its newest
    checkpoint on (from step 0 before the first), which a trainer resumed or restarted from there reads again.
    """
    root = rollouts_dir(output_dir)
    start = (checkpoint_steps(output_dir, ("trainer",)) or [0])[-1] if resumable else read_through + 1
    return prune_steps(root, keep=keep, protect=[s for s in list_steps(root) if s > read_through or s >= start])
