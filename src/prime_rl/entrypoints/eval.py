"""`eval`: environments against an inference server (or its own, `--serve`), optionally over every
weights/step_n (prime_rl.eval.eval)."""

from __future__ import annotations

from functools import partial

from prime_rl.configs import parse_config
from prime_rl.configs.eval import EvalConfig
from prime_rl.entrypoints import command, run_service
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.run_record import write_run_config


def main() -> None:
    config = parse_config(EvalConfig, prog="eval")
    setup_logging("eval", config.output_dir, config.log.level, config.log.file)
    from prime_rl.eval.eval import ERRORS, run

    def recorded() -> None:
        write_run_config(config, "eval", config.output_dir)
        run(config)

    run_service(recorded, ERRORS)


cli = partial(command, main)  # the process entry ([project.scripts], python -m)

if __name__ == "__main__":
    cli()
