"""`inference`: pick a backend, load the engine, serve the OpenAI API (prime_rl.inference.server).

uv run inference --model.name outputs/tiny-qwen3 --server.port 8000
"""

from __future__ import annotations

from functools import partial

from prime_rl.configs import parse_config
from prime_rl.configs.inference import BadVllmFlag, InferenceConfig, StartupError
from prime_rl.entrypoints import apply_env_vars, command, run_service
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.process import ignore_usr1
from prime_rl.utils.run_record import write_run_config


def main() -> None:
    config = parse_config(InferenceConfig, prog="inference")
    apply_env_vars(config.env_vars)
    setup_logging("inference", config.output_dir, config.log.level, config.log.file)
    ignore_usr1()  # a job's stop signal is for the trainer and orchestrator; the engine's processes inherit this
    from prime_rl.inference.server import run

    def recorded() -> None:
        write_run_config(config, "inference", config.output_dir)
        run(config)

    run_service(recorded, (StartupError,), fatal=(BadVllmFlag,))


cli = partial(command, main)  # the process entry ([project.scripts], python -m)

if __name__ == "__main__":
    cli()
