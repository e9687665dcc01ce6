"""The inference server pool: who gets the next request, who is down, who may rejoin (docs/design.md §4).

`client.base_url` lists one or more servers, optionally with `client.traffic_share`: shares 2,1,1 send
50/25/25% of the requests. Servers are picked by smooth weighted round-robin (nginx's, utils/round_robin.py),
which hits the shares exactly rather than on average: with shares a=2, b=1, c=1 every four requests go a, b, a,
c. The same rotation mixes environments by their `ratio` (batch.EnvMix).

A server whose retries ran out is taken out (logged) and requests go to the live ones. The pool waits for
every server at the start (`wait_for_servers`) and reads their /health; probing removed servers, and letting
one that answers `rejoin` once it holds the pool's weights, is the facade's (servers.Servers: `server_step`,
`revive`), which owns both the pool and the weight control. Servers added mid-run (`resize`, from fleet.py's
file) come in as removed ones that have not answered yet.

The HTTP goes through `http.Http`: `request` with retries (ServerDown when a server's run out), `client` for
single quick tries.

Each server's requests in flight are bounded by its `slots` (concurrency.Limiter): `client.max_concurrency`
with `client.concurrency = "fixed"`; with `"adaptive"` a limit between `client.min_concurrency` and
`client.max_concurrency` that follows the server's own load (its /metrics; the rule is in concurrency.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx

from prime_rl.configs.orchestrator import ClientConfig, FleetConfig
from prime_rl.orchestrator.servers.concurrency import AIMD, Limiter
from prime_rl.orchestrator.servers.http import Http, InferenceError
from prime_rl.orchestrator.servers.prometheus import parse_metrics
from prime_rl.utils.round_robin import SmoothRoundRobin

logger = logging.getLogger("prime_rl")

PROBE_TIMEOUT = 2.0  # seconds a removed server gets to answer /health at a step start


def server_root(base_url: str) -> str:
    """`http://host:8000/v1` → `http://host:8000` (where /health and /update_weights live)."""
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def server_url(server: Server, path: str) -> str:
    """Where `path` lives on `server`: under its base (`/chat/completions` → .../v1/chat/completions), or, for
    the token-in/token-out route, at its root (`/inference/v1/generate`)."""
    return f"{server_root(server.base)}{path}" if path.startswith("/inference/") else f"{server.base}{path}"


def server_name(server: Server) -> str:
    """`host:port` of a server (its metric key)."""
    return server_root(server.base).split("://", 1)[-1]


@dataclass
class Server:
    base: str  # .../v1
    slots: Limiter  # its requests in flight
    step: int = 0  # the weight step it holds, from /health and /update_weights
    receivers: int = 0  # its seats in a weight broadcast group, from /health (0: it takes no broadcasts)
    group: str | None = None  # the broadcast group its weights came from, from /health
    checksum: str | None = None  # the weight checksum of what it loaded (protocol.parity), from /health and updates
    alive: bool = True
    benched: str | None = None  # why it gets no requests while alive (its weights are too old: WeightControl.restore)
    requests: int = 0  # generation requests sent (for metrics and tests)
    errors: list[str] = field(default_factory=list)


class ServerPool:
    def __init__(self, config: ClientConfig, http: Http):
        self.config = config
        self.servers = [self._new(url) for url in config.base_url]
        self._rotation = SmoothRoundRobin(config.traffic_share or [1.0] * len(config.base_url))
        self.http = http

    def _new(self, url: str, alive: bool = True) -> Server:
        server = Server(url.rstrip("/"), Limiter(self.config.max_concurrency), alive=alive)
        if self.config.concurrency == "adaptive":
            server.slots = self._adaptive(server)
        return server

    def resize(self, fleet: FleetConfig) -> None:
        """The pool holds `fleet`'s servers from now on (fleet.py): one it did not hold comes in taken out, to
        rejoin once it answers /health and holds the pool's weights (the facade's probe); one it no longer lists
        gets no more requests (its requests in flight finish)."""
        held = {s.base: s for s in self.servers}
        urls = [url.rstrip("/") for url in fleet.base_url]
        added = [url for url in urls if url not in held]
        removed = [base for base in held if base not in urls]
        for base in removed:
            held[base].alive = False
        self.servers = [held.get(url) or self._new(url, alive=False) for url in urls]
        self._rotation = SmoothRoundRobin(fleet.traffic_share or [1.0] * len(urls))
        if added or removed:
            logger.info(f"inference servers added: {added or 'none'}, removed: {removed or 'none'}; pool: {urls}")

    @property
    def base_urls(self) -> list[str]:
        return [s.base for s in self.servers]

    @property
    def steps(self) -> dict[str, int]:
        """The weight step each server holds (stamped on every completion)."""
        return {s.base: s.step for s in self.servers}

    def _adaptive(self, server: Server) -> Limiter:
        floor = min(self.config.min_concurrency, self.config.max_concurrency)

        async def read() -> dict[str, float]:
            return await self.read_metrics(server, 1.0)

        return Limiter(floor, AIMD(floor, self.config.max_concurrency), read, name=f"inference server {server.base}")

    async def read_metrics(self, server: Server, timeout: float) -> dict[str, float]:
        """One quick GET of a server's Prometheus /metrics (no retries, no slot: it must never hold up generation),
        parsed into prometheus.SERIES; raises httpx.HTTPError when it does not answer 200."""
        response = await self.http.client.get(f"{server_root(server.base)}/metrics", timeout=timeout)
        response.raise_for_status()
        return parse_metrics(response.text)

    def take_inflight(self) -> dict[str, float]:
        """Per server, since the last call: `inflight_limit/<host:port>` and `inflight/<host:port>`, the
        time-weighted means of its in-flight limit and of its requests in flight (the step's numbers)."""
        out = {}
        for server in self.servers:
            limit, inflight = server.slots.take()
            out |= {f"inflight_limit/{server_name(server)}": limit, f"inflight/{server_name(server)}": inflight}
        return out

    def live(self) -> list[Server]:
        return [s for s in self.servers if s.alive]

    def pick(self) -> Server | None:
        """The next live, unbenched server in the rotation; None when there is none."""
        among = [i for i, s in enumerate(self.servers) if s.alive and s.benched is None]
        return self.servers[self._rotation.pick(among)] if among else None

    def none_usable(self) -> str:
        """Why `pick` found no server: the benched ones' reasons, or that every server was taken out."""
        benched = [s.benched for s in self.live() if s.benched is not None]
        if not benched:
            return f"no live inference server left (all of {self.base_urls} were taken out)"
        return (
            f"no inference server can serve this step: {'; '.join(benched)}; with weight_transfer = broadcast a "
            "restarted server gets weights at the next step's broadcast: resume the run from its checkpoint "
            "(--ckpt.resume-step latest; `rl --restart` does), or run more servers"
        )

    def take_out(self, server: Server, problem: str) -> None:
        if server.alive:
            server.alive = False
            server.errors.append(problem)
            left = [s.base for s in self.live()]
            logger.warning(
                f"inference server {server.base} is down, taking it out of the pool ({problem}); left: {left}"
            )

    def rejoin(self, server: Server) -> None:
        server.alive = True
        self._rotation.reset(self.servers.index(server))
        logger.info(f"inference server {server.base} answers /health; in the pool (weight step {server.step})")

    # ---- health -----------------------------------------------------------------------------------

    async def health(self, server: Server) -> int:
        """A live server's /health (with retries): its weight step, broadcast seats and group."""
        self._record(server, await self.http.request("GET", f"{server_root(server.base)}/health"))
        return server.step

    @staticmethod
    def _record(server: Server, health: dict) -> None:
        """What a server's /health says: the weight step it holds, its broadcast seats and group, its checksum."""
        server.step = int(health.get("step", 0))
        server.receivers = int(health.get("weight_receivers", 0))
        server.group = health.get("weight_group")
        server.checksum = health.get("checksum")

    async def wait_for_servers(self, timeout: float) -> dict[str, int]:
        """Poll every server's /health until all answer 200; return the weight step each holds."""
        deadline = time.monotonic() + timeout
        for server in self.servers:
            await self._wait_for(server, deadline, timeout)
            logger.info(f"inference server {server.base} is up (weight step {server.step})")
        return self.steps

    async def _wait_for(self, server: Server, deadline: float, timeout: float) -> None:
        url = f"{server_root(server.base)}/health"
        delay, next_note = 0.2, time.monotonic()
        while True:
            if (problem := await self.probe_health(server, min(10.0, self.config.timeout))) is None:
                return
            if time.monotonic() + delay > deadline:
                raise InferenceError(
                    f"inference server at {url} not ready after {timeout:.0f}s ({problem}); "
                    f"is it running and is client.base_url right?"
                )
            if time.monotonic() >= next_note:  # say what we wait for, then every 30 s, never silently
                left = deadline - time.monotonic()
                logger.info(f"waiting for the inference server at {url} ({problem}; giving up in {left:.0f}s)")
                next_note = time.monotonic() + 30
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.5)  # a local /health costs nothing: the run starts as soon as it answers

    async def probe_health(self, server: Server, timeout: float) -> str | None:
        """One GET /health: None when the server answers 200 (the weight step it holds is recorded), else what
        went wrong, for the log line or the error that names it."""
        try:
            response = await self.http.client.get(f"{server_root(server.base)}/health", timeout=timeout)
            if response.status_code != 200:
                return f"HTTP {response.status_code}"
            self._record(server, response.json())
        except (httpx.TransportError, ValueError) as e:
            return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return None
