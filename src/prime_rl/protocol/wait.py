"""Waiting on the other side of the protocol: polls with timeouts, heartbeats to tell slow from dead."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from prime_rl.protocol.files import atomic_write_json, is_stable
from prime_rl.protocol.paths import heartbeat_file, rank_file, weights_dir

logger = logging.getLogger("prime_rl")


class WaitTimeout(TimeoutError):
    """What we waited for did not appear in time."""


class WriterDead(RuntimeError):
    """The process that should produce what we wait for stopped refreshing its heartbeat."""


class Heartbeat:
    """Refreshes `heartbeat/{name}.json` with {"pid","host","step","time"} every `interval` seconds."""

    def __init__(self, output_dir: Path, name: str, interval: float = 2.0):
        self.path = heartbeat_file(output_dir, name)
        self.interval = interval
        self.step = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{name}", daemon=True)

    def beat(self) -> None:
        atomic_write_json(
            self.path, {"pid": os.getpid(), "host": socket.gethostname(), "step": self.step, "time": time.time()}
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except OSError:
                pass  # a transient filesystem hiccup must not kill the service; the next beat retries

    def __enter__(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval + 1)


def heartbeat_age(output_dir: Path, name: str) -> float | None:
    """Seconds since `name` last beat, or None if it never did."""
    try:
        data = json.loads(heartbeat_file(output_dir, name).read_text())
        return time.time() - float(data["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def wait_until(
    ready: Callable[[], bool],
    what: str,
    timeout: float,
    *,
    output_dir: Path | None = None,
    writer: str | None = None,
    heartbeat_timeout: float = 60.0,
    poll: float = 0.05,
    max_poll: float = 1.0,
    note_every: float = 30.0,
) -> float:
    """Poll `ready()` until true; return seconds waited. Raise WaitTimeout / WriterDead naming `what`.

    A wait longer than `note_every` seconds is logged then and every `note_every` seconds after, so a long
    wait is never silent.
    """
    start = time.monotonic()
    delay, next_note = poll, note_every
    while not ready():
        waited = time.monotonic() - start
        if waited >= next_note:
            logger.info(f"still waiting for {what} ({waited:.0f}s of {timeout:.0f}s)")
            next_note += note_every
        if waited > timeout:
            raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}")
        if writer is not None and output_dir is not None:
            age = heartbeat_age(output_dir, writer)
            if age is not None and age > heartbeat_timeout:
                raise WriterDead(
                    f"gave up waiting for {what}: {writer} heartbeat is {age:.0f}s old "
                    f"(> heartbeat_timeout {heartbeat_timeout:.0f}s); is the {writer} process alive?"
                )
        time.sleep(delay)
        delay = min(delay * 1.5, max_poll)
    return time.monotonic() - start


def wait_for_rank_file(output_dir: Path, step: int, rank: int, timeout: float, heartbeat_timeout: float) -> Path:
    path = rank_file(output_dir, step, rank)
    wait_until(
        path.is_file,
        f"rollouts for step {step} ({path})",
        timeout,
        output_dir=output_dir,
        writer="orchestrator",
        heartbeat_timeout=heartbeat_timeout,
    )
    return path


def wait_for_weights(output_dir: Path, step: int, timeout: float, heartbeat_timeout: float) -> Path:
    path = weights_dir(output_dir, step)
    wait_until(
        lambda: is_stable(path),
        f"weights of step {step} ({path}/STABLE)",
        timeout,
        output_dir=output_dir,
        writer="trainer-rank0",
        heartbeat_timeout=heartbeat_timeout,
    )
    return path
