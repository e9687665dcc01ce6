"""Orchestrator checkpoints: `checkpoints/step_n/orchestrator.json`, in step with the trainer's (docs/design.md §2).

The file holds the progress when the orchestrator is about to produce rollouts for step n: the step,
running totals, the data position (how many examples it has drawn from each environment's stream, and
how many groups the mix has assigned) and the state of its RNG. Resuming rebuilds each stream from the
same seed and skips the examples already drawn, so step n continues with exactly the examples an
uninterrupted run would have used (in continuous mode, examples that were in flight are not redone).
Written at every step when checkpointing is on (it is a few KB of JSON: the orchestrator needs no torch);
`protocol.checkpoints` says which are kept.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prime_rl.configs import CkptConfig
from prime_rl.protocol import (
    atomic_write_text,
    checkpoints_root,
    orchestrator_checkpoint_file,
    prune_checkpoints,
    resolve_resume_step,
)

logger = logging.getLogger("prime_rl")
VERSION = 2  # 1: orchestrator.pt (torch.save)


class CheckpointError(ValueError):
    """The checkpoint to resume from is missing or unreadable; the message names it."""


@dataclass
class Progress:
    step: int = 0
    examples_drawn: int = 0  # data position in the environment's example stream (all envs together)
    env_drawn: dict[str, int] = field(default_factory=dict)  # ... and per environment name
    env_picks: int = 0  # groups assigned to environments so far (the mixing rotation's position)
    total_samples: int = 0
    total_tokens: int = 0
    rng_state: tuple | None = None
    extra: dict = field(default_factory=dict)


def save_checkpoint(output_dir: Path, progress: Progress, ckpt: CkptConfig, max_steps: int) -> Path:
    record = {"version": VERSION, **asdict(progress)}
    path = atomic_write_text(orchestrator_checkpoint_file(output_dir, progress.step), json.dumps(record))
    prune_checkpoints(output_dir, "orchestrator", ckpt.keep, max_steps, ckpt.interval)
    logger.debug(f"saved orchestrator checkpoint {path}")
    return path


def load_checkpoint(output_dir: Path, resume_step: int | str | None) -> Progress | None:
    """The progress saved at the resume step, or None to start fresh; ValueError if it is missing."""
    try:
        step = resolve_resume_step(output_dir, resume_step, "orchestrator")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if step is None:
        return None
    path = orchestrator_checkpoint_file(output_dir, step)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # a truncated or foreign file: say which one
        raise CheckpointError(f"cannot read orchestrator checkpoint {path}: {e}") from None
    if not isinstance(record, dict) or record.pop("version", None) != VERSION:
        raise CheckpointError(f"{path}: not an orchestrator checkpoint of version {VERSION}")
    try:
        progress = Progress(**record)
        if progress.rng_state is not None:  # JSON has lists where random.getstate() has tuples
            version, state, gauss = progress.rng_state
            progress.rng_state = (version, tuple(state), gauss)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: malformed orchestrator checkpoint: {e}") from None
    logger.info(
        f"resuming from {path}: step {progress.step}, {progress.examples_drawn} examples drawn "
        f"(under {checkpoints_root(output_dir)})"
    )
    return progress


def new_rng(seed: int, progress: Progress | None) -> random.Random:
    rng = random.Random(seed)
    if progress is not None and progress.rng_state is not None:
        rng.setstate(progress.rng_state)
    return rng
