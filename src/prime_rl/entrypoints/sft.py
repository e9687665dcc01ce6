"""`sft`: supervised fine-tuning on the trainer's model/FSDP/checkpoint code (prime_rl.trainer.sft.train),
or, with `--slurm`, the same run submitted as a Slurm job."""

from __future__ import annotations

from functools import partial

from prime_rl.configs import parse_config
from prime_rl.configs.sft import SFTConfig
from prime_rl.entrypoints import command, run_service
from prime_rl.entrypoints.trainer import torchrun_worker
from prime_rl.protocol import ResumeAtEnd


def main() -> None:
    torchrun_worker()
    config = parse_config(SFTConfig, prog="sft")
    if config.slurm is not None:
        from prime_rl.slurm.launch import submit

        raise SystemExit(submit(config, "sft"))
    from prime_rl.trainer import startup  # no torch yet: a refused start (lock held, no such model) is instant

    # A resume at or past max_steps asks for nothing: exit 2 like a bad config, never 0 with a stale summary.
    run_service(
        lambda: startup.start(config, "sft", train), startup.ERRORS, startup.stopped_status(), fatal=(ResumeAtEnd,)
    )


def train(config: SFTConfig) -> None:
    """The SFT steps, imported once the start's checks passed: they load torch (seconds of CPU)."""
    from prime_rl.trainer.sft.train import run

    run(config)


cli = partial(command, main)  # the process entry ([project.scripts], python -m)

if __name__ == "__main__":
    cli()
