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

Episodes (orchestrator/episodes.py): `episode()` opens a key, and the same routes under `/episodes/<key>/` record
every answer there (its tokens, logprobs, per-token weight steps, server and kept sets, as `Completion`s) until
`end(key)` hands them over: what the trainer gets is checked against what the servers sampled. With `sampling`
(the run's `sampling_params`) a request samples as the run does whatever the client asked (the trainer's logprobs
assume the run's temperature and filters); a client's `max_tokens` holds where it is below the run's. With
`token`, a request without `Authorization: Bearer <token>` is a 401.

    async with PoolEndpoint(client.servers) as endpoint:   # endpoint.url: http://127.0.0.1:<port>/v1
        ...  # TrainClientConfig(base_url=endpoint.url, ...)
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Iterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from prime_rl.orchestrator.servers import Servers
from prime_rl.orchestrator.servers.client import Completion, parse_generate_response
from prime_rl.orchestrator.servers.http import InferenceError
from prime_rl.orchestrator.servers.pool import server_url
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

    def __init__(self, servers: Servers, host: str = "127.0.0.1", port: int = 0, sampling: dict | None = None,
                 token: str | None = None):  # fmt: skip
        self.servers, self.host, self.port, self.sampling, self.token = servers, host, port, sampling, token
        routes = [Route(GENERATE, self._generate, methods=["POST"]), Route("/v1/models", self._models)]
        routes += [Route(f"/episodes/{{key}}{r.path}", r.endpoint, methods=r.methods) for r in routes]
        self.app = Starlette(routes=routes)
        self.episodes: dict[str, list[Completion]] = {}
        self.seeds: dict[str, Iterator[int]] = {}  # an episode's request seeds, one per request as it comes
        self._server = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        """The base URL clients take (`.../v1`, as a vLLM server's)."""
        return f"http://{self.host}:{self.port}/v1"

    def episode(self, seeds: Iterator[int] | None = None) -> str:
        """A new episode's key: its base URL (`episode_url`) records every answer until `end(key)`; with `seeds`,
        each of its requests samples with the next one (the run's `sampling.seed`, made per episode and turn)."""
        key = secrets.token_hex(8)
        self.episodes[key] = []
        if seeds is not None:
            self.seeds[key] = seeds
        return key

    def episode_url(self, key: str) -> str:
        return f"http://{self.host}:{self.port}/episodes/{key}/v1"

    def end(self, key: str) -> list[Completion]:
        """The episode's answers, in the order they came; later requests under its key are a 404."""
        self.seeds.pop(key, None)
        return self.episodes.pop(key)

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

    def _refused(self, request: Request) -> JSONResponse | None:
        """401 without the token, 404 under an episode key not (or no longer) open; None: go on."""
        if self.token is not None and request.headers.get("authorization") != f"Bearer {self.token}":
            return _error(401, "invalid request: missing or wrong API key (Authorization: Bearer <key>)")
        key = request.path_params.get("key")
        if key is not None and key not in self.episodes:
            return _error(404, f"no episode {key} in flight (it ended, or never began)")
        return None

    async def _generate(self, request: Request) -> JSONResponse:
        if refused := self._refused(request):
            return refused
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error(400, "invalid request: the body is not JSON")
        if not isinstance(body, dict) or not isinstance(body.get("sampling_params", {}), dict):
            return _error(400, "invalid request: the body (and its sampling_params) must be a JSON object")
        if self.sampling is not None:
            body["sampling_params"] = run_sampling(body.get("sampling_params", {}), self.sampling)
        if (seeds := self.seeds.get(request.path_params.get("key", ""))) is not None:
            body["sampling_params"] = body.get("sampling_params", {}) | {"seed": next(seeds)}
        try:
            server, data, step = await self.servers.generate(GENERATE, body)
        except InferenceError as e:
            return _refusal(e)
        if (answers := self.episodes.get(request.path_params.get("key", ""))) is not None:
            try:  # the prompt is what was sent (the answer holds it only when asked to return it)
                choices = parse_generate_response(
                    data | {"prompt_token_ids": data.get("prompt_token_ids") or body.get("token_ids")}
                )
            except (KeyError, TypeError, ValueError) as e:
                return _error(502, f"POST {server_url(server, GENERATE)} returned a malformed response: {e}")
            index = self.servers.pool.servers.index(server)
            answers += [choice.completion(-1 if step is None else step, index) for choice in choices]
        return JSONResponse(data, headers={} if step is None else {WEIGHT_STEP_HEADER: str(step)})

    async def _models(self, request: Request) -> JSONResponse:
        if refused := self._refused(request):
            return refused
        try:
            return JSONResponse(await self.servers.get("/models"))
        except InferenceError as e:
            return _refusal(e)


def run_sampling(asked: dict, run: dict) -> dict:
    """The run's sampling parameters over what a client asked; its `max_tokens` where below the run's.

    >>> run_sampling({"temperature": 0.2, "max_tokens": 8, "logprobs": 1}, {"temperature": 1.0, "max_tokens": 16})
    {'temperature': 1.0, 'max_tokens': 8, 'logprobs': 1}
    """
    params = dict(asked) | {k: v for k, v in run.items() if k != "max_tokens"}
    params["max_tokens"] = min(asked.get("max_tokens") or run["max_tokens"], run["max_tokens"])
    return params
