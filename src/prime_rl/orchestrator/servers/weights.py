"""Which weights the inference servers serve (docs/design.md §4; broadcast: §5): a weight dir loaded on every
live server (POST /update_weights), the base weights again (POST /reload_weights), or a step received over
the trainer's broadcast group.

`weight_dir` is what the pool serves: a server that rejoins is given it again by `load` (nothing to do before
the first update). Each answer's weight checksum is kept on its server, which the parity gate (parity.py)
compares with the trainer's.

The floor (`floor`, set by the client's `set_floor`: the oldest policy the current step may use). A server that
answered from below it (it restarted and holds its base weights) is `restore`d: given the pool's `weight_dir`,
or, where the orchestrator posted none (after its own restart, and always with broadcasts), the newest complete
`weights/step_k` on disk with k >= floor (filesystem mode writes every step; broadcast mode checkpoint steps and
the last). With neither it is benched: it stays in the pool (updates and broadcasts reach it, which unbench it)
but gets no requests; with every server benched a request fails, naming them and their steps.

Requests in flight (`inflight`): continuous mode with `inflight_updates = "continue"` asks each update to swap
inside running requests (`"inflight": "continue"`: they go on under the new weights, each token labelled with
the step that sampled it); otherwise nothing is asked and servers finish them first. A server that answers
`"inflight": "finish"` (its backend cannot continue them) is said once in the log.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx

from prime_rl.configs.orchestrator import OrchestratorConfig
from prime_rl.orchestrator.servers.http import Http, InferenceError, ServerDown
from prime_rl.orchestrator.servers.pool import PROBE_TIMEOUT, Server, ServerPool, server_root
from prime_rl.protocol import stable_steps, weights_dir, weights_root
from prime_rl.protocol.broadcast import report_unreached

logger = logging.getLogger("prime_rl")


def inflight_ask(config: OrchestratorConfig) -> str | None:
    """What weight updates ask of requests in flight: "continue" in continuous mode (`max_inflight` set) with
    inflight_updates = "continue"; None otherwise (barrier mode: the servers finish them, as by default)."""
    return "continue" if config.max_inflight is not None and config.inflight_updates == "continue" else None


class WeightControl:
    def __init__(self, pool: ServerPool, http: Http, inflight: str | None = None, output_dir: Path | None = None):
        self.pool, self.http = pool, http
        self.weight_dir: str | None = None  # what the pool serves (the last update); None: each server's base
        self.output_dir = output_dir  # the run's OUTPUT_DIR (its weights/step_k); None: no run (eval, a teacher)
        self.floor = 0  # the oldest weight step a completion may come from (the client's set_floor)
        self._restoring: dict[str, asyncio.Lock] = {}  # per server: one restore at a time
        self.updates = 0  # pool-wide updates and broadcasts started: an answer older than one it straddled is no fault
        self.inflight = inflight  # what updates ask of requests in flight ("continue"); None: the server's default
        self._finishing: set[str] = set()  # servers said to swap between requests (logged once each)
        self.failed: set[tuple[int, str]] = set()  # (step, group) of broadcasts that failed: never asked again

    def _ask(self, body: dict) -> dict:
        """An /update_weights body with what it asks of requests in flight, if anything."""
        return body if self.inflight is None else body | {"inflight": self.inflight}

    def _answered(self, server: Server, data: dict) -> None:
        """Keep a server's /update_weights answer: its step, checksum, and whether it continued requests."""
        server.step, server.checksum = int(data["step"]), data.get("checksum")
        server.benched = None  # it took weights: it serves again (checked against the floor when it answers)
        if self.inflight == "continue" and data.get("inflight") == "finish" and server.base not in self._finishing:
            self._finishing.add(server.base)
            logger.info(
                f"{server.base} swaps weights between requests (answered inflight 'finish'): its responses each "
                "come from one policy, and updates wait for its longest request"
            )

    async def load(self, server: Server) -> None:
        """Give one server the weights the pool serves (nothing to do before the first update)."""
        if self.weight_dir is not None:
            body = self._ask({"weight_dir": self.weight_dir})
            self._answered(server, await self.http.request("POST", f"{server_root(server.base)}/update_weights", body))

    async def restore(self, server: Server, answered: int) -> None:
        """`server` answered from weight step `answered`, older than the floor: give it weights of a step >= floor
        (the pool's weight dir, else the newest on disk), or bench it (module docstring). Concurrent calls for one
        server load once: a later one finds it restored (its /health) and returns. ServerDown if it is down."""
        async with self._restoring.setdefault(server.base, asyncio.Lock()):
            if server.benched is not None:
                return
            if (problem := await self.pool.probe_health(server, PROBE_TIMEOUT)) is not None:
                raise ServerDown(f"{server.base} answered from weight step {answered}, then /health failed: {problem}")
            if server.step >= self.floor:
                return  # restored by another request, or an update reached it since it answered
            for source in self._sources(server):
                try:
                    data = await self.http.request("POST", f"{server_root(server.base)}/update_weights",
                                               self._ask({"weight_dir": source}))  # fmt: skip
                except ServerDown:
                    raise
                except InferenceError as e:  # e.g. a dir pruned since it was listed: try the next, else bench
                    logger.warning(f"{server.base} could not load {source}: {e}")
                    continue
                self._answered(server, data)
                if server.step >= self.floor:
                    logger.warning(
                        f"{server.base} answered from weight step {answered}, older than {self.floor} (the oldest "
                        f"this step may use; restarted?): loaded {source} onto it (step {server.step})"
                    )
                    return
            where = f"in {weights_root(self.output_dir)}" if self.output_dir is not None else "known (no output dir)"
            server.benched = (
                f"{server.base} holds weight step {server.step} (answered from {answered}; restarted?), older than "
                f"{self.floor}, and no complete weights of a step >= {self.floor} are {where}"
            )
            logger.warning(f"{server.benched}: it gets no requests until a weight update reaches it")

    def _sources(self, server: Server) -> list[str]:
        """Weight dirs to restore `server` from, best first: the pool's (the last update), then the newest complete
        `weights/step_k` with floor <= k <= the newest step another live server holds (so the pool stays on one
        policy where it can), then the newest with k >= floor."""
        out = [] if self.weight_dir is None else [self.weight_dir]
        if self.output_dir is not None:
            steps = [k for k in stable_steps(weights_root(self.output_dir)) if k >= self.floor]
            held = [s.step for s in self.pool.live() if s is not server and s.benched is None]
            within = [k for k in steps if not held or k <= max(held)]
            for k in ([max(within)] if within else []) + ([max(steps)] if steps else []):
                out.append(str(weights_dir(self.output_dir, k)))
        return list(dict.fromkeys(out))

    async def update(self, weight_dir: str) -> None:
        """Load `weight_dir` on every live server. A server that is down is taken out (the others carry on; it
        gets these weights when it rejoins); any other failure is an error."""
        self.weight_dir = weight_dir
        self.updates += 1

        async def one(server: Server) -> None:
            try:
                await self.load(server)
            except ServerDown as e:
                self.pool.take_out(server, str(e))

        await asyncio.gather(*(one(s) for s in self.pool.live()))

    def served_step(self) -> int:
        """The step every live server holds after `update`; InferenceError when they differ."""
        steps = [s.step for s in self.pool.live()]
        if len(set(steps)) != 1:
            raise InferenceError(f"servers report different steps after loading {self.weight_dir}: {steps}")
        return steps[0]

    async def reload(self) -> int:
        """Every live server goes back to the weights it started with (POST /reload_weights); returns
        their step (0). Later rejoining servers get those weights too."""
        self.weight_dir = None

        async def one(server: Server) -> None:
            data = await self.http.request("POST", f"{server_root(server.base)}/reload_weights", {})
            server.step, server.checksum = int(data["step"]), data.get("checksum")

        await asyncio.gather(*(one(s) for s in self.pool.live()))
        steps = {s.step for s in self.pool.live()}
        if len(steps) != 1:
            raise InferenceError(f"servers report different steps after reloading their weights: {sorted(steps)}")
        if (step := steps.pop()) != 0:
            raise InferenceError(f"servers report weights step {step} after reloading their base weights")
        return step

    def serve_broadcasts(self) -> None:
        """The pool serves broadcast steps from now on: a dir loaded before is no longer its policy (a server that
        rejoins gets none), and requests in flight run across an update."""
        self.weight_dir = None
        self.updates += 1

    async def broadcast(self, step: int, rendezvous: dict) -> None:
        """Have every live server (at least one: `serve_broadcasts`, then the facade's revive, come first)
        receive weight step `step` over the trainer's broadcast group.

        The trainer sends to all seats at once, so every live server takes part (never twice: a second join
        would take a seat twice). A server that fails to take it does not end the run: one that no longer
        answers is taken out of the pool; one that answers (a 400: a peer died or timed out, its old weights
        keep serving) stays. The trainer then sends the step again in a new group (protocol.broadcast), which
        the caller relays to the live servers; `failed` keeps this (step, group) from being asked again.
        `rendezvous`: host, port, group, backend, timeout, senders (protocol.broadcast.Rendezvous); the world size
        is the trainer's senders + the live servers' seats (their /health `weight_receivers`), which follow them."""
        # The servers' state is the caller's last server_step() (their /health): no extra round trip here.
        servers = self.pool.live()
        unable = [s.base for s in servers if s.receivers == 0]
        if unable:
            message = "take no weights over a process group; start them with --weight-transfer broadcast"
            raise InferenceError(f"{unable} {message}")
        senders = rendezvous.get("senders", 1)
        world_size = senders + sum(s.receivers for s in servers)
        ranks = [senders + sum(s.receivers for s in servers[:i]) for i in range(len(servers))]
        sends = (self._join(s, step, rendezvous, world_size, r) for s, r in zip(servers, ranks, strict=True))
        results = await asyncio.gather(*sends, return_exceptions=True)
        failed = [(s, r) for s, r in zip(servers, results, strict=True) if isinstance(r, BaseException)]
        for server, error in failed:
            if not isinstance(error, InferenceError):
                raise error
            if await self.pool.probe_health(server, PROBE_TIMEOUT) is not None:
                self.pool.take_out(server, str(error))
            else:
                logger.warning(f"{error}; it keeps serving weight step {server.step}")
        if failed:
            self.failed.add((step, rendezvous["group"]))

    async def _join(self, server: Server, step: int, rendezvous: dict, world_size: int, rank: int) -> None:
        """One server's POST /update_weights for a broadcast: it answers once it holds the step."""
        body = self._ask({"broadcast": rendezvous | {"world_size": world_size, "rank": rank, "step": step}})
        url = f"{server_root(server.base)}/update_weights"
        try:
            response = await self.http.client.post(url, json=body, timeout=rendezvous["timeout"] + 30)
        except httpx.TransportError as e:
            message = f"{server.base}: weight broadcast of step {step}: {type(e).__name__}: {e}"
            if self.output_dir is not None:  # its seats never ask: the trainer gives the group up, the others leave
                report_unreached(self.output_dir, step, rendezvous["group"], message)
            raise InferenceError(message) from None
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = f"HTTP {response.status_code}: {response.text[:500]}"
            raise InferenceError(f"{server.base} could not take weight step {step}: {message}")
        self._answered(server, response.json())
        server.group = rendezvous["group"]
