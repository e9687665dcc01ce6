"""The inference servers' own numbers (their Prometheus `GET /metrics`) for the run's W&B run, as `inference/*`.

Both backends answer /metrics: the built-in engine with `prime_rl_inference_*` (inference/metrics.py), vLLM with
`vllm:*`. While the orchestrator runs, `ServerMetrics` reads every live server's about once a second in the
background: a read never holds up a step, and gauges read only at a step's end would miss its generation (in
barrier mode the servers are idle by then). `take()`, once per step, gives what was read since the last call:

- `requests_running`, `requests_waiting`: averaged over each server's reads in the step, summed over the servers
- `kv_cache_usage`: the fraction of the KV cache in use (vLLM's), averaged over the reads and the servers
- `generated_tokens`: the servers' total; `generated_tokens_per_s`: its growth per second since the last take
- `batch_capacity`: the built-in engines' batch rows (`engine.max_batch_size`), summed over the servers
- `servers`: how many servers' /metrics answered in the step

Each read also goes to the server's in-flight limiter (`Server.slots.observe`): with adaptive concurrency it is
the load signal the limit follows (concurrency.py), and the limiter then skips a read of its own.

A server without /metrics, or one that does not answer within a second, is left out (a warning, once per server).
"""

from __future__ import annotations

import asyncio
import logging
import time
from statistics import fmean
from typing import TYPE_CHECKING

from prime_rl.orchestrator.servers.prometheus import SERIES

if TYPE_CHECKING:
    from prime_rl.orchestrator.servers.client import InferenceClient
    from prime_rl.orchestrator.servers.pool import Server

logger = logging.getLogger("prime_rl")

INTERVAL = 1.0  # seconds between reads
TIMEOUT = 1.0  # seconds a server gets to answer one read


class ServerMetrics:
    """`async with ServerMetrics(client) as servers:` reads the live servers' /metrics in the background, each
    server on its own (a slow one delays no other's numbers); `servers.take()` once per step."""

    def __init__(self, client: InferenceClient, interval: float = INTERVAL, timeout: float = TIMEOUT):
        self.client, self.interval, self.timeout = client, interval, timeout
        self.reads: dict[str, list[dict[str, float]]] = {}  # server -> its reads since the last take
        self.totals: dict[str, float] = {}  # newest generated-token total per server
        self.counted: dict[str, float] = {}  # the totals the last take counted up to
        self.since: float | None = None  # when the last take's newest read was (first: the first read)
        self.newest = 0.0  # when the newest read was
        self.warned: set[str] = set()
        self.tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> ServerMetrics:
        self.tasks = [asyncio.create_task(self._poll(server)) for server in self.client.pool.servers]
        return self

    async def __aexit__(self, *exc) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _poll(self, server: Server) -> None:
        while True:
            if server.alive:  # a server taken out of the pool is read again once it rejoins
                await self.read(server)
            await asyncio.sleep(self.interval)

    async def read(self, server: Server) -> None:
        try:
            values = await self.client.pool.read_metrics(server, self.timeout)
        except Exception as e:  # whatever a server answers, the run goes on without its numbers
            if server.base not in self.warned:
                self.warned.add(server.base)
                problem = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                logger.warning(
                    f"inference server {server.base} gave no /metrics ({problem}); its numbers are left out of "
                    "W&B's inference/* (said once)"
                )
            return
        server.slots.observe(values)
        self.newest = time.monotonic()
        if self.since is None:
            self.since = self.newest
        self.reads.setdefault(server.base, []).append(values)
        if (total := values.get("generated_tokens")) is not None:
            self.totals[server.base] = total
            self.counted.setdefault(server.base, total)  # a server's count starts at its first read

    def take(self) -> dict[str, float]:
        """The step's numbers: what was read since the last take ({} when nothing was)."""
        reads, self.reads = self.reads, {}
        if not reads:
            return {}
        out: dict[str, float] = {"servers": len(reads)}
        for series, (_, adds) in SERIES.items():
            per_server = [fmean(found) for rs in reads.values() if (found := [r[series] for r in rs if series in r])]
            if per_server and series != "generated_tokens":
                out[series] = sum(per_server) if adds else fmean(per_server)
        if self.totals:
            out["generated_tokens"] = sum(self.totals.values())
            # A restarted server counts from 0 again: all of its new total is new.
            new = sum(t - self.counted[b] if t >= self.counted[b] else t for b, t in self.totals.items())
            if self.newest > self.since:
                out["generated_tokens_per_s"] = new / (self.newest - self.since)
            self.counted, self.since = dict(self.totals), self.newest
        return out
