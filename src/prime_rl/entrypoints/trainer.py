"""`trainer`: the RL trainer, one process per rank under torchrun (prime_rl.trainer.rl.train).

torchrun --nproc-per-node 2 src/prime_rl/entrypoints/trainer.py @ configs/debug/train.toml
"""

from __future__ import annotations

import os
import signal
from functools import partial

from prime_rl.configs import parse_config
from prime_rl.configs.trainer import TrainerConfig
from prime_rl.entrypoints import apply_env_vars, command, run_service
from prime_rl.utils.process import die_with_parent


def torchrun_worker() -> None:
    """A torchrun worker never outlives its agent (which may be SIGKILLed)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent(signal.SIGKILL)


def main() -> None:
    torchrun_worker()
    config = parse_config(TrainerConfig, prog="trainer")
    apply_env_vars(config.env_vars)
    from prime_rl.trainer import startup  # no torch yet: a refused start (lock held, no such model) is instant

    run_service(lambda: startup.start(config, "trainer", train), startup.ERRORS, startup.stopped_status())


def train(config: TrainerConfig) -> None:
    """The RL trainer's steps, imported once the start's checks passed: they load torch (seconds of CPU), so the
    rank beats from before that (peers, the launcher and the orchestrator's parity gate see a trainer starting)."""
    from prime_rl.protocol import Heartbeat

    rank = int(os.environ.get("RANK", 0))
    with Heartbeat(config.output_dir, f"trainer-rank{rank}", hang_timeout=config.hang_timeout) as heartbeat:
        from prime_rl.trainer.rl.train import run

        run(config, heartbeat)


cli = partial(command, main)  # the process entry ([project.scripts], python -m)

if __name__ == "__main__":
    cli()
