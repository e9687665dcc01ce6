"""One run per output dir: a lock per role (`run/orchestrator.lock`, `run/trainer.lock`, `run/sft.lock`).

A second orchestrator or trainer on a live run's dir would clear its rollouts and weights or interleave its
steps with the live ones; it is refused with a message naming the holder. The holder refreshes its lock
every few seconds; a lock whose process is gone (same host) or whose refresh is older than `stale_after`
(other hosts, e.g. a node that died) is taken over. `rl` takes the locks of its services up front and hands
them a token (env `RL_RUN_LOCK_TOKEN`) with which its own children join them instead of being refused.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path

from prime_rl.protocol.files import atomic_write_json
from prime_rl.protocol.paths import run_dir

TOKEN_VAR = "RL_RUN_LOCK_TOKEN"


class RunLocked(RuntimeError):
    """Another live process holds this role's lock on the output dir."""


class RunLock:
    """`with RunLock(output_dir, "orchestrator"):` holds the role's lock for the block, or raises RunLocked."""

    def __init__(self, output_dir: Path, role: str, token: str | None = None, interval: float = 5.0,
                 stale_after: float = 60.0):  # fmt: skip
        self.path = run_dir(output_dir) / f"{role}.lock"
        self.role, self.interval, self.stale_after = role, interval, stale_after
        # A child of `rl` joins its lock with the token in its environment; anyone else gets a fresh one.
        self.token = token or os.environ.get(TOKEN_VAR) or secrets.token_hex(8)
        self.joined = False  # a child of the holder (same token): it neither refreshes nor removes the lock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def record(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname(), "started": self._started, "time": time.time(),
                "token": self.token}  # fmt: skip

    def acquire(self) -> RunLock:
        self._started = time.strftime("%Y-%m-%d %H:%M:%S")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None and self._age() < self.stale_after:
                    holder = {"pid": "?", "host": "?", "started": "just now"}  # being written by its taker
                elif holder is not None and holder.get("token") == self.token:
                    self.joined = True
                    return self
                if holder is not None and (holder["pid"] == "?" or self._live(holder)):
                    raise RunLocked(
                        f"{self.path.parent.parent} is in use: its {self.role} runs as pid {holder.get('pid')} on "
                        f"{holder.get('host')} since {holder.get('started')} (lock {self.path}); stop that run or "
                        f"use another output dir"
                    ) from None
                self.path.unlink(missing_ok=True)  # stale: its holder is gone
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.record(), f)
            self._thread = threading.Thread(target=self._refresh, name=f"lock-{self.role}", daemon=True)
            self._thread.start()
            return self
        raise RunLocked(f"could not take {self.path}: another process keeps taking it")

    def release(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=self.interval + 1)
        holder = self._holder()
        if holder is not None and holder.get("token") == self.token:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _holder(self) -> dict | None:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else None
        except (OSError, ValueError):
            return None  # unreadable or half-written: judged by its age below

    def _age(self) -> float:
        try:
            return time.time() - self.path.stat().st_mtime
        except OSError:
            return float("inf")

    def _live(self, holder: dict) -> bool:
        if holder.get("host") == socket.gethostname():
            try:
                os.kill(int(holder["pid"]), 0)
                return True
            except (ProcessLookupError, KeyError, TypeError, ValueError):
                return False
            except PermissionError:
                return True  # someone else's live process
        try:
            return time.time() - float(holder["time"]) < self.stale_after
        except (KeyError, TypeError, ValueError):
            return False

    def _refresh(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                atomic_write_json(self.path, self.record())
            except OSError:
                pass  # a transient filesystem hiccup; the next refresh retries
