"""A `verifiers-env`'s env in a process of its own: verifiers' env server (`verifiers.v1.serve.serve_env`, one
worker), reached over ZMQ by its `EnvClient`. The harness programs, tools, scorers, user simulators and judges run
there, so one that blocks its event loop, leaks or crashes costs its episodes, never the orchestrator's loop.

Every episode has a bound: the env's own `timeout.episode` plus GRACE. An episode past it, or one whose server
died, fails (EpisodeFailed: counted, replaced, as any failed episode); a server that died or let an episode pass
its bound (a scorer blocking its loop answers nothing else either) is killed and started again, up to
MAX_RESTARTS times in a row without an episode that finished, after which the env is broken (EnvError).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import queue
import time
from typing import Any

from prime_rl.envs import EnvError, EpisodeFailed

logger = logging.getLogger("prime_rl")

START_TIMEOUT = 120.0  # seconds for a started server to bind and answer its first health request
STOP_TIMEOUT = 5.0  # seconds for a stopped server to end before it is killed
GRACE = 10.0  # past the episode's own timeout (verifiers ends the episode then) before the server is taken for hung
MAX_RESTARTS = 3
POLL = 0.5  # how often a waiting episode looks at its server's process


def server_context() -> multiprocessing.context.BaseContext:
    """Env servers fork from one clean process that imported verifiers' server once (`forkserver`: none of the
    orchestrator's threads or loop in the child): a server starts in ~0.7 s instead of a fresh interpreter's
    ~3.4 s, and ends in 0.02 s instead of ~1.1 s (measured, the reverse taskset, 2 CPU cores)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["prime_rl.orchestrator.env_server", "verifiers.v1.serve"])
    return ctx


def serve(environ: dict[str, str], **kwargs: Any) -> None:
    """The server process: the orchestrator's environment as it is now (the fork server's is from its own start;
    verifiers' training client reads the endpoint's key from it), then verifiers' `serve_env`."""
    from verifiers.v1.serve import serve_env

    os.environ.clear()
    os.environ.update(environ)
    serve_env(**kwargs)


class EnvServer:
    """One env server process for the env config `config` (verifiers' resolved EnvConfig), started by `start()`."""

    def __init__(self, config: Any, name: str, episode_timeout: float):
        self.config, self.name, self.bound = config, name, episode_timeout + GRACE
        self.process: multiprocessing.process.BaseProcess | None = None
        self.client: Any = None
        self.generation = 0  # bumped when a restart begins: the old server's other episodes fail, it restarts once
        self.restarts = 0  # in a row, without a finished episode between
        self._starting = asyncio.Lock()
        self._death_pipe: Any = None  # our end: when the orchestrator dies, the server sees it close and ends

    async def start(self) -> None:
        from verifiers.v1.serve import EnvClient, env_config_data

        ctx = server_context()
        addresses, (self._death_pipe, child_end) = ctx.Queue(), ctx.Pipe()
        kwargs = {"max_workers": 1, "address": "tcp://127.0.0.1:0", "address_queue": addresses,
                  "death_pipe": child_end, "config_data": env_config_data(self.config)}  # fmt: skip
        self.process = ctx.Process(target=serve, args=(dict(os.environ),), kwargs=kwargs, daemon=True,
                                   name=f"env-server-{self.name}")  # fmt: skip
        self.process.start()
        address = await asyncio.to_thread(self._address, addresses)
        self.client = EnvClient(address)
        try:
            await self.client.wait_for_server_startup(timeout=START_TIMEOUT)
        except TimeoutError:
            await self.stop()
            raise EnvError(f"{self.name}: its env server at {address} did not answer in {START_TIMEOUT:.0f}s") from None
        logger.info(f"{self.name}: env server pid {self.process.pid} at {address}")

    def _address(self, addresses: Any) -> str:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            try:
                return addresses.get(timeout=POLL)
            except queue.Empty:
                if not self.process.is_alive():
                    raise EnvError(f"{self.name}: its env server exited ({self.process.exitcode}) before it bound; "
                                   "its error is in the orchestrator's log") from None  # fmt: skip
        self.process.kill()
        raise EnvError(f"{self.name}: its env server did not bind an address in {START_TIMEOUT:.0f}s")

    async def stop(self) -> None:
        """SIGTERM (verifiers' server then closes its runtimes and harness programs), SIGKILL after STOP_TIMEOUT."""
        if self.client is not None:
            await self.client.close()
            self.client = None
        if self.process is not None:
            self.process.terminate()
            await asyncio.to_thread(self.process.join, STOP_TIMEOUT)
            if self.process.exitcode is None:
                self.process.kill()
                await asyncio.to_thread(self.process.join, STOP_TIMEOUT)
            self.process = None
        if self._death_pipe is not None:
            self._death_pipe.close()
            self._death_pipe = None

    async def run(self, client: Any, model: str, sampling: Any, task_data: dict) -> Any:
        """One episode on the server (verifiers' WireEpisode); EpisodeFailed when its server died or it passed its
        bound (the server is then started again)."""
        async with self._starting:  # a restart in progress: this episode goes to the new server
            generation, started = self.generation, time.monotonic()
        run = asyncio.ensure_future(self.client.run(client, model, sampling, task_data))
        try:
            while not run.done():
                await asyncio.wait({run}, timeout=POLL)
                if run.done():
                    break
                if generation != self.generation:
                    raise EpisodeFailed(f"{self.name}: an episode failed: its env server was restarted under it")
                if not self.process.is_alive():
                    why = f"its env server died (exit {self.process.exitcode})"
                elif time.monotonic() - started > self.bound:
                    why = f"no answer from its env server in {self.bound:.0f}s (timeout.episode + {GRACE:.0f}s)"
                else:
                    continue
                await self._restart(generation, why)
                raise EpisodeFailed(f"{self.name}: an episode failed: {why}")
        finally:
            run.cancel()
        try:
            episode = run.result()
        except RuntimeError as e:  # the server's answer to a request it could not run
            raise EpisodeFailed(f"{self.name}: its env server could not run an episode: {e}") from None
        self.restarts = 0
        return episode

    async def _restart(self, generation: int, why: str) -> None:
        async with self._starting:
            if generation != self.generation:  # another episode already restarted it
                return
            self.generation += 1  # before anything awaits: the old server's other episodes see it and fail
            self.restarts += 1
            if self.restarts > MAX_RESTARTS:
                raise EnvError(f"{self.name}: its env server failed {MAX_RESTARTS + 1} times in a row; the last: {why}")
            logger.warning(f"{self.name}: {why}; restarting it ({self.restarts} of {MAX_RESTARTS} in a row)")
            await self.stop()
            await self.start()
