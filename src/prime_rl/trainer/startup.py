"""How a trainer process (`trainer` for RL, `sft`) starts and ends: logging per rank, the output dir's lock, the
recorded config and the model source checked, then its steps (`run`); the failures that end it with one line.

Importing it loads no torch: the entrypoints import it before the steps (trainer/rl/train.py, trainer/sft/train.py,
which do), so a refused start (a live run holds the lock, the model is not found) answers at once.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from collections.abc import Callable
from pathlib import Path

from prime_rl.configs.training import TrainingConfig
from prime_rl.protocol import DiskFull, RunLock, RunLocked, WaitTimeout, WriterDead, stopped_file
from prime_rl.trainer.errors import TrainerError
from prime_rl.utils.host_memory import keep_freed_memory
from prime_rl.utils.hub import check_model_source
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.process import PREEMPTED, catch_stop_signals, ignore_usr1
from prime_rl.utils.run_record import write_run_config

# The failures that end a trainer with one log line and exit status 1 (the entry catches them).
ERRORS = (WaitTimeout, WriterDead, TrainerError, RunLocked, DiskFull)


def start(config: TrainingConfig, service: str, run: Callable[[TrainingConfig], None]) -> None:
    """Stop signals, logging (per rank), the run lock (rank 0) and the recorded config around `run(config)`."""
    # With checkpoints a stop signal ends the run after the current step, resumable; without, USR1 is ignored.
    catch_stop_signals() if config.ckpt is not None else ignore_usr1()
    keep_freed_memory()  # each step's activations reuse the last step's memory, not fresh zeroed pages
    rank = int(os.environ.get("RANK", 0))
    if rank == 0:
        setup_logging(service, config.output_dir, config.log.level, config.log.file)
    else:  # one log per service: other ranks only surface problems, on their stderr
        setup_logging(f"{service}-rank{rank}", None, "WARNING", to_file=False)
    with run_lock(config.output_dir, service, rank):
        if rank == 0:
            write_run_config(config, service, config.output_dir)
            stopped_file(config.output_dir, service).unlink(missing_ok=True)
        check_model_source(config.model.name, TrainerError)  # no network: one line now, not transformers' retries
        run(config)


def stopped_status() -> int:
    """Exit status of a trainer stopped on a stop signal: torchrun reports a worker's non-zero status as a
    crash, so its workers exit 0 (the job script reads stopped_file); a lone process exits PREEMPTED."""
    return 0 if "TORCHELASTIC_RUN_ID" in os.environ else PREEMPTED


def run_lock(output_dir: Path, role: str, rank: int) -> contextlib.AbstractContextManager:
    """The output dir's lock for this trainer world, held by global rank 0 (see protocol/lock.py)."""
    return RunLock(output_dir, role) if rank == 0 else contextlib.nullcontext()


def run_as_script(script: str, entrypoint: str) -> None:
    """A trainer module run as a script (`torchrun ... src/prime_rl/trainer/rl/train.py @ ...`, docs/usage.md) runs
    its command's entrypoint: without this the file only defined its functions and torchrun exited 0 having
    trained nothing. Its folder leaves sys.path first, so that its loss.py or data.py can never stand in for
    another package's module; the entrypoint runs as a program, not imported, so the trainer stays below the
    entrypoints (pyproject's layers)."""
    folder = Path(script).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != folder]
    runpy.run_module(entrypoint, run_name="__main__", alter_sys=True)
