"""Starting a run on an output dir: fresh or resumed, what an earlier run left there may stay (docs/design.md §2).

One owner for `rl`, the Slurm submission and the orchestrator. A launcher holds the orchestrator's and the
trainer's locks (`run_locks`) while it prepares the dir, so a live run's files are never touched.
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prime_rl.protocol.files import UnsafeOutputDir, clear_previous_run
from prime_rl.protocol.lock import RunLock
from prime_rl.protocol.paths import (
    STABLE,
    checkpoints_root,
    heartbeat_dir,
    list_steps,
    rollout_step_dir,
    rollouts_dir,
    run_record_file,
    weights_root,
)


def check_ours(output_dir: Path) -> None:
    """Refuse (UnsafeOutputDir) a dir holding `rollouts/`, `weights/` or `checkpoints/` step dirs but no
    `run/versions.json`, the record every command writes first: no prime-rl run wrote them (a user's own
    `weights/step_1`, a mistyped --output-dir), and a fresh run would delete them. Called by the commands whose
    fresh start deletes (`rl`, the orchestrator) before they write that record, and by `prepare_output_dir`. The
    trainer does not check: it reads rollouts written before it starts (by hand, in tests)."""
    if run_record_file(output_dir).is_file():
        return
    found = [f"{parent.name}/step_{s}" for parent in (rollouts_dir(output_dir), weights_root(output_dir),
             checkpoints_root(output_dir)) for s in list_steps(parent)]  # fmt: skip
    if found:
        more = f" and {len(found) - 3} more" if len(found) > 3 else ""
        raise UnsafeOutputDir(
            f"{Path(output_dir).resolve()} holds {', '.join(found[:3])}{more} but no run/versions.json: "
            "no prime-rl run wrote them, and a run there would delete them; move them or choose another output_dir"
        )


def prepare_output_dir(output_dir: Path, resume_step: int | None, *, launcher: bool = False) -> str:
    """Make `output_dir` ready for a run that starts at `resume_step` (None: fresh); say what went, or "".

    `launcher`: called before any service of the run started (`rl`, a Slurm job), so the heartbeats an earlier
    run left go too; a service must keep them: a peer of its run may be beating there already (and a beat of
    an earlier run never counts against this one: `liveness.Beat.of_this_run`).

    Fresh: the rollouts and weights an earlier run left go (checkpoints stay): served or trained on, they
    would pass for this run's. Resumed at the orchestrator's checkpoint step n: the rollouts of steps >= n go,
    since the interrupted run may have written some the resumed one redoes; earlier ones stay for a trainer
    that resumes at an earlier step, and so do the weights (the inference server may be serving them).
    """
    check_ours(output_dir)
    if launcher:
        for beat in heartbeat_dir(output_dir).glob("*.json"):
            beat.unlink(missing_ok=True)
    if resume_step is None:
        return clear_previous_run(output_dir)
    dropped = [step for step in list_steps(rollouts_dir(output_dir)) if step >= resume_step]
    for step in dropped:
        target = rollout_step_dir(output_dir, step)
        # The marker first: a trainer reading beside us never takes a half-deleted step as complete.
        (target / STABLE).unlink(missing_ok=True)
        shutil.rmtree(target, ignore_errors=True)
    if not dropped:
        return ""
    return f"resuming at step {resume_step}: removed rollouts/step_{dropped[0]}..{dropped[-1]} of the interrupted run"


@contextmanager
def run_locks(output_dir: Path) -> Iterator[str]:
    """Hold the orchestrator's and the trainer's locks on `output_dir` (RunLocked while a live run has either),
    as a launcher does for both services; yields the token its children join them with (`lock.TOKEN_VAR`)."""
    token = secrets.token_hex(8)
    with RunLock(output_dir, "orchestrator", token), RunLock(output_dir, "trainer", token):
        yield token
