"""The one-node run of `rl`: under the output dir's locks, write each service's config to OUTPUT_DIR/run/,
prepare the dir (fresh or resumed), start every service at once and wait for the server's health, follow them on
the console, and stop them all at the end (finished, failed, or stopped)."""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from prime_rl.configs import OUTPUT_DIR_VAR
from prime_rl.configs.rl import SERVICES, RLConfig
from prime_rl.launch.console import StatusLine, follow_logs
from prime_rl.launch.memory_check import memory_warning
from prime_rl.launch.services import (
    assign_devices,
    count_gpus,
    pin_cpus,
    prometheus_ports,
    resume_step,
    service_commands,
    service_configs,
    wait_passively_beside_the_trainer,
)
from prime_rl.launch.supervise import Restarter, Service, stop_all, wait_for_inference, watch
from prime_rl.launch.watchdog import Watchdog
from prime_rl.protocol import RUN_VAR, check_resume_before_end, log_file, prepare_output_dir, run_dir, run_locks
from prime_rl.protocol.lock import TOKEN_VAR as LOCK_TOKEN_VAR
from prime_rl.protocol.prepare import check_ours
from prime_rl.utils.hub import check_model_source
from prime_rl.utils.logging import logger
from prime_rl.utils.run_record import write_run_config
from prime_rl.utils.summary import ThisRun, rl_summary


def run(config: RLConfig) -> None:
    """Holds the output dir's orchestrator and trainer locks for the whole run (before anything is written or
    cleared); the services join them with the token in their environment."""
    with run_locks(config.orchestrator.output_dir) as token:
        _run(config, token)


def _run(config: RLConfig, lock_token: str) -> None:
    started = time.time()  # the status line counts only metrics records written from now: not an earlier run's
    output_dir = config.orchestrator.output_dir
    check_ours(output_dir)  # at once, not after the checks below (seconds)
    check_environments(config)
    check_model_source(config.inference.model.name, ValueError)  # no network: one line now, not after 56 s
    resumed_from = resume_step(config)
    check_resume_before_end(resumed_from, config.trainer.max_steps, output_dir)  # a finished run: nothing to do
    if said := memory_warning(config, count_gpus()):
        logger.warning(said)
    env, trainer_procs = service_env(config, lock_token)
    commands = pin_cpus(
        config, service_commands(run_dir(output_dir), trainer_procs, teacher=config.teacher is not None)
    )
    config, scrape = prometheus_ports(config)
    logger.info(scrape)
    subs = service_configs(config, trainer_procs, key_in_env=bool(config.inference.api_key), env=env)
    config = config.model_copy(update=subs)
    for name in SERVICES:
        write_run_config(getattr(config, name), name, output_dir)
    if config.teacher is not None:
        write_run_config(config.teacher, "teacher", output_dir)
    # Its time on the output dir's clock marks what this run writes (the summary reports only those checkpoints).
    this_run = ThisRun(write_run_config(config, "rl", output_dir).stat().st_mtime, resumed_from)
    # Before anything starts: the trainer, started first, must not train on an earlier run's rollouts.
    if said := prepare_output_dir(output_dir, resumed_from, launcher=True):
        logger.warning(said)
    services: list[Service] = []
    stop_following = threading.Event()
    status = StatusLine(output_dir, config.trainer.max_steps, since=started)
    follower = threading.Thread(target=follow_logs, args=(services, stop_following, status), daemon=True)
    follower.start()
    health = f"http://127.0.0.1:{config.inference.server.port}/health"
    try:
        restart = Restarter(config, commands, env)
        start_services(config, services, commands, env, trainer_procs, restart)
        with Watchdog(output_dir, lock_token, config.hang_timeout, health, trainer_procs) as watchdog:
            watch(services, restart, watchdog, config)
        # The seconds before the summary are the servers' shutdown and the plots: said, not silent.
        servers = " and ".join(s.name for s in services if s.name in ("inference", "teacher"))
        logger.info(f"trainer and orchestrator done; stopping {servers}, drawing {output_dir / 'plots' / 'run.png'}")
        from prime_rl.utils.plot import plot_runs

        # Drawn while the servers shut down; the summary says where.
        plotter = ThreadPoolExecutor(1)
        plotting = plotter.submit(plot_runs, [output_dir], output_dir / "plots" / "run")
    finally:
        stop_all(services)
        stop_following.set()  # it prints the services' last lines, then returns
        follower.join(timeout=2)
    plots = plotting.result()
    plotter.shutdown()

    # Last, below the services' last lines; the user's own arguments make the resume command.
    for line in rl_summary(output_dir, config.trainer.max_steps, time.time() - started, sys.argv[1:], plots, this_run):
        logger.info(line)


def check_environments(config: RLConfig) -> None:
    """An unknown environment id fails here, in a second, not after the server and the trainer started."""
    from prime_rl.envs import environment_factory

    for env in [*config.orchestrator.env, *config.orchestrator.eval]:
        if not env.id.startswith("verifiers:"):  # importing verifiers takes seconds: its loader says
            environment_factory(env.id)


def service_env(config: RLConfig, lock_token: str) -> tuple[dict[str, dict[str, str]], int]:
    """Per-service env additions (each service's `env_vars`, then devices, the lock token, the API key) and the
    trainer world size."""
    env, trainer_procs = assign_devices(config, count_gpus())
    for name in SERVICES:
        # $OUTPUT_DIR outranks the run/*.toml the services read: theirs is the dir this run resolved, whatever the
        # user's shell exported (`rl --output-dir B` with OUTPUT_DIR=A exported runs in B).
        env[name] = {**getattr(config, name).env_vars, **env[name], OUTPUT_DIR_VAR: str(config.orchestrator.output_dir)}
    if env["inference"].get("CUDA_VISIBLE_DEVICES") == "":  # on CPU
        env["inference"] = wait_passively_beside_the_trainer(config, env["inference"])
    if config.teacher is not None:  # the teacher server shares the policy server's devices (on CPU: its cores)
        env["teacher"] = {**env["inference"], **config.teacher.env_vars, OUTPUT_DIR_VAR: str(config.teacher.output_dir)}
    for name in ("orchestrator", "trainer"):
        env[name][LOCK_TOKEN_VAR] = lock_token
        env[name][RUN_VAR] = lock_token  # their heartbeats name this run (protocol.liveness)
    if config.inference.api_key:
        # The services read their configs from run/*.toml, which never hold the key: it travels in the
        # environment of the two processes that need it, under the orchestrator's api_key_var.
        for name in ("inference", "orchestrator"):
            env[name][config.orchestrator.client.api_key_var] = config.inference.api_key
    return env, trainer_procs


def start_services(
    config: RLConfig,
    services: list[Service],
    commands: dict[str, list[str]],
    env: dict[str, dict[str, str]],
    trainer_procs: int,
    restart: Restarter,
) -> None:
    """Start every service at once, so the trainer and the orchestrator load (imports, model, environments) while
    the server does: the orchestrator waits for the server's /health itself (service_configs gives it at least
    startup_timeout). Here `rl` waits for the same /health, so a server that fails to start is the error named."""
    output_dir = config.orchestrator.output_dir
    for name in ("inference", "teacher", "trainer", "orchestrator"):
        if name in commands:  # the teacher server only with [teacher]
            services.append(Service(name, commands[name], log_file(output_dir, name), env[name]))
    port = config.inference.server.port
    wait_for_inference(services, f"http://127.0.0.1:{port}/health", config.startup_timeout, restart)
    if config.teacher is not None:
        teacher_port = config.teacher.server.port
        wait_for_inference(services, f"http://127.0.0.1:{teacher_port}/health", config.startup_timeout, restart)
        logger.info(f"teacher {config.teacher.model.name} ready on port {teacher_port}")
    logger.info(f"inference ready on port {port} ({trainer_procs} trainer rank(s))")
