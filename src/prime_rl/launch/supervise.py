"""Supervision of the launcher's child processes: start one with its output in its log file (`Service`), wait
for the inference server's health, watch the run and restart a dead service in place (`--restart`), pass a stop
signal on for a clean, resumable stop, and stop everything at the end. Used by `rl` and by `eval --serve`."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from prime_rl.configs.rl import RLConfig
from prime_rl.protocol import checkpoint_steps, stopped_file
from prime_rl.utils.logging import logger
from prime_rl.utils.process import PREEMPTED, StopRequested, children, die_with_parent, ignore_usr1, stop_requested


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
    """A service died while the run needed it; the message carries this run's last lines of its log."""

    def __init__(self, service: Service):
        self.service = service
        super().__init__(
            f"{service.name} failed (exit {service.returncode}); last lines of {service.log_path}:\n{service.tail()}"
        )


class Restarter:
    """Restarts a dead service in place, up to `--restart` times in all (0: never, a death ends the run)."""

    def __init__(self, config: RLConfig, commands: dict[str, list[str]], env: dict[str, dict[str, str]]):
        self.left, self.total = config.restart, config.restart
        self.output_dir, self.commands, self.env = config.orchestrator.output_dir, commands, env

    def command(self, name: str) -> tuple[list[str], str]:
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
