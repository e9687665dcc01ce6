"""How many requests the orchestrator keeps in flight at each inference server (`client.concurrency`).

`Limiter` is a semaphore whose limit can change while requests run: lowering it cancels nothing, it only
admits fewer until enough running requests have finished. With `concurrency = "fixed"` the limit is
`client.max_concurrency` for good (a plain semaphore). With `"adaptive"` an `AIMD` controller moves it between
`client.min_concurrency` (the floor, also where it starts) and `client.max_concurrency` (the ceiling) from the
server's own load signal, its Prometheus /metrics: the built-in engine's `prime_rl_inference_waiting`,
`_running` and `_max_batch_size`, vLLM's `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`.

The aim is a full batch at the server with a short queue behind it: `queue = ceil(limit * QUEUE_SHARE)`
requests (at least 1), so a row that finishes is refilled at once rather than after a round trip to us (on
2 CPU cores a batch kept at exactly its rows made 29 % fewer tokens per second; docs/benchmarks.md,
"Adaptive concurrency"). The rule, at each read of the server's /metrics (about once a second while we
have requests there):

- queueing (more than `queue` requests waiting at the server, or its KV cache at least `KV_HIGH` full):
  multiplicative decrease, to what the server was evidently serving of ours (our in-flight minus its
  queue) plus `queue`, at least one less than now, at most halving, never below the floor; once per queue:
  while our in-flight is still above the lowered limit the queue it saw is draining and the limit holds;
- room (fewer than `queue` waiting, KV use under `KV_LOW`, and requests held back here since the last read,
  so more were there to send): increase, doubling until the first queueing (slow start), by one afterwards
  (additive), up to the ceiling and, where the server says its batch capacity (the built-in engine), to no
  more requests than its free rows and the short queue hold;
- otherwise the limit holds.

Beyond that short queue, queueing at the server buys no throughput (its batch is full either way) but
costs: a queued request's `client.timeout` runs while it waits, and it is bound to its server, which may be
slower than the one freeing up next. Held back here, it waits where nothing is spent yet.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

logger = logging.getLogger("prime_rl")

KV_HIGH = 0.9  # KV-cache use at which a server counts as queueing (vLLM preempts near full)
KV_LOW = 0.8  # KV-cache use under which it has room
BETA = 0.5  # the deepest one decrease goes: half the limit
QUEUE_SHARE = 0.125  # the queue kept at a server, as a share of the limit (at least 1 request)
INTERVAL = 1.0  # seconds between reads of a busy server's load


@dataclass(frozen=True)
class Load:
    """One read of a server's load: its queue, and where known its batch rows in use, its batch capacity (rows)
    and its KV-cache use (a fraction)."""

    waiting: float
    running: float | None = None
    capacity: float | None = None
    kv: float | None = None

    @classmethod
    def of(cls, values: dict[str, float]) -> Load | None:
        """From prometheus.parse_metrics' series; None when the read has no queue length."""
        if "requests_waiting" not in values:
            return None
        return cls(
            values["requests_waiting"],
            values.get("requests_running"),
            values.get("batch_capacity"),
            values.get("kv_cache_usage"),
        )


class AIMD:
    """The adaptive rule of this module's docstring, between `floor` and `ceiling`."""

    def __init__(self, floor: int, ceiling: int):
        self.floor, self.ceiling = min(floor, ceiling), ceiling
        self.slow_start = True

    def next_limit(self, limit: int, inflight: int, held: bool, load: Load) -> int:
        """The limit after a read: `inflight` is ours at the server now, `held` whether requests waited for a
        slot here since the last read."""
        queue = max(1, math.ceil(limit * QUEUE_SHARE))
        waiting = int(load.waiting)
        if waiting > queue or (load.kv is not None and load.kv >= KV_HIGH):
            self.slow_start = False
            if inflight > limit:  # the last decrease is still draining: the queue seen is partly its own
                return limit
            served = inflight - waiting
            return max(self.floor, min(limit - 1, max(math.ceil(limit * BETA), served + queue)))
        if not held or waiting >= queue or (load.kv is not None and load.kv >= KV_LOW):
            return limit  # nothing more to send, the short queue is there, or the KV cache is filling up
        step = limit if self.slow_start else 1
        if load.capacity is not None and load.running is not None:
            rows_per_request = max(load.running / max(inflight - waiting, 1), 1.0)
            step = min(step, int((load.capacity - load.running) / rows_per_request) + queue - waiting)
        return max(limit, min(self.ceiling, limit + step))


class Limiter:
    """`async with limiter:` around each request to one server; at most `limit` at once, first come first in.

    With a `controller` (adaptive) and a `read` of the server's /metrics (prometheus.parse_metrics' series),
    a task reads it every `interval` while requests are in flight or waiting here, unless someone else fed
    `observe` a read within the interval (metrics.ServerMetrics does when it runs); it stops when idle.
    `take()` gives the time-weighted means of the limit and the in-flight count since the last take.
    """

    def __init__(
        self,
        limit: int,
        controller: AIMD | None = None,
        read: Callable[[], Awaitable[dict[str, float]]] | None = None,
        name: str = "",
        interval: float = INTERVAL,
    ):
        self.limit, self.controller, self.name, self.interval = limit, controller, name, interval
        self._read = read
        self.inflight = 0
        self.held = False  # whether a request waited for a slot since the last read of the load
        self.load: Load | None = None  # the last read
        self._waiters: deque[asyncio.Future] = deque()
        self._watch: asyncio.Task | None = None
        self._observed = -math.inf  # when the last read came
        self._warned = False
        now = time.monotonic()
        self._t = self._since = now
        self._area_limit = self._area_inflight = 0.0

    @property
    def waiting(self) -> int:
        """Requests waiting here for a slot."""
        return sum(not f.done() for f in self._waiters)

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc) -> None:
        self.release()

    async def acquire(self) -> None:
        self._start_watch()
        if not self._waiters and self.inflight < self.limit:
            self._admit()
            return
        future = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        self.held = True
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():  # admitted as it was cancelled: the slot goes back
                self.release()
            elif future in self._waiters:
                self._waiters.remove(future)
            raise

    def release(self) -> None:
        self._tick()
        self.inflight -= 1
        self._wake()

    def set_limit(self, limit: int) -> None:
        """A new limit: a higher one admits waiters at once, a lower one admits none until in-flight is under it."""
        self._tick()
        self.limit = limit
        self._wake()

    def observe(self, values: dict[str, float]) -> None:
        """A read of the server's /metrics: the controller (if any) sets the next limit from it."""
        if (load := Load.of(values)) is None:
            return
        self.load, self._observed = load, time.monotonic()
        if self.controller is not None:
            limit = self.controller.next_limit(self.limit, self.inflight, self.held, load)
            if limit != self.limit:
                logger.debug(f"{self.name}: in-flight limit {self.limit} -> {limit} ({load}; ours {self.inflight})")
                self.set_limit(limit)
        self.held = bool(self._waiters)

    def take(self) -> tuple[float, float]:
        """(mean limit, mean in-flight) since the last take, weighted by time."""
        self._tick()
        span = self._t - self._since
        means = (self._area_limit / span, self._area_inflight / span) if span > 0 else (self.limit, self.inflight)
        self._since, self._area_limit, self._area_inflight = self._t, 0.0, 0.0
        return float(means[0]), float(means[1])

    def _admit(self) -> None:
        self._tick()
        self.inflight += 1

    def _wake(self) -> None:
        while self._waiters and self.inflight < self.limit:
            future = self._waiters.popleft()
            if not future.done():
                self._admit()
                future.set_result(None)

    def _tick(self) -> None:
        now = time.monotonic()
        self._area_limit += self.limit * (now - self._t)
        self._area_inflight += self.inflight * (now - self._t)
        self._t = now

    def _start_watch(self) -> None:
        if self.controller is not None and self._read is not None and (self._watch is None or self._watch.done()):
            self._watch = asyncio.get_running_loop().create_task(self._watch_load())

    async def _watch_load(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            if not self.inflight and not self._waiters:
                return  # idle: the next request starts another
            if time.monotonic() - self._observed < 0.9 * self.interval:
                continue  # someone else's read came in the meantime
            try:
                values = await self._read()
            except Exception as e:  # a server without /metrics keeps its limit; the requests go on
                if not self._warned:
                    self._warned = True
                    problem = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                    logger.warning(
                        f"adaptive concurrency: {self.name} gave no /metrics ({problem}); its in-flight limit "
                        f"stays at {self.limit} until it does (said once)"
                    )
                continue
            self.observe(values)
