"""The inference server pool: who gets the next request, who is down, who may rejoin (DESIGN §4).

`client.base_url` lists one or more servers, optionally with `client.traffic_share`: shares 2,1,1 send
50/25/25% of the requests. Servers are picked by smooth weighted round-robin (nginx's), which hits the
shares exactly rather than on average: with shares a=2, b=1, c=1 every four requests go a, b, a, c. The
same rotation mixes environments by their `ratio` (orchestrator.EnvMix).

A server whose retries ran out is taken out (logged) and requests go to the live ones. The HTTP side
(`client.InferenceClient`) probes removed servers at every step's health check and when none is left,
and `rejoin`s one that answers, after giving it the weights the pool serves.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

logger = logging.getLogger("prime_rl")


class SmoothRoundRobin:
    """Picks among items with weights w_i so that every prefix of the picks is as close to the shares as
    integers allow: each pick adds w_i to every item's credit and takes the total off the chosen item's."""

    def __init__(self, weights: list[float]):
        if not weights or any(w <= 0 for w in weights):
            raise ValueError(f"weights must be positive, got {weights}")
        self.weights = [float(w) for w in weights]
        self.credit = [0.0] * len(weights)

    def pick(self, among: list[int] | None = None) -> int:
        """The next index (of those in `among`, default all)."""
        among = list(range(len(self.weights))) if among is None else among
        for i in among:
            self.credit[i] += self.weights[i]
        chosen = max(among, key=lambda i: self.credit[i])
        self.credit[chosen] -= sum(self.weights[i] for i in among)
        return chosen

    def reset(self, i: int) -> None:
        self.credit[i] = 0.0


@dataclass
class Server:
    base: str  # .../v1
    slots: asyncio.Semaphore
    step: int = 0  # the weight step it holds, from /health and /update_weights
    receivers: int = 0  # its seats in a weight broadcast group, from /health (0: it takes no broadcasts)
    group: str | None = None  # the broadcast group its weights came from, from /health
    alive: bool = True
    requests: int = 0  # generation requests sent (for metrics and tests)
    errors: list[str] = field(default_factory=list)


class ServerPool:
    def __init__(self, base_urls: list[str], traffic_share: list[float] | None, max_concurrency: int):
        self.servers = [Server(url.rstrip("/"), asyncio.Semaphore(max_concurrency)) for url in base_urls]
        self._rotation = SmoothRoundRobin(traffic_share or [1.0] * len(base_urls))

    @property
    def base_urls(self) -> list[str]:
        return [s.base for s in self.servers]

    @property
    def steps(self) -> dict[str, int]:
        """The weight step each server holds (stamped on every completion)."""
        return {s.base: s.step for s in self.servers}

    def live(self) -> list[Server]:
        return [s for s in self.servers if s.alive]

    def pick(self) -> Server | None:
        """The next live server in the rotation; None when none is live."""
        among = [i for i, s in enumerate(self.servers) if s.alive]
        return self.servers[self._rotation.pick(among)] if among else None

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
        logger.info(f"inference server {server.base} answers again; back in the pool (step {server.step})")
