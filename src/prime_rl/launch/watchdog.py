"""Hang detection for `rl`: a service that is alive but does nothing is named, so it can be replaced like a death.

A stuck NCCL call, an NFS stall, a deadlocked engine or a SIGSTOPped process never exits: watching exit codes
alone, a run waits on it until some timeout far away (or forever). Here:
- the inference server must answer `/health` (probed from a thread, every 2 s, 5 s per try);
- the orchestrator and every trainer rank must advance their heartbeat's progress stamp
  (`protocol.liveness`), which the thread doing the work writes, not a side thread.
A service is hung after `hang_timeout` seconds of silence in ordinary work, 3x that in long work (loading a
model, writing a checkpoint: the heartbeat says which) and before its first beat or health answer.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from prime_rl.protocol.liveness import LONG, read_beat
from prime_rl.utils.net import probe_client


class Watchdog:
    def __init__(self, output_dir: Path, run_id: str, hang_timeout: float, health_url: str, trainer_ranks: int):
        self.output_dir, self.run_id, self.hang = output_dir, run_id, hang_timeout
        self.health_url, self.trainer_ranks = health_url, trainer_ranks
        self.healthy_at: dict[int, float] = {}  # inference pid -> when it last answered /health
        self._stop = threading.Event()
        self._probe = threading.Thread(target=self._probe_health, name="health-probe", daemon=True)
        self._inference_pid: int | None = None

    def __enter__(self) -> Watchdog:
        self._probe.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def _probe_health(self) -> None:
        import httpx

        with probe_client(timeout=5) as client:
            while not self._stop.wait(2.0):
                pid = self._inference_pid
                if pid is None:
                    continue
                try:
                    if client.get(self.health_url).status_code == 200:
                        self.healthy_at[pid] = time.time()
                except httpx.HTTPError:
                    pass

    def hung(self, service) -> str | None:
        """Why `service` (alive) counts as hung, or None; marks `service.worked` once it did a unit of work."""
        now = time.time()
        since_start = now - service.started
        if service.name == "teacher":
            return None  # a teacher server is watched for its death only (its /health is not polled)
        if service.name == "inference":
            self._inference_pid = service.proc.pid
            last = self.healthy_at.get(service.proc.pid)
            if last is None:
                if since_start > LONG * self.hang:
                    return f"not healthy {since_start:.0f}s after its start (> {LONG} x --hang-timeout)"
                return None
            service.worked = True
            if now - last > self.hang:
                return f"/health has not answered for {now - last:.0f}s (> --hang-timeout {self.hang:.0f}s)"
            return None
        names = (
            ["orchestrator"]
            if service.name == "orchestrator"
            else [f"trainer-rank{r}" for r in range(self.trainer_ranks)]
        )
        for name in names:
            beat = read_beat(self.output_dir, name)
            if beat is None or beat.run != self.run_id or beat.started < service.started - 1:
                if since_start > LONG * self.hang:  # not beating since this process started
                    return f"no heartbeat from {name} {since_start:.0f}s after its start (> {LONG} x --hang-timeout)"
                continue
            service.worked = service.worked or beat.units > 0
            bound = LONG * self.hang if beat.long else self.hang
            if beat.silence > bound:
                return f"{name} made no progress for {beat.silence:.0f}s while {beat.doing} (> {bound:.0f}s)"
        return None
