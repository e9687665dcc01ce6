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
from prime_rl.launch.watchdog import Watchdog
from prime_rl.protocol import checkpoint_steps, stopped_file
from prime_rl.utils.logging import logger
from prime_rl.utils.net import probe_client
from prime_rl.utils.process import (
    FATAL,
    PEER_LOST,
    PREEMPTED,
    StopRequested,
    children,
    die_with_parent,
    ignore_usr1,
    stop_requested,
)


class Service:
    """One child process whose stdout/stderr go to OUTPUT_DIR/logs/<name>.log."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, env: dict[str, str]):
        self.name, self.log_path = name, log_path
        self.started, self.worked = time.time(), False  # worked: finished a unit of work (watchdog.py)
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

    def kill(self) -> None:
        """SIGKILL the whole group (a hung process; a stopped one too) and wait for the exit."""
        _signal_group(self.proc, signal.SIGKILL)
        self.proc.wait(10)

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


def wait_for_inference(services: list[Service], url: str, timeout: float, restart: Restarter | None = None) -> None:
    """Wait for the server's /health; fail at once if any started service dies meanwhile (or, with `restart`,
    replace a trainer that does: the server's start may take minutes, a crash loop must end in seconds). An
    orchestrator or trainer that exited 0 is done, not dead: it saw the server up before this loop's next probe
    (a short run's orchestrator finishes within a second of it)."""
    import httpx

    with probe_client() as client:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if signal_name := stop_requested():
                raise StopRequested(f"{signal_name} received while waiting for the inference server; nothing to save")
            for service in list(services):
                if service.returncode is not None and (service.returncode != 0 or service.name in SERVERS):
                    if restart is None or service.name in SERVERS:
                        raise ServiceFailed(service)
                    restart(services, service)
            if restart is not None:
                restart.start_due(services)
            try:
                if client.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    logs = ", ".join(str(s.log_path) for s in services if s.name in SERVERS)
    raise TimeoutError(f"inference server not healthy at {url} after {timeout:.0f}s; see {logs}")


class ServiceFailed(RuntimeError):
    """A service died while the run needed it; the message carries this run's last lines of its log."""

    def __init__(self, service: Service, why: str = ""):
        self.service = service
        why = why or f"failed (exit {service.returncode})"
        super().__init__(f"{service.name} {why}; last lines of {service.log_path}:\n{service.tail()}")


PEER = {"orchestrator": "trainer", "trainer": "orchestrator"}  # whose heartbeat each one waits on
SERVERS = ("inference", "teacher")  # serve until stopped: never "finished", restarted as started


class Restarter:
    """Replaces a dead or hung service in place, up to `--restart` times per service (0: a death ends the run),
    the 2nd and later restarts of a service after a backoff (1, 2, 4 ... 30 s). Ends the run at once on a
    permanent error (exit FATAL), or when a service dies again before finishing one unit of work (a crash
    loop: a restart cannot help). A service that lost its peer (exit PEER_LOST) had the peer restarted too."""

    def __init__(self, config: RLConfig, commands: dict[str, list[str]], env: dict[str, dict[str, str]]):
        self.total = config.restart
        self.output_dir, self.commands, self.env = config.orchestrator.output_dir, commands, env
        self.restarts: dict[str, int] = {}
        self.early_deaths: dict[str, int] = {}  # deaths in a row before finishing a unit of work
        self.due: dict[str, tuple[float, Service]] = {}  # restarts waiting out their backoff

    def command(self, name: str) -> tuple[list[str], str]:
        if name in SERVERS:
            return self.commands[name], "as started"
        steps = checkpoint_steps(self.output_dir, (name,))
        if not steps:  # none written yet: it starts over (the rollouts and weights it needs are all kept)
            return self.commands[name], "from the start (no checkpoint yet)"
        return [*self.commands[name], "--ckpt.resume-step", "latest"], f"from checkpoints/step_{steps[-1]}"

    def __call__(self, services: list[Service], dead: Service, why: str = "", charged: bool = True) -> None:
        """Schedule `dead`'s replacement; raise ServiceFailed when it must not be restarted."""
        name, rc = dead.name, dead.returncode
        if name in self.due:
            return
        if self.total == 0:
            raise ServiceFailed(dead, why)  # "failed (exit N)", or why it hung
        why = why or f"died (exit {rc})"
        if rc == FATAL:
            raise ServiceFailed(dead, f"failed with a permanent error (exit {FATAL}): not restarted")
        early = self.early_deaths.get(name, 0) + 1 if charged and not dead.worked else 0
        self.early_deaths[name] = early
        if early >= 2:
            raise ServiceFailed(dead, f"{why} again before finishing a unit of work: a crash loop, not restarted")
        count = self.restarts.get(name, 0) + charged
        if count > self.total:
            raise ServiceFailed(dead, f"{why}; no restart left (--restart {self.total})")
        self.restarts[name] = count
        if rc == PEER_LOST and (peer := next((s for s in services if s.name == PEER.get(name)), None)):
            if peer.returncode is None and peer.name not in self.due:
                peer.kill()
                self(services, peer, f"went silent (the {name} gave up waiting on it)")
        delay = 0.0 if count <= 1 else min(30.0, 2.0 ** (count - 2))
        _, origin = self.command(name)
        when = f" in {delay:.0f}s" if delay else ""
        what = f"restart {count} of {self.total}" if charged else "not counted: its peer failed"
        logger.warning(f"{name} {why}; restarting it{when} {origin}, {what}; its last lines:\n{dead.tail(8)}")
        self.due[name] = (time.monotonic() + delay, dead)

    def start_due(self, services: list[Service]) -> None:
        for name, (at, dead) in list(self.due.items()):
            if time.monotonic() >= at:
                del self.due[name]
                dead.reap()
                cmd, _ = self.command(name)
                services[services.index(dead)] = Service(name, cmd, dead.log_path, self.env[name])


def watch(services: list[Service], restart: Restarter, watchdog: Watchdog, config: RLConfig) -> None:
    """Return when orchestrator and trainer both exit 0; restart or raise ServiceFailed when any service dies
    or hangs; on a stop signal (ours, or one the orchestrator or a lone trainer got: it exits PREEMPTED) stop
    the run (`stop_run`)."""
    while True:
        if not restart.due and all(s.returncode == 0 for s in services if s.name not in SERVERS):
            return
        if stop_requested() or any(s.returncode == PREEMPTED for s in services if s.name not in SERVERS):
            stop_run(services, config.orchestrator.output_dir, config.stop_timeout)
        for service in list(services):
            if service.name in restart.due:
                continue
            rc = service.returncode
            if rc is None:
                if reason := watchdog.hung(service):
                    logger.error(f"{service.name} is hung: {reason}; killing it")
                    service.kill()
                    restart(services, service, f"hung ({reason})")
            elif rc != 0 or service.name in SERVERS:
                charged = rc != PEER_LOST  # its peer went silent: that one is charged
                restart(services, service, charged=charged)
        restart.start_due(services)
        time.sleep(0.2)


def stop_run(services: list[Service], output_dir: Path, timeout: float) -> None:
    """Pass the stop signal on to trainer and orchestrator (under Slurm it reached them already; again is
    harmless), wait until both exited, and raise StopRequested saying where the run resumes from."""
    savers = [s for s in services if s.name not in SERVERS]
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
