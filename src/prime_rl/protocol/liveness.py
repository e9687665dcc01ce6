"""Liveness: a service's heartbeat file, and how a peer or the launcher reads it (docs/design.md §2).

`heartbeat/{name}.json` holds {"pid","host","run","started","time","progress","doing","long","units","step"}:
- `time`: written every `interval` s by a side thread: the process is alive (a SIGSTOPped or swapped-out one
  stops writing). Peers waiting on it judge this (`Beat.age`).
- `progress`: when the thread that does the work last called `stamp()` (every wait poll, micro-batch, step,
  event-loop tick). A side thread that ticks while the work is stuck cannot fake it: the launcher judges a
  service hung on this (`Beat.silence`), by a bound that follows `doing`: ordinary work, or `long` work such
  as loading a model or writing a checkpoint.
- `run`, `started`: which run (the launcher's PRIME_RUN_ID) and process wrote it, so a beat an earlier run
  left in a used output dir never counts against this one.
- `units`: steps finished by this process: one that dies before its first is crash-looping, not unlucky.
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import logging
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prime_rl.protocol.files import atomic_write_json
from prime_rl.protocol.paths import heartbeat_file

HUNG = 5  # exit status of a service that found itself hung (`Heartbeat(hang_timeout=...)`)
LONG = 3  # long work (a model load, a checkpoint) may be silent this many times the hang bound
RUN_VAR = "PRIME_RUN_ID"  # set by `rl` for its services: the run a heartbeat belongs to
STARTED = time.time()  # when this process started (close enough: when the protocol was imported)

logger = logging.getLogger("prime_rl")
_progress = {"time": time.time(), "doing": "working", "long": False}
# Set when what the work is doing changes: the heartbeat is written at once (a file that still says "long
# work" after it ended would give a process stopped just then the long bound), not at the next interval.
_changed = threading.Event()


def progress() -> dict:
    """What the work is doing (`doing`, `long`) and when it last advanced (`time`)."""
    return dict(_progress)


def stamp() -> None:
    """Called by the thread that does the work whenever it advances (cheap: one clock read)."""
    _progress["time"] = time.time()


@contextmanager
def doing(what: str, long: bool = False):
    """Label the work for the heartbeat; `long` work (model load, checkpoint) gets the longer hang bound."""
    before = dict(_progress)
    _progress.update(doing=what, long=long, time=time.time())
    _changed.set()
    try:
        yield
    finally:
        _progress.update(doing=before["doing"], long=before["long"], time=time.time())
        _changed.set()


@contextmanager
def ticking(interval: float = 1.0):
    """In an event loop that does the work: stamp progress on every tick of it (a blocked loop stops)."""

    async def tick() -> None:
        while True:
            stamp()
            await asyncio.sleep(interval)

    task = asyncio.get_running_loop().create_task(tick())
    try:
        yield
    finally:
        task.cancel()


class Heartbeat:
    """Refreshes `heartbeat/{name}.json` every `interval` seconds from a side thread; `step`/`finished()` say
    what the work has done.

    `hang_timeout` (services no `rl` watches: panes, multi-node Slurm): after that long without progress (3x
    in long work) the process logs every thread's stack and exits HUNG, so a deadlock (a stuck collective, an
    NFS stall) ends the job, or lets its peers and the job script see it, instead of holding it forever."""

    def __init__(self, output_dir: Path, name: str, interval: float = 2.0, hang_timeout: float | None = None):
        self.path, self.name = heartbeat_file(output_dir, name), name
        self.interval, self.hang_timeout = interval, hang_timeout
        self.step = 0
        self.units = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{name}", daemon=True)

    def finished(self, step: int) -> None:
        """A unit of work (a step) is done."""
        self.step, self.units = step + 1, self.units + 1
        stamp()
        _changed.set()

    def beat(self) -> None:
        atomic_write_json(
            self.path,
            {
                "pid": os.getpid(), "host": socket.gethostname(), "run": os.environ.get(RUN_VAR),
                "started": STARTED, "time": time.time(), "progress": _progress["time"],
                "doing": _progress["doing"], "long": _progress["long"], "units": self.units, "step": self.step,
            },
        )  # fmt: skip

    def _run(self) -> None:
        while True:
            _changed.wait(self.interval)
            _changed.clear()
            if self._stop.is_set():
                return
            try:
                self.beat()
            except OSError:
                pass  # a transient filesystem hiccup must not kill the service; the next beat retries
            if self.hang_timeout is not None:
                self._exit_if_hung(self.hang_timeout * (LONG if _progress["long"] else 1))

    def _exit_if_hung(self, bound: float) -> None:
        silence = time.time() - _progress["time"]
        if silence <= bound:
            return
        logger.error(
            f"{self.name} made no progress for {silence:.0f}s while {_progress['doing']} (> {bound:.0f}s, "
            f"hang_timeout): exiting with status {HUNG}; where every thread was:"
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(HUNG)

    def __enter__(self) -> Heartbeat:
        stamp()
        self.beat()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        _changed.set()
        self._thread.join(timeout=self.interval + 1)
        try:
            self.beat()  # the last word: what it finished
        except OSError:
            pass


@dataclass(frozen=True)
class Beat:
    """One read of a heartbeat file."""

    pid: int
    run: str | None
    started: float
    time: float
    progress: float
    doing: str
    long: bool
    units: int

    @property
    def age(self) -> float:
        """Seconds since the process last showed it is alive."""
        return time.time() - self.time

    @property
    def silence(self) -> float:
        """Seconds since its work last advanced (a stopped process advances nothing either)."""
        return time.time() - min(self.time, self.progress)

    def of_this_run(self, since: float = STARTED) -> bool:
        """Written by this run: the launcher's run id where there is one; else (services started by hand)
        beating since `since` (this process's start), so an earlier run's beat is never judged."""
        run = os.environ.get(RUN_VAR)
        return self.run == run if run else self.time >= since


def read_beat(output_dir: Path, name: str) -> Beat | None:
    """The heartbeat `name` last wrote, or None if there is none (or it is unreadable)."""
    try:
        d = json.loads(heartbeat_file(output_dir, name).read_text())
        t = float(d["time"])
        return Beat(
            int(d.get("pid", 0)), d.get("run"), float(d.get("started", t)), t, float(d.get("progress", t)),
            str(d.get("doing", "")), bool(d.get("long", False)), int(d.get("units", 0)),
        )  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError):
        return None


def heartbeat_age(output_dir: Path, name: str) -> float | None:
    """Seconds since `name` last beat, or None if it never did."""
    beat = read_beat(output_dir, name)
    return None if beat is None else beat.age
