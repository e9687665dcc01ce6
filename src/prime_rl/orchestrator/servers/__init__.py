"""The inference servers as the orchestrator sees them (docs/design.md §4). `Servers` owns the HTTP (http.py),
the pool (pool.py: who gets the next request, who is down) and the weight control (weights.py: which weights
they serve), and is the one place that joins them; `client.InferenceClient` (what is asked, how the answers
are read) sends through it, and the pool and the weight control call neither it nor each other back.

- A request goes to the next usable server. One found down (ServerDown: its retries ran out) is taken out and
  the request goes to another live one; with none left, `revive` waits up to `client.health_timeout` for one to
  answer /health again and gives it the pool's weights before it rejoins.
- An answer sampled from weights older than the floor (`weights.floor`, the oldest policy the current step may
  use) is a `StaleAnswer` (e.g. a server that restarted since its update): it is thrown away, its server
  restored (WeightControl.restore: weights of a step >= the floor loaded onto it, or benched) and the request
  asked again, on another server if it was benched; the STALE_ANSWERS-th such answer fails the request, naming
  the servers and their steps. One older than an update it ran across (an eval's, say) is asked again without a
  restore or a count.
- Weight updates and broadcasts go to every live server; the pool is revived when none is left.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import httpx

from prime_rl.configs.orchestrator import ClientConfig
from prime_rl.orchestrator.servers.fleet import FleetFile
from prime_rl.orchestrator.servers.http import Http, InferenceError, ServerDown
from prime_rl.orchestrator.servers.pool import PROBE_TIMEOUT, Server, ServerPool, server_url
from prime_rl.orchestrator.servers.weights import WeightControl
from prime_rl.protocol.http import weight_step as weight_step_of

logger = logging.getLogger("prime_rl")

# A request fails at its STALE_ANSWERS-th answer from below the floor; each earlier one is followed by a restore of
# its server (a /health and at most two weight loads, each within client.timeout): a bound in attempts and seconds.
STALE_ANSWERS = 3


class StaleAnswer(Exception):
    """`server` answered from weight step `step`, older than the floor: the answer is thrown away."""

    def __init__(self, server: Server, step: int):
        super().__init__(f"{server.base} step {step}")
        self.server, self.step = server, step


class Servers:
    """The pool of inference servers, the weights they serve and the HTTP to them (module docstring).

    `model` is the base model's served name, `adapter` the LoRA adapter's (model.lora.name; None: full
    weights); `inflight` what weight updates ask of requests in flight (weights.inflight_ask); `output_dir` the
    run's, whose weights/step_k restore a server that answered from below the floor."""

    def __init__(
        self,
        config: ClientConfig,
        model: str,
        adapter: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        inflight: str | None = None,
        output_dir: Path | None = None,
        fleet: FleetFile | None = None,
    ):
        self.config, self.model, self.adapter = config, model, adapter
        self.http = Http(config, transport)
        self.pool = ServerPool(config, self.http)
        self.weights = WeightControl(self.pool, self.http, inflight, output_dir)
        self.fleet = fleet  # the run's run/servers.json: servers added and removed while it goes on
        self._revival = asyncio.Lock()

    async def close(self) -> None:
        await self.http.close()

    @property
    def request_model(self) -> str:
        """The model requests name: the LoRA adapter once the pool serves one, else the base model. Chosen at each
        attempt, so a request asked again after its server got the pool's weights names what that server holds."""
        return self.adapter if self.adapter is not None and self.weights.weight_dir is not None else self.model

    # ---- requests ---------------------------------------------------------------------------------

    async def generate(self, path: str, body: dict) -> tuple[Server, dict, int | None]:
        """POST `body` to the next usable server until one answers from weights at or above the floor (module
        docstring): that server, its JSON answer and the weight step it reported (None: it reported none)."""
        stale: list[str] = []  # the answers from below the floor: "<server> step <k>"
        while True:
            server = self._pick()
            updates = self.weights.updates
            try:
                try:
                    data, step = await self._generate(server, path, body)
                    return server, data, step
                except StaleAnswer as e:
                    if self.weights.updates != updates:  # it ran across an update (e.g. an eval): asked again
                        continue
                    stale.append(str(e))
                    if len(stale) >= STALE_ANSWERS:
                        floor = self.weights.floor
                        raise InferenceError(
                            f"POST {path}: {len(stale)} answers sampled from weights older than step {floor} (the "
                            f"oldest this step may use), each after its server was given weights >= {floor}: "
                            f"{', '.join(stale)}"
                        ) from None
                    await self.weights.restore(server, e.step)
            except ServerDown as e:  # the request, or the restore, found the server down
                await self._lost(server, e)

    async def _generate(self, server: Server, path: str, body: dict) -> tuple[dict, int | None]:
        """One POST of `body` to `server`: its JSON answer and the weight step it reported (x-weight-step).
        Raises StaleAnswer when that step is below the floor, ServerDown when the server's retries ran out."""
        server.requests += 1
        body = body | {"model": self.request_model}
        data, headers = await self.http.exchange("POST", server_url(server, path), body, server.slots)
        step = weight_step_of(headers)
        if step is not None and step < self.weights.floor:
            raise StaleAnswer(server, step)
        return data, step

    async def post(self, path: str, body: dict, server: Server | None = None) -> tuple[Server, dict]:
        """POST `body` to `server`, or (None) to the next usable server, going to another while the one it went
        to is down; the server and its JSON answer. A `server` the caller named being down is the answer
        (ServerDown). No floor: the answer's weights are the caller's to check."""
        while True:
            target = server or self._pick()
            try:
                body_ = body | {"model": self.request_model}
                return target, await self.http.request("POST", f"{target.base}{path}", body_, target.slots)
            except ServerDown as e:
                if server is not None:
                    raise
                await self._lost(target, e)

    async def get(self, path: str) -> dict:
        """GET `path` (under a server's base, e.g. `/models`) from the next usable server, going to another while
        the one it went to is down."""
        while True:
            target = self._pick()
            try:
                return await self.http.request("GET", server_url(target, path))
            except ServerDown as e:
                await self._lost(target, e)

    def _pick(self) -> Server:
        if (server := self.pool.pick()) is None:
            raise InferenceError(self.pool.none_usable())
        return server

    async def _lost(self, server: Server, error: ServerDown) -> None:
        """`server` was found down: take it out, and wait for one to come back if it was the last."""
        self.pool.take_out(server, str(error))
        await self.revive(str(error))

    # ---- pool health ------------------------------------------------------------------------------

    async def server_step(self) -> int:
        """The oldest weight step any live server that gets requests holds (every server is asked; removed ones,
        and ones the fleet file added, are probed and may join)."""
        if self.fleet is not None and (fleet := self.fleet.changed()) is not None:
            self.pool.resize(fleet)

        async def check(server: Server) -> None:
            if not server.alive:
                return await self._probe(server)
            try:
                await self.pool.health(server)
            except ServerDown as e:
                self.pool.take_out(server, str(e))

        await asyncio.gather(*(check(s) for s in self.pool.servers))
        if not self.pool.live():
            await self.revive(f"all of {self.pool.base_urls} failed /health")
        return self._oldest()

    def _oldest(self) -> int:
        """The oldest weight step a live server holds; a benched one (it waits for the next update, gets no
        requests) counts only when every live server is benched."""
        live = self.pool.live()
        return min(s.step for s in [s for s in live if s.benched is None] or live)

    async def revive(self, problem: str) -> None:
        """With no live server left, wait up to client.health_timeout for one to answer again (a server that
        restarts, e.g. under `rl --restart`); InferenceError naming the servers if none does."""
        async with self._revival:  # every request that lost its server lands here; one of them probes
            timeout = self.config.health_timeout
            deadline, next_note = time.monotonic() + timeout, 0.0
            while not self.pool.live():
                if time.monotonic() > deadline:
                    raise InferenceError(
                        f"no live inference server left ({problem}); none of {self.pool.base_urls} answered "
                        f"/health within {timeout:.0f}s"
                    )
                if time.monotonic() >= next_note:
                    logger.warning(f"no inference server is up ({problem}); waiting up to {timeout:.0f}s for one")
                    next_note = time.monotonic() + 30
                await asyncio.gather(*(self._probe(s) for s in self.pool.servers))
                if not self.pool.live():
                    await asyncio.sleep(1.0)

    async def _probe(self, server: Server) -> None:
        """One quick /health of a removed server; if it answers it gets the pool's weights and rejoins. Where the
        pool has no weight dir (broadcasts; before the first update) and it holds weights older than the floor,
        it gets the newest on disk, or joins benched until the next update or broadcast reaches it."""
        if await self.pool.probe_health(server, PROBE_TIMEOUT) is not None:
            return
        try:
            await self.weights.load(server)
            if server.step < self.weights.floor:
                await self.weights.restore(server, server.step)
        except (httpx.TransportError, ValueError, ServerDown):
            return
        self.pool.rejoin(server)

    # ---- weights ----------------------------------------------------------------------------------

    async def update_weights(self, weight_dir: str) -> int:
        """Load `weight_dir` on every live server (one that rejoins later gets it too); the step they now serve."""
        await self.weights.update(weight_dir)
        if not self.pool.live():
            await self.revive(f"all of {self.pool.base_urls} failed to load {weight_dir}")
        return self.weights.served_step()

    async def broadcast_weights(self, step: int, rendezvous: dict) -> int:
        """Every live server receives weight step `step` over the trainer's broadcast group (WeightControl.broadcast);
        the oldest step a live server then holds (`step` when all took it)."""
        self.weights.serve_broadcasts()  # first: a server revived below gets no dir of the old policy
        if not self.pool.live():
            await self.revive(f"no inference server is up to take weight step {step}")
        await self.weights.broadcast(step, rendezvous)
        if not self.pool.live():
            await self.revive(f"every server failed to take weight step {step}")
        return self._oldest()
