"""`rl`: run inference, orchestrator and trainer on one node (or submit them to Slurm with `--slurm`).

The entry only: parse the config, then `prime_rl.launch` resolves the three sub-configs, writes them to
OUTPUT_DIR/run/, spawns the services with their output captured in OUTPUT_DIR/logs/, follows their logs,
and stops everything when one fails or on Ctrl-C (exit non-zero, naming the failed service).

With `--restart N`, a service that dies, or hangs (`--hang-timeout`), is restarted alone, up to N times per
service, while the others keep running: the trainer and the orchestrator from their newest checkpoint
(`--ckpt.resume-step latest`), the inference server as it was started (the orchestrator waits for it and gives
it the current weights). A permanent error or a crash loop ends the run at once (launch/supervise.py).

With checkpoints on, USR1 or SIGTERM (Slurm's time-limit and preemption signals) stop the run cleanly: the
trainer checkpoints after its current step, the orchestrator stops with its progress saved, and `rl` exits
with status 3 (PREEMPTED); `--ckpt.resume-step latest` goes on from there with no step lost or repeated.
"""

from __future__ import annotations

import signal
import sys
from functools import partial

from prime_rl.configs import parse_config
from prime_rl.configs.rl import RLConfig
from prime_rl.entrypoints import command, run_service
from prime_rl.launch.run import run
from prime_rl.launch.services import assign_devices, count_gpus
from prime_rl.launch.supervise import ServiceFailed
from prime_rl.protocol import DiskFull, ResumeAtEnd, RunLocked
from prime_rl.slurm.launch import submit
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.process import catch_stop_signals, ignore_usr1


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt


def write_launch_files(config: RLConfig) -> int:
    """`rl --k8s...` / `rl --cloud...`: the run's files written, and how to start it; a config the layout refuses
    is exit 2."""
    if config.k8s is not None:
        from prime_rl.k8s.manifests import write
    else:
        from prime_rl.cloud.tasks import write
    try:
        path = write(config)
    except ValueError as e:
        print(f"rl: config error: {e}", file=sys.stderr)
        return 2
    start = {"skypilot": "sky launch", "dstack": "dstack apply -f"}
    command = "kubectl apply -f" if config.k8s is not None else start[config.cloud.launcher]
    print(f"wrote {path}\nstart the run: {command} {path}")
    return 0


def main() -> None:
    config = parse_config(RLConfig, prog="rl")
    if config.plan is not None:
        from prime_rl.launch.plan import render

        try:
            text, fits = render(config)
        except (OSError, ValueError, KeyError) as e:
            print(f"rl: cannot plan {config.trainer.model.name}: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        print(text)
        raise SystemExit(0 if fits else 1)
    if config.slurm is not None:
        raise SystemExit(submit(config, "rl"))
    if config.k8s is not None or config.cloud is not None:
        raise SystemExit(write_launch_files(config))
    try:  # devices this node lacks are a bad config: said at once, before the log of the dir's last run is opened
        assign_devices(config, count_gpus())
    except ValueError as e:
        print(f"rl: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    setup_logging("rl", config.orchestrator.output_dir, config.log.level, config.log.file)
    # Explicitly: a shell that starts us in the background leaves SIGINT ignored, and Ctrl-C must still stop us.
    signal.signal(signal.SIGINT, _terminate)
    if config.trainer.ckpt is not None:
        catch_stop_signals()  # USR1 / SIGTERM: a clean, resumable stop (`stop_run`)
    else:
        ignore_usr1()
        signal.signal(signal.SIGTERM, _terminate)
    errors = (ServiceFailed, TimeoutError, ValueError, RunLocked, DiskFull)
    # A resume at or past max_steps asks for nothing: exit 2 like a bad config, never 0 with a stale summary.
    run_service(lambda: run(config), errors, interrupted="interrupted; stopped all services", fatal=(ResumeAtEnd,))


cli = partial(command, main)  # the process entry ([project.scripts], python -m)

if __name__ == "__main__":
    cli()
