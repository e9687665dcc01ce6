"""The control plane every inference backend mounts (docs/design.md §4), so the two cannot drift.

`ControlPlane` is an ASGI middleware in front of a backend's OpenAI app (our FastAPI app, or vLLM's):
- the API key on every route but `/health` (constant-time compare), a bounded request body (413);
- `GET /health` → {"status": "ok", "step", "checksum", "backend", ...the backend's own counters};
- `POST /update_weights {"weight_dir", "inflight"}` and `POST /reload_weights`: the dir is checked and read
  first (a bad one is a 400 and the old weights keep serving); new generation requests then wait at the gate
  while the swap applies. `inflight: "finish"` (the default, and `/reload_weights`): the swap waits until the
  requests in flight have finished on the old weights. `"continue"`, on a backend that can
  (`ServedModel.continues`, the built-in engine): it does not wait; the backend swaps between two decode
  steps and the running requests continue on the new weights, each choice saying which step sampled which
  of its tokens (`weight_steps`, protocol/spans.py); a backend that cannot swaps as "finish". The answer
  says which it did (`inflight`) and carries the weight checksum of what the backend read or received
  (protocol.parity; null: base weights);
- every completion response carries `x-weight-step: n`, the step its request entered the gate with: the
  policy of all of its tokens unless a "continue" swap happened while it ran (its `weight_steps` then say
  which tokens came from which step, none older than n);
- a generation body that is not a JSON object, nests deeper than 128 levels or holds a lone UTF-16
  surrogate is a 400 before the backend parses it (vLLM answered each with a 500, the built-in engine the
  last two).
The backend supplies only `ServedModel`: how to check and read a dir, how to apply it, what to report.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import re
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.responses import JSONResponse

from prime_rl.inference.weights import WeightsError
from prime_rl.protocol.http import WEIGHT_STEP_HEADER

logger = logging.getLogger("prime_rl")

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
ROUTES = ("/health", "/metrics", "/v1/models", *GENERATION_ROUTES, "/update_weights", "/reload_weights")


SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# Deeper JSON than any real request (a tool schema nests a few dozen levels at most): parsers, templates and
# validators recurse on it, and one 600 levels deep holding "\ud800" ended in a RecursionError (a 500).
MAX_JSON_DEPTH = 128


def json_body_problem(body: bytes) -> str | None:
    """Why a JSON body cannot be served (nested deeper than MAX_JSON_DEPTH, or a string that is not Unicode
    text: a surrogate escape without its pair), else None; malformed JSON is left to the route to name.

    Parsed only when the raw bytes could hold either problem: more brackets than the depth limit, or a
    surrogate escape (which paired ones, emoji, also show). The walk is iterative: no depth can overflow it.
    """
    deep = body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH
    if not deep and not SURROGATE_ESCAPE.search(body):
        return None
    try:
        value = json.loads(body)
    except RecursionError:
        return f"the body nests deeper than {MAX_JSON_DEPTH} levels"
    except ValueError:
        return None
    todo = [(value, 0)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                # Valid JSON, but no UTF-8 text: tokenizers and response encoders fail on it (a 500).
                return "a string holds a lone UTF-16 surrogate (\\ud800-\\udfff)"
        elif isinstance(value, dict | list):
            if depth == MAX_JSON_DEPTH:
                return f"the body nests deeper than {MAX_JSON_DEPTH} levels"
            items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
            todo += [(item, depth + 1) for item in items]
    return None


class ServedModel(Protocol):
    """What a backend provides to the control plane."""

    backend: str
    receivers: int  # seats it takes in a weight broadcast group (one per worker holding the weights)
    # A model name whose requests the base weights serve whatever the step (vLLM holding a LoRA adapter:
    # the base model's name), so their `x-weight-step` is 0; None when every name gets the current step.
    base_name: str | None
    # Why generation requests are refused (a weight update failed half-way and left the weights incomplete),
    # None while serving: answered with a 503 until a later update succeeds.
    unservable: str | None
    # The weight checksum (protocol.parity) of the weights `apply` last served, as read or received before
    # any cast or fusion; None: the base weights.
    checksum: str | None
    # Whether `apply` can swap while generation requests run, continuing them on the new weights (inflight
    # "continue"); a backend that cannot is only ever asked to swap with none in flight.
    continues: bool

    async def prepare(self, source: Path | BroadcastRequest | None) -> tuple[int, Any]:
        """Check and read a weight dir, or receive a broadcast step (None: the base weights), without
        touching the served ones: (step, whatever `apply` needs). Raises WeightsError for weights that
        cannot be served."""

    async def apply(self, prepared: Any, inflight: str = "finish") -> None:
        """Serve the prepared weights; called when no generation request is in flight, or ("continue", only
        when `continues`) with requests running that go on under the new weights."""

    def health(self) -> dict[str, Any]:
        """Extra fields of `/health`."""


class BroadcastRequest(BaseModel):
    """Receive weight step `step` over the trainer's broadcast group (protocol.broadcast), as `rank` (the
    server's first; its workers take rank, rank + 1, ...; ranks below `senders` are the trainer's)."""

    model_config = ConfigDict(extra="forbid")
    host: Annotated[str, Field(min_length=1, max_length=253)]
    port: Annotated[int, Field(ge=1, le=65535)]
    group: Annotated[str, Field(min_length=1, max_length=64)]
    world_size: Annotated[int, Field(ge=2, le=65536)]
    rank: Annotated[int, Field(ge=1)]
    step: Annotated[int, Field(ge=1)]
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout: Annotated[float, Field(gt=0, le=86400)] = 600.0
    senders: Annotated[int, Field(ge=1, le=65535)] = 1

    @model_validator(mode="after")
    def _seated(self) -> BroadcastRequest:
        if not self.senders <= self.rank < self.world_size:
            group = f"a group of {self.world_size} with {self.senders} sender(s)"
            raise ValueError(f"rank {self.rank} is no seat of {group}")
        return self

    def rendezvous(self):
        from prime_rl.protocol.broadcast import Rendezvous

        return Rendezvous(self.host, self.port, self.group, self.world_size, self.backend, self.timeout, self.senders)


class UpdateWeightsRequest(BaseModel):
    """Exactly one source: a `weights/step_n` dir, or a step sent over the broadcast group. `inflight`: what
    becomes of the requests in flight, "finish" on the old weights (the swap waits for them) or "continue" on
    the new ones (the swap happens between two decode steps, where the backend can)."""

    model_config = ConfigDict(extra="forbid")
    weight_dir: Annotated[str | None, Field(min_length=1, max_length=4096)] = None  # PATH_MAX
    broadcast: BroadcastRequest | None = None
    inflight: Literal["finish", "continue"] = "finish"

    @model_validator(mode="after")
    def _one_source(self) -> UpdateWeightsRequest:
        if (self.weight_dir is None) == (self.broadcast is None):
            raise ValueError("give exactly one of weight_dir and broadcast")
        return self


class StepGate:
    """Generation requests share it (each holding the step it runs with); a weight swap holds it alone.

    A pending swap stops new requests at the gate, so it waits only for those already running, or (`wait`
    False, an update whose running requests continue on the new weights) for none.
    """

    def __init__(self) -> None:
        self.step = 0
        self._running = 0
        self._swapping = False
        self._changed = asyncio.Condition()

    async def enter(self) -> int:
        async with self._changed:
            await self._changed.wait_for(lambda: not self._swapping)
            self._running += 1
            return self.step

    async def leave(self) -> None:
        async with self._changed:
            self._running -= 1
            self._changed.notify_all()

    @asynccontextmanager
    async def swap(self, wait: bool = True):
        async with self._changed:
            await self._changed.wait_for(lambda: not self._swapping)
            self._swapping = True
            if wait:
                await self._changed.wait_for(lambda: self._running == 0)
        try:
            yield
        finally:
            async with self._changed:
                self._swapping = False
                self._changed.notify_all()


class ControlPlane:
    """ASGI middleware: auth, body limit, per-route status counts, health, weight swaps, step stamping."""

    def __init__(
        self,
        app,
        served: ServedModel,
        api_key: str | None,
        max_body_bytes: int,
        counts: collections.Counter | None = None,
        broadcast: bool = False,
    ):
        self.app, self.served, self.api_key, self.max_body_bytes = app, served, api_key, max_body_bytes
        # Joining a process group connects to the address a request names: only when the server opted in.
        self.broadcast = broadcast
        self.weight_group: str | None = None
        self.counts = collections.Counter() if counts is None else counts
        self.gate = StepGate()
        self.updating = asyncio.Lock()
        self._said_finish = False  # logged once that this backend answers inflight "continue" as "finish"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in ROUTES else "other"
        status = {"code": 500}

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, counted_send)
        finally:
            self.counts[(path, status["code"])] += 1

    async def _guarded(self, scope, receive, send):
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path, method = scope["path"], scope["method"]
        if path == "/health" and method == "GET":
            return await self._health()(scope, receive, send)
        refusal = self._check_headers(headers)
        if refusal is not None:
            return await refusal(scope, receive, send)
        body = await self._read_body(receive)
        if body is None:
            return  # the client left before sending its body
        if isinstance(body, JSONResponse):
            return await body(scope, receive, send)
        if method == "POST" and path in ("/update_weights", "/reload_weights"):
            return await (await self._swap(path, body))(scope, receive, send)
        if path not in GENERATION_ROUTES:
            return await self.app(scope, replay(body, receive), send)
        refusal = self.check_generation(path, body)
        if refusal is None and self.served.unservable is not None:
            refusal = error(503, f"no complete weights to serve: {self.served.unservable}", "service_unavailable")
        if refusal is not None:
            return await refusal(scope, receive, send)
        await self._generate_stamped(scope, body, replay(body, receive), send)

    def check_generation(self, path: str, body: bytes) -> JSONResponse | None:
        """The 400 for a generation body that no backend gets to see, else None (a backend may add checks)."""
        return check_generation_body(body)

    def _check_headers(self, headers: dict[str, str]) -> JSONResponse | None:
        """The 401 for a missing or wrong API key, or the 413 for a declared body over the limit; else None."""
        if self.api_key:
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                message = "missing or wrong API key (send `Authorization: Bearer <key>`)"
                return error(401, message, "authentication_error")
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> JSONResponse:
        return error(413, f"request body larger than {self.max_body_bytes} bytes")

    async def _read_body(self, receive) -> bytes | JSONResponse | None:
        """The whole request body; the 413 once it passes the limit; None when the client left before sending it.

        The body is read here (at most max_body_bytes) and replayed, so an oversized upload is refused before
        any route parses it, whether or not it declared a Content-Length.
        """
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                return self._too_large()
        return b"".join(chunks)

    async def _generate_stamped(self, scope, body: bytes, receive, send) -> None:
        """Run a generation request through the gate, its response stamped with the weight step it ran on."""
        step = await self.gate.enter()
        base = self.served.base_name
        if base is not None and requested_model(body) in (None, base):
            step = 0
        started = False

        async def stamped(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                extra = [(WEIGHT_STEP_HEADER.encode(), str(step).encode())]
                message = message | {"headers": [*message.get("headers", []), *extra]}
            await send(message)

        try:
            await self.app(scope, receive, stamped)
        except Exception as e:
            refusal = None if started else self.refusal_for(scope["path"], body, e)
            if refusal is None:
                raise
            await refusal(scope, receive, stamped)
        finally:
            await self.gate.leave()

    def refusal_for(self, path: str, body: bytes, exc: Exception) -> JSONResponse | None:
        """The 4xx for a generation request the backend raised on before answering, when its body is at
        fault; None lets the error through (a 500). The built-in engine's routes raise on no body."""
        return None

    def _health(self) -> JSONResponse:
        state = {"status": "ok", "step": self.gate.step, "checksum": self.served.checksum}
        state["backend"] = self.served.backend
        if self.broadcast:  # its seats, and the group its weights came from (None: a dir or the base)
            state |= {"weight_receivers": self.served.receivers, "weight_group": self.weight_group}
        return JSONResponse(state | self.served.health())

    async def _swap(self, path: str, body: bytes) -> JSONResponse:
        weight_dir = source = None
        inflight = "finish"
        if path == "/update_weights":
            try:
                request = UpdateWeightsRequest.model_validate_json(body)
            except ValidationError as e:
                problems = "; ".join(f"{'.'.join(map(str, ('body', *p['loc'])))}: {p['msg']}" for p in e.errors())
                return error(400, f"invalid request: {problems}"[:2000])
            weight_dir = request.weight_dir
            source = request.broadcast or Path(weight_dir)
            inflight = self._inflight(request.inflight)
            if request.broadcast is not None and not self.broadcast:
                message = "this server takes no weights over a process group; start it with --weight-transfer broadcast"
                return error(400, message)
        start = time.perf_counter()
        async with self.updating:  # one update at a time: a broadcast receiver takes one stream
            try:
                step, prepared = await self.served.prepare(source)
            except WeightsError as e:
                return error(400, str(e))
            async with self.gate.swap(wait=inflight == "finish"):
                try:
                    await self.served.apply(prepared, inflight)
                except WeightsError as e:  # refused by the backend at load (vLLM's LoRA loader); nothing changed
                    return error(400, str(e))
                self.gate.step = step
                self.weight_group = source.group if isinstance(source, BroadcastRequest) else None
                checksum = self.served.checksum  # of this update (the next one waits for the lock)
        logger.info(f"now serving weights step {step} (checksum {checksum})")
        answer = {"step": step, "checksum": checksum, "seconds": round(time.perf_counter() - start, 3)}
        answer["inflight"] = inflight
        return JSONResponse(answer if weight_dir is None else answer | {"weight_dir": weight_dir})

    def _inflight(self, asked: str) -> str:
        """What this backend does with the requests in flight: `asked`, or "finish" where it cannot continue
        them (said once in the log)."""
        if asked == "finish" or self.served.continues:
            return asked
        if not self._said_finish:
            self._said_finish = True
            logger.info(
                f"the {self.served.backend} backend cannot continue requests in flight on new weights: weight "
                'updates asking inflight "continue" wait for them to finish (answered "inflight": "finish")'
            )
        return "finish"


def replay(body: bytes, receive):
    """An ASGI `receive` that gives the body read already, then waits on the client's (for the disconnect)."""
    replayed = False

    async def receive_again():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again


def check_generation_body(body: bytes) -> JSONResponse | None:
    """The 400 for a generation body that is not a JSON object, nests too deep or holds a lone UTF-16
    surrogate, else None."""
    if not body.lstrip().startswith(b"{"):  # vLLM's request models crash (a 500) on other JSON values
        return error(400, "invalid request: the body must be a JSON object")
    problem = json_body_problem(body)
    return None if problem is None else error(400, f"invalid request: {problem}")


def requested_model(body: bytes) -> str | None:
    """The `model` a generation request names (None when it names none, or is not a JSON object)."""
    try:
        model = json.loads(body).get("model")
    except (ValueError, AttributeError):
        return None
    return model if isinstance(model, str) else None


def error(status: int, message: str, type: str = "invalid_request_error") -> JSONResponse:
    """An OpenAI-style error response."""
    return JSONResponse({"error": {"message": message, "type": type, "code": status}}, status_code=status)
