"""Waiting on the other side of the protocol: prompt wake-ups, timeouts, the writer's heartbeat (liveness.py)
to tell slow from dead.

A waiter learns that what it waits for exists within milliseconds: on Linux it sleeps on inotify events in
the directories where the file will appear (from the deepest that exists: the step dir itself may not
exist yet), and it re-checks every `poll` seconds regardless, for filesystems where another host's writes
raise no local event (NFS, Lustre) and platforms without inotify. A check is one `stat`, so a 10 ms poll
costs nothing measurable; the heartbeat file is read once a second.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from prime_rl.protocol.files import is_stable
from prime_rl.protocol.liveness import read_beat, stamp
from prime_rl.protocol.paths import rank_file, weights_dir
from prime_rl.protocol.stop import StopRequested, stop_requested

logger = logging.getLogger("prime_rl")


class WaitTimeout(TimeoutError):
    """What we waited for did not appear in time."""


class WriterDead(RuntimeError):
    """The process that should produce what we wait for stopped refreshing its heartbeat; `writer` names it."""

    def __init__(self, writer: str, message: str):
        self.writer = writer
        super().__init__(message)


class DirWatch:
    """Sleeps until an entry of the watched directories is created, renamed in, written or touched (Linux
    inotify), or the timeout passes; where inotify is unavailable it just sleeps."""

    # IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE
    MASK = 0x004 | 0x008 | 0x080 | 0x100
    _libc = None

    def __init__(self) -> None:
        self.fd = -1
        if DirWatch._libc is None:
            name = ctypes.util.find_library("c")
            DirWatch._libc = ctypes.CDLL(name, use_errno=True) if name else False
        if DirWatch._libc and hasattr(DirWatch._libc, "inotify_init1"):
            self.fd = DirWatch._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)

    def add(self, dirs: Iterable[Path]) -> None:
        """Watch those of `dirs` that exist now (call again as they appear: adding a watched dir again is a
        no-op, and a dir deleted and made again needs a new watch)."""
        if self.fd < 0:
            return
        for d in dirs:
            DirWatch._libc.inotify_add_watch(self.fd, os.fsencode(d), self.MASK)  # -1 while d does not exist

    def sleep(self, timeout: float) -> None:
        if self.fd < 0:
            time.sleep(timeout)
            return
        if select.select([self.fd], [], [], timeout)[0]:
            try:
                while os.read(self.fd, 65536):
                    pass
            except BlockingIOError:
                pass  # drained

    @classmethod
    def for_this_thread(cls) -> DirWatch:
        """One per thread for the process's life: closing an inotify fd waits for the kernel to retire its
        watches (~10-20 ms, on the hot path of every hand-off); watches of deleted dirs go by themselves."""
        watcher = getattr(_watchers, "watcher", None)
        if watcher is None:
            watcher = _watchers.watcher = cls()
        return watcher


_watchers = threading.local()


def _checks(
    ready: Callable[[], bool],
    what: str,
    timeout: float,
    output_dir: Path | None,
    writer: str | None,
    heartbeat_timeout: float,
    note_every: float,
    before_check: Callable[[], None] = lambda: None,
) -> Iterator[None]:
    """The waiting loop without its sleep: yields when the caller should sleep, ends when `ready()`."""
    start = time.monotonic()
    next_note, next_heartbeat = note_every, 0.0
    while True:
        before_check()
        if ready():
            return
        if signal_name := stop_requested():
            raise StopRequested(f"{signal_name} received while waiting for {what}")
        waited = time.monotonic() - start
        if waited >= next_note:
            logger.info(f"still waiting for {what} ({waited:.0f}s of {timeout:.0f}s)")
            next_note += note_every
        if waited > timeout:
            raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}")
        if writer is not None and output_dir is not None and waited >= next_heartbeat:
            next_heartbeat = waited + 1.0
            beat = read_beat(output_dir, writer)
            # Only a beat of this run counts: one an earlier run left (a used output dir) means the writer
            # has not started yet, and the wait's own timeout bounds that. And only the silence this wait
            # has seen itself: a writer restarted meanwhile beats again within seconds of its start.
            if beat is not None and beat.of_this_run() and min(beat.age, waited) > heartbeat_timeout:
                raise WriterDead(
                    writer,
                    f"gave up waiting for {what}: {writer} heartbeat is {beat.age:.0f}s old "
                    f"(> heartbeat_timeout {heartbeat_timeout:.0f}s); is the {writer} process alive?",
                )
        stamp()  # waiting is this thread's work: it is not hung
        yield


def wait_until(
    ready: Callable[[], bool],
    what: str,
    timeout: float,
    *,
    watch: Path | None = None,
    output_dir: Path | None = None,
    writer: str | None = None,
    heartbeat_timeout: float = 60.0,
    poll: float = 0.01,
    note_every: float = 30.0,
) -> float:
    """Wait until `ready()`; return seconds waited. Raise WaitTimeout / WriterDead naming `what`.

    `watch`: the path whose appearance makes `ready()` true, to wake on its directories' events. A wait
    longer than `note_every` seconds is logged then and every `note_every` seconds after, so a long wait is
    never silent.
    """
    start = time.monotonic()
    # The target's directories down from the deepest one that exists now (a step dir appears later).
    dirs = list(watch.parents)[: next((i + 1 for i, d in enumerate(watch.parents) if d.is_dir()), 0)] if watch else []
    watcher = DirWatch.for_this_thread()
    # Watch before each check: an event between the two would otherwise be missed.
    checks = _checks(ready, what, timeout, output_dir, writer, heartbeat_timeout, note_every, lambda: watcher.add(dirs))
    for _ in checks:
        watcher.sleep(poll)
    return time.monotonic() - start


async def wait_until_async(
    ready: Callable[[], bool],
    what: str,
    timeout: float,
    *,
    output_dir: Path | None = None,
    writer: str | None = None,
    heartbeat_timeout: float = 60.0,
    poll: float = 0.01,
    note_every: float = 30.0,
) -> float:
    """`wait_until` for an event loop that must keep serving other tasks meanwhile (the orchestrator's
    requests): polls every `poll` seconds (a `stat` each) instead of sleeping on inotify."""
    start = time.monotonic()
    for _ in _checks(ready, what, timeout, output_dir, writer, heartbeat_timeout, note_every):
        await asyncio.sleep(poll)
    return time.monotonic() - start


def wait_for_rank_file(output_dir: Path, step: int, rank: int, timeout: float, heartbeat_timeout: float) -> Path:
    path = rank_file(output_dir, step, rank)
    wait_until(
        path.is_file,
        f"rollouts for step {step} ({path})",
        timeout,
        watch=path,
        output_dir=output_dir,
        writer="orchestrator",
        heartbeat_timeout=heartbeat_timeout,
    )
    return path


async def wait_for_weights(output_dir: Path, step: int, timeout: float, heartbeat_timeout: float) -> Path:
    path = weights_dir(output_dir, step)
    await wait_until_async(
        lambda: is_stable(path),
        f"weights of step {step} ({path}/STABLE)",
        timeout,
        output_dir=output_dir,
        writer="trainer-rank0",
        heartbeat_timeout=heartbeat_timeout,
    )
    return path
