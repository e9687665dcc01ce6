"""What the two trainer entrypoints (`trainer` for RL, `sft`) share around their steps: process start-up
(logging per rank, the output dir's lock, the recorded config, clean errors), the training state of a config
(distributed group, model, optimizer, schedule, weight files), resuming, and checkpoints when due."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prime_rl.protocol import DiskFull, RunLocked, WaitTimeout, WriterDead
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.parallel import run_lock
from prime_rl.utils.config import parse_config, write_run_config
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.process import die_with_parent

logger = logging.getLogger("prime_rl")


def main(config_cls, service: str, run: Callable[[Any], None]) -> None:
    """Parse `config_cls`, set up logging and the run lock (rank 0), call `run(config)`; a known failure
    is one log line and exit status 1."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: never outlive the agent (it may be SIGKILLed)
        die_with_parent(signal.SIGKILL)
    config = parse_config(config_cls, prog=service)
    if getattr(config, "slurm", None) is not None:  # `sft --slurm`: submit the run as a Slurm job instead
        from prime_rl.slurm.launch import submit

        raise SystemExit(submit(config, service))
    rank = int(os.environ.get("RANK", 0))
    if rank == 0:
        setup_logging(service, config.output_dir, config.log.level, config.log.file)
    else:  # one log per service: other ranks only surface problems, on their stderr
        setup_logging(f"{service}-rank{rank}", None, "WARNING", to_file=False)
    try:
        with run_lock(config.output_dir, service, rank):
            if rank == 0:
                write_run_config(config, service, config.output_dir)
            run(config)
    except (WaitTimeout, WriterDead, TrainerError, RunLocked, DiskFull) as e:
        logger.error(str(e))
        raise SystemExit(1) from None


@dataclass
class Training:
    d: Any  # parallel.Dist
    model: Any
    optimizer: Any
    scheduler: Any
    files: Any  # weights.ModelFiles: what every weight export copies from the base model


@contextmanager
def training(config, max_steps: int) -> Iterator[Training]:
    """Seeded, joined to the process group, with the config's model parallelized and its optimizer built;
    the group is closed on the way out."""
    import torch

    from prime_rl.trainer.model import build_training
    from prime_rl.trainer.parallel import close_distributed, init_distributed, resolve_device
    from prime_rl.trainer.weights import build_model_files

    torch.manual_seed(config.seed)
    d = init_distributed(resolve_device(config.device))
    try:
        model, optimizer, scheduler = build_training(config, d, max_steps)
        files = build_model_files(config.model.name, config.model.lora)  # every rank writes in its dtype
        yield Training(d, model, optimizer, scheduler, files)
    finally:
        close_distributed()


def resume_step(config) -> int | None:
    """The checkpoint step `--ckpt.resume-step` asks for (-1 = newest), None for a fresh start."""
    from prime_rl.protocol import resolve_resume_step

    try:
        return resolve_resume_step(config.output_dir, config.ckpt and config.ckpt.resume_step, "trainer")
    except ValueError as e:
        raise TrainerError(str(e)) from None


def load(config, t: Training, step: int):
    """Restore checkpoint `step` into `t`; returns its Progress."""
    from prime_rl.trainer.ckpt import load_checkpoint

    progress = load_checkpoint(config.output_dir, step, t.model, t.optimizer, t.scheduler, t.d.rank)
    if progress.step != step:
        raise TrainerError(f"checkpoint step_{step} holds trainer progress of step {progress.step}")
    return progress


def checkpoint_if_due(config, t: Training, progress, max_steps: int, times: dict) -> bool:
    """Write `checkpoints/step_n/trainer` when `ckpt.interval` (or the last step) says so; prune old ones."""
    from prime_rl.protocol import checkpoint_due, prune_checkpoints
    from prime_rl.trainer.ckpt import save_checkpoint
    from prime_rl.utils.timer import timer

    ckpt = config.ckpt
    if ckpt is None or not checkpoint_due(progress.step, max_steps, ckpt.interval):
        return False
    with timer(times, "save_ckpt"):
        save_checkpoint(
            config.output_dir, progress.step, t.model, t.optimizer, t.scheduler, progress, t.files, t.d.rank
        )
    if t.d.is_main:
        prune_checkpoints(config.output_dir, "trainer", ckpt.keep, max_steps, ckpt.interval)
    return True
