"""What the two trainers' steps (`trainer` for RL, `sft`) share: the training state of a config (distributed
group, model, optimizer, schedule, weight files), resuming, checkpoints when due, and stopping on a stop signal
(Slurm's USR1 / SIGTERM) with a checkpoint, every rank after the same step. Checkpoints are written in the
background (`ckpt.async_save`): each entry waits for the last one (`finish_checkpoint`) before it ends, as a
stop does. The process around the steps (logging, the lock, clean errors) is startup.py's, which loads no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from prime_rl.configs.training import TrainingConfig
from prime_rl.protocol import (
    atomic_write_json,
    checkpoint_due,
    doing,
    is_stable,
    prune_checkpoints,
    resolve_resume_step,
    stopped_file,
    trainer_checkpoint_dir,
)
from prime_rl.trainer.ckpt import AsyncCheckpointer, Progress, load_checkpoint, save_checkpoint
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.loading import build_training
from prime_rl.trainer.parallel import (
    Dist,
    all_reduce,
    close_distributed,
    compute_dtype,
    init_distributed,
    resolve_device,
)
from prime_rl.trainer.weights import ModelFiles, build_model_files
from prime_rl.utils.process import StopRequested, stop_requested
from prime_rl.utils.timer import timer

logger = logging.getLogger("prime_rl")


@dataclass
class Training:
    dist: Dist
    model: nn.Module
    optimizer: Optimizer
    scheduler: LRScheduler
    files: ModelFiles  # what every weight export copies from the base model
    checkpointer: AsyncCheckpointer | None = None  # with ckpt.async_save: writes checkpoints in the background


@contextmanager
def training(config: TrainingConfig, max_steps: int) -> Iterator[Training]:
    """Seeded, joined to the process group, with the config's model parallelized and its optimizer built;
    the group is closed on the way out."""
    torch.manual_seed(config.seed)
    dist = init_distributed(resolve_device(config.device))
    checkpointer = None
    try:
        model, optimizer, scheduler = build_training(config, dist, max_steps)
        # Weights go out in the dtype the trainer computes in: the servers then sample the policy it scores.
        files = build_model_files(config.model.name, config.model.lora, compute_dtype(config.dtype, dist.device))
        if config.ckpt is not None and config.ckpt.async_save:
            checkpointer = AsyncCheckpointer(dist.rank)
        yield Training(dist, model, optimizer, scheduler, files, checkpointer)
    except BaseException:
        if checkpointer is not None:  # after an error (a normal end finished it): not torn down mid-write
            checkpointer.close()
        close_distributed(clean=False)
        raise
    close_distributed()


def resume_step(config: TrainingConfig) -> int | None:
    """The checkpoint step `--ckpt.resume-step` asks for (-1 = newest), None for a fresh start."""
    try:
        return resolve_resume_step(config.output_dir, config.ckpt and config.ckpt.resume_step, "trainer")
    except ValueError as e:
        raise TrainerError(str(e)) from None


def load(config: TrainingConfig, state: Training, step: int) -> Progress:
    """Restore checkpoint `step` into `state`; returns its Progress."""
    with doing(f"loading checkpoint step {step}", long=True):
        progress = load_checkpoint(
            config.output_dir, step, state.model, state.optimizer, state.scheduler, state.dist.rank
        )
    if progress.step != step:
        raise TrainerError(f"checkpoint step_{step} holds trainer progress of step {progress.step}")
    return progress


def checkpoint_if_due(config: TrainingConfig, state: Training, progress: Progress, max_steps: int, times: dict) -> bool:
    """Write `checkpoints/step_n/trainer` when `ckpt.interval` (or the last step) says so; prune old ones."""
    ckpt = config.ckpt
    if ckpt is None or not checkpoint_due(progress.step, max_steps, ckpt.interval):
        return False
    save(config, state, progress, max_steps, times)
    return True


def save(config: TrainingConfig, state: Training, progress: Progress, max_steps: int, times: dict) -> None:
    """Collective: write `checkpoints/step_n/trainer` for `progress`; rank 0 prunes old ones once it is complete.

    With a checkpointer the step waits (`time/save_ckpt`) only for the previous checkpoint's write to end,
    if it has not, and for the copy of the state in host memory; the write goes on in the background."""
    args = (config.output_dir, progress.step, state.model, state.optimizer, state.scheduler, progress, state.files)
    with timer(times, "save_ckpt"), doing(f"writing checkpoint step {progress.step}", long=True):
        if state.checkpointer is not None:
            finish_checkpoint(config, state, max_steps)  # at most one in flight
            state.checkpointer.start(*args)
            return
        save_checkpoint(*args, state.dist.rank)
    if state.dist.is_main:
        prune_checkpoints(config.output_dir, "trainer", config.ckpt.keep, max_steps, config.ckpt.interval)


def finish_checkpoint(config: TrainingConfig, state: Training, max_steps: int) -> int | None:
    """Collective: wait for the checkpoint written in the background (if any) and mark it STABLE; rank 0 then
    prunes old ones. Returns its step. A failed write raises here, naming the checkpoint."""
    if state.checkpointer is None or state.checkpointer.in_flight is None:
        return None
    with doing(f"finishing checkpoint step {state.checkpointer.in_flight.step}", long=True):
        done = state.checkpointer.finish()
    if state.dist.is_main:
        prune_checkpoints(config.output_dir, "trainer", config.ckpt.keep, max_steps, config.ckpt.interval)
    return done.step


def stop_agreed(dist: Dist) -> bool:
    """Collective, between steps: did any rank receive a stop signal? Then every rank stops here (a rank
    that went on alone would wait forever in the next step's collectives)."""
    (stop,) = all_reduce([float(stop_requested() is not None)], dist.device, op="max")
    return stop > 0


def stop_on_signal(name: str, config: TrainingConfig, state: Training, progress: Progress, max_steps: int) -> None:
    """Collective: the run stops after `progress.step` steps; checkpoint that state (unless it is on disk),
    record the stop in run/<name>.stopped (rank 0) and raise StopRequested."""
    step = progress.step
    # Decided on what every rank knows: STABLE of the checkpoint just finished may not be visible to all yet.
    finished = finish_checkpoint(config, state, max_steps)
    if step > 0 and finished != step and not is_stable(trainer_checkpoint_dir(config.output_dir, step)):
        save(config, state, progress, max_steps, {})
        finish_checkpoint(config, state, max_steps)
    signal_name = stop_requested() or "a stop signal (on another rank)"
    if state.dist.is_main:
        atomic_write_json(stopped_file(config.output_dir, name), {"signal": signal_name, "step": step})
    saved = f"checkpoint checkpoints/step_{step}" if step > 0 else "no step done, nothing to save"
    raise StopRequested(f"stopped on {signal_name} after {step} step(s): {saved}; resume: --ckpt.resume-step latest")
