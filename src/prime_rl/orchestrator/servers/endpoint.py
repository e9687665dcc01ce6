"""The pool as one server: a local HTTP endpoint in the orchestrator's process for clients that render their own
prompts and call vLLM's token-in/token-out route (verifiers' `TrainClient`, through `renderers`), so their
requests get what the orchestrator's own get (docs/design.md §4): the next usable server by share, a server found
down taken out and the request sent to another, an answer sampled from weights below the floor thrown away and
asked again (`Servers.generate`).

- `POST /inference/v1/generate`: forwarded; the answer is the server's, with the `x-weight-step` it reported. The
  request names the model the pool serves (its LoRA adapter once it holds one), whatever the client sent.
- `GET /v1/models`: a live server's (`renderers` reads `max_model_len` there).

A request a server refused (a 4xx: a malformed body, a prompt too long) is answered with that status and the
server's message; a pool with no usable server, or an answer no server could give, is a 503 naming why.

    async with PoolEndpoint(client.servers) as endpoint:   # endpoint.url: http://127.0.0.1:<port>/v1
        ...  # TrainClientConfig(base_url=endpoint.url, ...)
"""

from __future__ import annotations

import asyncio
import json
import logging

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from prime_rl.orchestrator.servers import Servers
from prime_rl.orchestrator.servers.http import InferenceError
from prime_rl.protocol.http import WEIGHT_STEP_HEADER

logger = logging.getLogger("prime_rl")

GENERATE = "/inference/v1/generate"
START_TIMEOUT = 30.0  # seconds for the endpoint's socket to be listening


def _error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _refusal(e: InferenceError) -> JSONResponse:
    """A server's 4xx passed on; anything else the pool could not serve is a 503."""
    if e.status is not None and 400 <= e.status < 500:
        return _error(e.status, str(e))
    return _error(503, str(e))


class PoolEndpoint:
    """The endpoint, served on `host` (port 0: a free one) in the running event loop while the context is open."""

    def __init__(self, servers: Servers, host: str = "127.0.0.1", port: int = 0):
        self.servers, self.host, self.port = servers, host, port
        routes = [Route(GENERATE, self._generate, methods=["POST"]), Route("/v1/models", self._models)]
        self.app = Starlette(routes=routes)
        self._server = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        """The base URL clients take (`.../v1`, as a vLLM server's)."""
        return f"http://{self.host}:{self.port}/v1"

    async def __aenter__(self) -> PoolEndpoint:
        import uvicorn

        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve())
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start (a port in use, ...)
                raise RuntimeError(f"the pool endpoint on {self.host}:{self.port} stopped before it started")
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"the pool endpoint on {self.host}:{self.port} did not start in {START_TIMEOUT}s")
            await asyncio.sleep(0.02)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        logger.info(f"the inference pool serves {GENERATE} at {self.url.removesuffix('/v1')}")
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.should_exit = True
        await self._task

    async def _generate(self, request: Request) -> JSONResponse:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(400, "invalid request: the body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "invalid request: the body must be a JSON object")
        try:
            _, data, step = await self.servers.generate(GENERATE, body)
        except InferenceError as e:
            return _refusal(e)
        return JSONResponse(data, headers={} if step is None else {WEIGHT_STEP_HEADER: str(step)})

    async def _models(self, request: Request) -> JSONResponse:
        try:
            return JSONResponse(await self.servers.get("/models"))
        except InferenceError as e:
            return _refusal(e)
