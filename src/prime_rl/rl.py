"""`rl`: run inference, orchestrator and trainer on one node.

Launcher only: resolve the three configs (copying the shared keys into each), write them to
OUTPUT_DIR/run/, spawn the services with their output captured in OUTPUT_DIR/logs/, follow their
logs, and stop everything when one fails or on Ctrl-C (exit non-zero, naming the failed service).

With `--restart N`, a service that dies is restarted alone, up to N times in all, while the others keep
running: the trainer and the orchestrator from their newest checkpoint (`--ckpt.resume-step latest`), the
inference server as it was started (the orchestrator waits for it and gives it the current weights).

With checkpoints on, USR1 or SIGTERM (Slurm's time-limit and preemption signals) stop the run cleanly: the
trainer checkpoints after its current step, the orchestrator stops with its progress saved, and `rl` exits
with status 3 (PREEMPTED); `--ckpt.resume-step latest` goes on from there with no step lost or repeated.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from prime_rl.configs import parse_config
from prime_rl.configs.rl import SERVICES, RLConfig
from prime_rl.protocol import DiskFull, RunLock, RunLocked, stopped_file
from prime_rl.protocol.lock import TOKEN_VAR as LOCK_TOKEN_VAR
from prime_rl.utils.logging import logger, setup_logging
from prime_rl.utils.process import (
    PREEMPTED,
    StopRequested,
    catch_stop_signals,
    children,
    die_with_parent,
    ignore_usr1,
    stop_requested,
)
from prime_rl.utils.run_record import write_run_config

# ---------------------------------------------------------------------------------------------


def count_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def assign_devices(config: RLConfig, num_gpus: int) -> tuple[dict[str, dict[str, str]], int]:
    """Per-service env additions and the trainer world size."""
    if num_gpus == 0:
        if config.inference_gpu_ids or config.trainer_gpu_ids:
            raise ValueError("GPU ids were given but no CUDA device is visible; drop --*-gpu-ids to run on CPU")
        cpu = {"CUDA_VISIBLE_DEVICES": ""}
        return {s: dict(cpu) for s in SERVICES}, config.trainer_cpu_ranks
    inference_ids = config.inference_gpu_ids or [0]
    trainer_ids = config.trainer_gpu_ids or [1 if num_gpus > 1 else 0]
    for ids in (inference_ids, trainer_ids):
        if bad := [i for i in ids if not 0 <= i < num_gpus]:
            raise ValueError(f"GPU ids {bad} do not exist (this node has {num_gpus})")
    env = {
        "inference": {"CUDA_VISIBLE_DEVICES": ",".join(map(str, inference_ids))},
        "orchestrator": {"CUDA_VISIBLE_DEVICES": ""},
        "trainer": {"CUDA_VISIBLE_DEVICES": ",".join(map(str, trainer_ids))},
    }
    return env, len(trainer_ids)


def service_commands(run_dir: Path, trainer_procs: int) -> dict[str, list[str]]:
    py = sys.executable
    return {
        "inference": [py, "-m", "prime_rl.inference.server", "@", str(run_dir / "inference.toml")],
        "orchestrator": [py, "-m", "prime_rl.orchestrator.orchestrator", "@", str(run_dir / "orchestrator.toml")],
        "trainer": [
            py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(trainer_procs),
            "-m", "prime_rl.trainer.rl.train", "@", str(run_dir / "trainer.toml"),
        ],
    }  # fmt: skip


class Service:
    """One child process whose stdout/stderr go to OUTPUT_DIR/logs/<name>.log."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict[str, str]):
        self.name, self.log_path = name, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        self.log_start = self._log.tell()  # a resumed run appends: what came before is an earlier run's
        # Own process group, so stopping it also stops torchrun's workers; SIGTERM when `rl` dies, however.
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **env}, start_new_session=True, preexec_fn=_child_setup,
        )  # fmt: skip

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            _signal_group(self.proc, signal.SIGTERM)

    def reap(self) -> None:
        """After the process died: kill whatever of its group is left (e.g. a child that outlived it)."""
        _signal_group(self.proc, signal.SIGKILL)
        self._log.close()

    def wait_or_kill(self, deadline: float) -> None:
        """Wait for the exit until `deadline` (monotonic), then SIGKILL the whole group."""
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning(f"{self.name} still running after SIGTERM; killing it")
            _signal_group(self.proc, signal.SIGKILL)
            self.proc.wait(5)
        self._log.close()

    def tail(self, lines: int = 20) -> str:
        """The last lines this run wrote (never an earlier run's traceback)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_start)
                return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:]) or "(nothing logged)"
        except OSError:
            return "(no log)"


def _child_setup() -> None:
    """In each service before exec: die with `rl`, and ignore USR1 unless the service catches it (it saves)."""
    die_with_parent()
    ignore_usr1()


def stop_all(services: list[Service], timeout: float = 15.0) -> None:
    """SIGTERM every service at once (so shutdown takes one timeout, not one per service), then SIGKILL."""
    for service in reversed(services):  # consumers first: the orchestrator, then the trainer, then inference
        service.terminate()
    deadline = time.monotonic() + timeout
    for service in services:
        service.wait_or_kill(deadline)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def follow_logs(services: list[Service], stop: threading.Event, status: StatusLine) -> None:
    """Echo the services' step lines and problems to our console while they run, under a live status line."""
    files: dict[str, Any] = {}
    with status:
        while not stop.is_set():
            for s in services:
                if s.name not in files and s.log_path.exists():
                    files[s.name] = open(s.log_path, errors="replace")
                    files[s.name].seek(s.log_start)  # this run's lines only
                f = files.get(s.name)
                for line in f.readlines() if f else []:
                    if s.name != "inference" or " WARNING " in line or " ERROR " in line or "serving" in line:
                        status.print(line.rstrip())
            status.update()
            stop.wait(0.5)
    for f in files.values():
        f.close()


class StatusLine:
    """On a terminal, one live line under the scrolling log lines: step, reward, eval reward, tokens/s, ETA."""

    def __init__(self, output_dir: Path, max_steps: int):
        from rich.console import Console
        from rich.live import Live

        self.output_dir, self.max_steps = output_dir, max_steps
        self.console = Console()
        terminal = self.console.is_terminal
        self.live = Live(console=self.console, refresh_per_second=2, transient=True) if terminal else None

    def __enter__(self) -> StatusLine:
        if self.live is not None:
            self.live.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.stop()

    def print(self, line: str) -> None:
        if self.live is None:
            print(line, flush=True)
        else:
            self.live.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def update(self) -> None:
        if self.live is not None:
            from rich.text import Text

            self.live.update(Text(status_text(self.output_dir, self.max_steps), style="bold"))


def status_text(output_dir: Path, max_steps: int) -> str:
    """'step 7/20 | reward 0.412 | eval 0.380 | 5,120 tok/s | ETA 1m05s' from the newest metrics records."""
    from prime_rl.utils.metrics import tail_metrics

    orchestrator, trainer = tail_metrics(output_dir, "orchestrator"), tail_metrics(output_dir, "trainer")
    if not orchestrator:
        return f"step 0/{max_steps} | starting"
    step = max(r["step"] for r in trainer) + 1 if trainer else 0
    parts = [f"step {step}/{max_steps}", f"reward {orchestrator[-1].get('reward_mean', 0.0):.3f}"]
    if (eval_reward := last_eval_reward(output_dir)) is not None:
        parts.append(f"eval {eval_reward:.3f}")
    parts.append(f"{orchestrator[-1].get('tokens_per_s', 0.0):,.0f} tok/s")
    times = sorted(r["time/step"] for r in trainer[-10:] if "time/step" in r)
    if times:
        left = times[len(times) // 2] * (max_steps - step)
        parts.append(f"ETA {int(left // 60)}m{int(left % 60):02d}s")
    return " | ".join(parts)


def last_eval_reward(output_dir: Path) -> float | None:
    from prime_rl.utils.plot import eval_rewards

    rewards = eval_rewards(output_dir)
    return rewards[-1][1] if rewards else None


def wait_for_inference(services: list[Service], url: str, timeout: float) -> None:
    """Wait for the server's /health; fail at once if any started service dies meanwhile."""
    import httpx

    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if signal_name := stop_requested():
            raise StopRequested(f"{signal_name} received while waiting for the inference server; nothing to save")
        for service in services:
            if service.returncode is not None:
                raise ServiceFailed(service)
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"inference server not healthy at {url} after {timeout:.0f}s; see {services[0].log_path}")


class ServiceFailed(RuntimeError):
    def __init__(self, service: Service):
        self.service = service
        super().__init__(
            f"{service.name} failed (exit {service.returncode}); last lines of {service.log_path}:\n{service.tail()}"
        )


def run(config: RLConfig) -> None:
    """Holds the output dir's orchestrator and trainer locks for the whole run (before anything is written or
    cleared); the services join them with the token in their environment."""
    token = secrets.token_hex(8)
    with (
        RunLock(config.orchestrator.output_dir, "orchestrator", token),
        RunLock(config.orchestrator.output_dir, "trainer", token),
    ):
        _run(config, token)


def _run(config: RLConfig, lock_token: str) -> None:
    from prime_rl.protocol import run_dir

    output_dir = config.orchestrator.output_dir
    env, trainer_procs = assign_devices(config, count_gpus())
    for name in ("orchestrator", "trainer"):
        env[name][LOCK_TOKEN_VAR] = lock_token
    if config.orchestrator.num_train_workers != trainer_procs:
        if "num_train_workers" in config.orchestrator.model_fields_set:
            raise ValueError(
                f"orchestrator.num_train_workers={config.orchestrator.num_train_workers} but the trainer "
                f"runs {trainer_procs} ranks"
            )
        config.orchestrator.num_train_workers = trainer_procs
    if config.inference.api_key:
        # The services read their configs from run/*.toml, which never hold the key: it travels in the
        # environment of the two processes that need it, under the orchestrator's api_key_var.
        key_var = config.orchestrator.client.api_key_var
        config.inference.api_key_var = key_var
        for name in ("inference", "orchestrator"):
            env[name][key_var] = config.inference.api_key
    for name in SERVICES:
        sub = getattr(config, name)
        sub.log.file = False  # we capture each service's output into its log file
        write_run_config(sub, name, output_dir)
    write_run_config(config, "rl", output_dir)

    from prime_rl.protocol import clear_previous_run, log_file, resolve_resume_step

    # Before anything starts: the trainer, started first, must not train on an earlier run's rollouts.
    ckpt = config.orchestrator.ckpt
    fresh = ckpt is None or resolve_resume_step(output_dir, ckpt.resume_step, "orchestrator") is None
    if fresh and (removed := clear_previous_run(output_dir)):
        logger.warning(removed)
    commands = service_commands(run_dir(output_dir), trainer_procs)
    services: list[Service] = []
    stop_following = threading.Event()
    status = StatusLine(output_dir, config.trainer.max_steps)
    follower = threading.Thread(target=follow_logs, args=(services, stop_following, status), daemon=True)
    follower.start()
    try:
        # The trainer only needs rollouts, so it loads while the server does; the orchestrator needs the server.
        for name in ("inference", "trainer"):
            services.append(Service(name, commands[name], log_file(output_dir, name), env[name]))
        port = config.inference.server.port
        wait_for_inference(services, f"http://127.0.0.1:{port}/health", config.startup_timeout)
        logger.info(f"inference ready on port {port}; starting the orchestrator ({trainer_procs} trainer rank(s))")
        services.append(Service("orchestrator", commands["orchestrator"], log_file(output_dir, "orchestrator"),
                                env["orchestrator"]))  # fmt: skip
        watch(services, Restarter(config, commands, env), config)
        logger.info(f"done: {config.max_steps or config.trainer.max_steps} steps; outputs in {output_dir}")
        from prime_rl.utils.plot import plot_runs

        plots = plot_runs([output_dir], output_dir / "plots" / "run")
        logger.info(f"plots of the run: {', '.join(map(str, plots))} (uv run plot DIR [DIR ...] to compare runs)")
    finally:
        stop_all(services)
        time.sleep(0.6)  # let the follower print the last lines
        stop_following.set()
        follower.join(timeout=2)


class Restarter:
    """Restarts a dead service in place, up to `--restart` times in all (0: never, a death ends the run)."""

    def __init__(self, config: RLConfig, commands: dict[str, list[str]], env: dict[str, dict[str, str]]):
        self.left, self.total = config.restart, config.restart
        self.output_dir, self.commands, self.env = config.orchestrator.output_dir, commands, env

    def command(self, name: str) -> tuple[list[str], str]:
        from prime_rl.protocol import checkpoint_steps

        if name == "inference":
            return self.commands[name], "as started"
        steps = checkpoint_steps(self.output_dir, (name,))
        if not steps:  # none written yet: it starts over (the rollouts and weights it needs are all kept)
            return self.commands[name], "from the start (no checkpoint yet)"
        return [*self.commands[name], "--ckpt.resume-step", "latest"], f"from checkpoints/step_{steps[-1]}"

    def __call__(self, services: list[Service], dead: Service) -> None:
        """Replace `dead` in `services` with a fresh process; raise ServiceFailed when no restart is left."""
        if self.left == 0:
            raise ServiceFailed(dead)
        self.left -= 1
        dead.reap()
        cmd, origin = self.command(dead.name)
        logger.warning(
            f"{dead.name} died (exit {dead.returncode}); restarting it {origin}, restart "
            f"{self.total - self.left} of {self.total}; its last lines:\n{dead.tail(8)}"
        )
        services[services.index(dead)] = Service(dead.name, cmd, dead.log_path, self.env[dead.name])


def watch(services: list[Service], restart: Restarter, config: RLConfig) -> None:
    """Return when orchestrator and trainer both exit 0; restart or raise ServiceFailed when any service fails;
    on a stop signal (ours, or the orchestrator's: it exits PREEMPTED) stop the run (`stop_run`)."""
    while True:
        if all(s.returncode == 0 for s in services if s.name != "inference"):
            return
        if stop_requested() or any(s.returncode == PREEMPTED for s in services if s.name == "orchestrator"):
            stop_run(services, config.orchestrator.output_dir, config.stop_timeout)
        for service in list(services):
            rc = service.returncode
            if rc is not None and (rc != 0 or service.name == "inference"):
                restart(services, service)
        time.sleep(0.2)


def stop_run(services: list[Service], output_dir: Path, timeout: float) -> None:
    """Pass the stop signal on to trainer and orchestrator (under Slurm it reached them already; again is
    harmless), wait until both exited, and raise StopRequested saying where the run resumes from."""
    from prime_rl.protocol import checkpoint_steps

    savers = [s for s in services if s.name != "inference"]
    for service in savers:
        for pid in [service.proc.pid, *children(service.proc.pid)]:  # torchrun's workers: their own sessions
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    logger.warning(f"{stop_requested() or 'orchestrator stopped'}: waiting up to {timeout:.0f}s for the trainer "
                   "to checkpoint after its current step and the orchestrator to save its progress")  # fmt: skip
    deadline = time.monotonic() + timeout
    while any(s.returncode is None for s in savers):
        if time.monotonic() > deadline:
            late = ", ".join(s.name for s in savers if s.returncode is None)
            raise TimeoutError(f"{late} did not stop within {timeout:.0f}s of the stop signal (rl --stop-timeout)")
        time.sleep(0.2)
    for service in savers:  # torchrun exits 1 after a SIGTERM it passed on: the trainer recorded its stop
        if service.returncode not in (0, PREEMPTED) and not stopped_file(output_dir, service.name).exists():
            raise ServiceFailed(service)
    trainer, orchestrator = (checkpoint_steps(output_dir, (part,))[-1:] for part in ("trainer", "orchestrator"))
    raise StopRequested(
        f"stopped: trainer checkpoint step {trainer[0] if trainer else 'none'}, orchestrator progress at step "
        f"{orchestrator[0] if orchestrator else 'none'} (in {output_dir}/checkpoints); the same command with "
        "--ckpt.resume-step latest resumes there"
    )


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> None:
    config = parse_config(RLConfig, prog="rl")
    if config.slurm is not None:
        from prime_rl.slurm.launch import submit

        raise SystemExit(submit(config, "rl"))
    setup_logging("rl", config.orchestrator.output_dir, config.log.level, config.log.file)
    # Explicitly: a shell that starts us in the background leaves SIGINT ignored, and Ctrl-C must still stop us.
    signal.signal(signal.SIGINT, _terminate)
    if config.trainer.ckpt is not None:
        catch_stop_signals()  # USR1 / SIGTERM: a clean, resumable stop (`stop_run`)
    else:
        ignore_usr1()
        signal.signal(signal.SIGTERM, _terminate)
    try:
        run(config)
    except KeyboardInterrupt:
        logger.error("interrupted; stopped all services")
        raise SystemExit(130) from None
    except StopRequested as e:
        logger.warning(str(e))
        raise SystemExit(PREEMPTED) from None
    except (ServiceFailed, TimeoutError, ValueError, RunLocked, DiskFull) as e:
        logger.error(str(e))
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
