"""What the two trainer entrypoints (`trainer` for RL, `sft`) share around their steps: process start-up
(logging per rank, the output dir's lock, the recorded config, clean errors), the training state of a config
(distributed group, model, optimizer, schedule, weight files), resuming, checkpoints when due, and stopping
on a stop signal (Slurm's USR1 / SIGTERM) with a checkpoint, every rank after the same step."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prime_rl.configs import parse_config
from prime_rl.protocol import DiskFull, RunLocked, WaitTimeout, WriterDead, stopped_file
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.parallel import run_lock
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.process import (
    PREEMPTED,
    StopRequested,
    catch_stop_signals,
    die_with_parent,
    ignore_usr1,
    stop_requested,
)
from prime_rl.utils.run_record import write_run_config

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
    # With checkpoints a stop signal ends the run after the current step, resumable; without, USR1 is ignored.
    catch_stop_signals() if config.ckpt is not None else ignore_usr1()
    rank = int(os.environ.get("RANK", 0))
    if rank == 0:
        setup_logging(service, config.output_dir, config.log.level, config.log.file)
    else:  # one log per service: other ranks only surface problems, on their stderr
        setup_logging(f"{service}-rank{rank}", None, "WARNING", to_file=False)
    try:
        with run_lock(config.output_dir, service, rank):
            if rank == 0:
                write_run_config(config, service, config.output_dir)
                stopped_file(config.output_dir, service).unlink(missing_ok=True)
            run(config)
    except (WaitTimeout, WriterDead, TrainerError, RunLocked, DiskFull) as e:
        logger.error(str(e))
        raise SystemExit(1) from None
    except StopRequested as e:
        logger.warning(str(e))
        # torchrun reports a worker's non-zero status as a crash: there the job script reads stopped_file.
        raise SystemExit(0 if "TORCHELASTIC_RUN_ID" in os.environ else PREEMPTED) from None


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
    from prime_rl.protocol import checkpoint_due

    ckpt = config.ckpt
    if ckpt is None or not checkpoint_due(progress.step, max_steps, ckpt.interval):
        return False
    save(config, t, progress, max_steps, times)
    return True


def save(config, t: Training, progress, max_steps: int, times: dict) -> None:
    """Collective: write `checkpoints/step_n/trainer` for `progress`; rank 0 prunes old ones."""
    from prime_rl.protocol import prune_checkpoints
    from prime_rl.trainer.ckpt import save_checkpoint
    from prime_rl.utils.timer import timer

    with timer(times, "save_ckpt"):
        save_checkpoint(
            config.output_dir, progress.step, t.model, t.optimizer, t.scheduler, progress, t.files, t.d.rank
        )
    if t.d.is_main:
        prune_checkpoints(config.output_dir, "trainer", config.ckpt.keep, max_steps, config.ckpt.interval)


def stop_agreed(d) -> bool:
    """Collective, between steps: did any rank receive a stop signal? Then every rank stops here (a rank
    that went on alone would wait forever in the next step's collectives)."""
    from prime_rl.trainer.parallel import all_reduce

    (stop,) = all_reduce([float(stop_requested() is not None)], d.device, op="max")
    return stop > 0


def stop_on_signal(name: str, config, t: Training, progress, max_steps: int) -> None:
    """Collective: the run stops after `progress.step` steps; checkpoint that state (unless it is on disk),
    record the stop in run/<name>.stopped (rank 0) and raise StopRequested."""
    from prime_rl.protocol import atomic_write_json, is_stable, trainer_checkpoint_dir

    step = progress.step
    if step > 0 and not is_stable(trainer_checkpoint_dir(config.output_dir, step)):
        save(config, t, progress, max_steps, {})
    signal_name = stop_requested() or "a stop signal (on another rank)"
    if t.d.is_main:
        atomic_write_json(stopped_file(config.output_dir, name), {"signal": signal_name, "step": step})
    saved = f"checkpoint checkpoints/step_{step}" if step > 0 else "no step done, nothing to save"
    raise StopRequested(f"stopped on {signal_name} after {step} step(s): {saved}; resume: --ckpt.resume-step latest")
