"""`orchestrator`: environments -> rollouts -> advantages -> rank files, one step at a time
(prime_rl.orchestrator.orchestrator)."""

from __future__ import annotations

from functools import partial

from prime_rl.configs import parse_config
from prime_rl.configs.orchestrator import OrchestratorConfig
from prime_rl.entrypoints import apply_env_vars, command, run_service
from prime_rl.protocol import RunLock
from prime_rl.protocol.prepare import check_ours
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.process import ignore_usr1
from prime_rl.utils.run_record import write_run_config


def main() -> None:
    config = parse_config(OrchestratorConfig, prog="orchestrator")
    apply_env_vars(config.env_vars)
    setup_logging("orchestrator", config.output_dir, config.log.level, config.log.file)
    ignore_usr1()  # until orchestrate() catches the stop signals (with checkpoints on)
    from prime_rl.envs import EnvError
    from prime_rl.orchestrator.orchestrator import ERRORS, run

    def locked() -> None:
        with RunLock(config.output_dir, "orchestrator"):
            check_ours(config.output_dir)  # before its record marks the dir as a run's: its fresh start deletes
            write_run_config(config, "orchestrator", config.output_dir)
            run(config)

    run_service(locked, ERRORS, fatal=(EnvError,))


cli = partial(command, main)  # the process entry ([project.scripts], python -m)

if __name__ == "__main__":
    cli()
