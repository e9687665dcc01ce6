"""HTTP routes of the built-in engine (docs/design.md §4): OpenAI completions and chat (plain or streamed; chat
with tools, whose `<tool_call>` blocks come back as `tool_calls`, parsed by utils/tool_calls.py), vLLM's
token-in/token-out route (`/inference/v1/generate`, openai/tokens.py) and Prometheus metrics, behind the
control plane both backends share (control.py: health, API key, body limit, weight updates); `BuiltinModel` is
the engine as that control plane sees it.

The handlers are module-level and read the engine and config from `request.app.state`; the work is in
openai/ (request models, translation, response shaping, streaming) and metrics.py. Everything a client can
get wrong (bad JSON, wrong types, a prompt too long for `max_model_len`, an oversized body, an unusable
weight dir) is answered 4xx with an OpenAI-style error body, never a 500. A full waiting queue is a 429, a
request past `request_timeout` a 504; a client that disconnects cancels its generation.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from prime_rl.configs.inference import InferenceConfig, StartupError
from prime_rl.inference.control import BroadcastRequest, ControlPlane, error
from prime_rl.inference.engine import Engine, LoadedWeights
from prime_rl.inference.metrics import CONTENT_TYPE, prometheus_text
from prime_rl.inference.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    describe,
)
from prime_rl.inference.openai.serving import (
    chat_prompt_ids,
    chat_response,
    check_model,
    completion_prompts,
    completion_response,
    generate_all,
    guarded,
    open_stream,
    parses_tool_calls,
    prompt_token_ids,
    request_id,
    sampling_params,
    with_prompt_scoring,
)
from prime_rl.inference.openai.stream import chat_chunks, completion_chunks, merge, sse
from prime_rl.inference.openai.tokens import generate_response

logger = logging.getLogger("prime_rl")


def build_app(engine: Engine, config: InferenceConfig) -> ControlPlane:
    """The OpenAI routes and /metrics behind the shared control plane (health, auth, weight swaps)."""
    if config.tool_call_parser not in (None, "hermes"):
        raise StartupError(
            f"tool_call_parser {config.tool_call_parser!r}: the built-in engine parses only `hermes` tool calls "
            "(other parsers are vLLM's)"
        )
    app = FastAPI(title="prime-rl inference", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.config = engine, config
    app.state.http_counts = collections.Counter()  # filled by the control plane, read by /metrics
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_invalid_request)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_internal_error)
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/inference/v1/generate", generate, methods=["POST"])
    served, broadcast = BuiltinModel(engine), config.weight_transfer.type == "broadcast"
    return ControlPlane(app, served, config.api_key, config.max_body_bytes, app.state.http_counts, broadcast=broadcast)


# ---- error mapping --------------------------------------------------------------------------------


async def on_api_error(request: Request, e: APIError):
    return error(e.status, e.message, e.type)


async def on_invalid_request(request: Request, e: RequestValidationError):
    return error(400, describe(e))


async def on_http_error(request: Request, e: HTTPException):
    return error(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error")


async def on_internal_error(request: Request, e: Exception):
    logger.exception(f"{request.method} {request.url.path} failed")
    return error(500, f"internal error: {type(e).__name__}: {e}", "server_error")


# ---- routes ---------------------------------------------------------------------------------------


async def metrics(request: Request):
    state = request.app.state
    return Response(prometheus_text(state.engine, state.http_counts), media_type=CONTENT_TYPE)


async def models(request: Request):
    engine, config = request.app.state.engine, request.app.state.config
    model_name = config.model.name
    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "prime-rl"}
    cards = [card | {"max_model_len": config.max_model_len}]
    if engine.adapter is not None:  # as vLLM lists a loaded adapter
        cards.append(card | {"id": engine.adapter, "parent": model_name, "max_model_len": config.max_model_len})
    return {"object": "list", "data": cards}


async def completions(body: CompletionRequest, request: Request):
    engine, config = request.app.state.engine, request.app.state.config
    name = check_model(body.model, config.model.name, engine.adapter)
    prompts = await completion_prompts(body, engine)
    params = [sampling_params(body, len(ids), 16, body.logprobs or 0, config, engine) for ids in prompts]
    params = [with_prompt_scoring(p, body, prompts, engine.vocab_size) for p in params]
    meta = {"id": f"cmpl-{request_id()}", "created": int(time.time()), "model": name}
    if body.stream:
        streams = [open_stream(engine.stream, ids, p) for ids, p in zip(prompts, params, strict=True)]
        chunks = completion_chunks(meta, body, prompts, merge(streams), engine.tokenizer)
        return sse(chunks, config.request_timeout)
    results = await guarded(request, generate_all(engine, prompts, params), config.request_timeout)
    # A JSONResponse skips FastAPI's recursive jsonable_encoder, which is slow on long token-id lists.
    return JSONResponse(completion_response(meta, body, prompts, results, engine.tokenizer))


async def chat_completions(body: ChatCompletionRequest, request: Request):
    engine, config = request.app.state.engine, request.app.state.config
    name = check_model(body.model, config.model.name, engine.adapter)
    parse_calls = parses_tool_calls(body, config.tool_call_parser)
    ids = await asyncio.to_thread(chat_prompt_ids, body, engine.tokenizer, config.trust_request_chat_template)
    top = (body.top_logprobs or 0) if body.logprobs else 0
    params = sampling_params(body, len(ids), None, top, config, engine)
    meta = {"id": f"chatcmpl-{request_id()}", "created": int(time.time()), "model": name}
    if body.stream:
        stream = open_stream(engine.stream, ids, params)
        return sse(chat_chunks(meta, body, ids, stream, engine.tokenizer, parse_calls), config.request_timeout)
    samples = await guarded(request, engine.generate(ids, params), config.request_timeout)
    return JSONResponse(chat_response(meta, body, ids, samples, engine.tokenizer, parse_calls))


async def generate(body: GenerateRequest, request: Request):
    """vLLM's token-in/token-out route (openai/tokens.py): token ids in, token ids and logprobs out."""
    engine, config = request.app.state.engine, request.app.state.config
    name = check_model(body.model, config.model.name, engine.adapter)
    ids = prompt_token_ids(body.token_ids, engine.tokenizer, engine.vocab_size)
    top = body.sampling_params.logprobs or 0
    params = sampling_params(body.sampling_params, len(ids), None, top, config, engine)
    samples = await guarded(request, engine.generate(ids, params), config.request_timeout)
    return JSONResponse(generate_response(body, name, ids, samples))


class BuiltinModel:
    """The built-in engine as the control plane sees it."""

    backend = "builtin"
    receivers = 1  # seats in a weight broadcast group
    base_name = None  # a LoRA adapter is merged: every name gets the current weights
    unservable = None  # an update is swapped in whole or not at all
    continues = True  # a swap may happen between two decode steps; running rows continue on the new weights

    def __init__(self, engine: Engine):
        self.engine = engine
        self.checksum: str | None = None  # of the weights served (protocol.parity); None: the base weights

    async def prepare(self, source: Path | BroadcastRequest | None) -> tuple[int, LoadedWeights]:
        if source is None:
            return 0, LoadedWeights(0, Path(), self.engine.base_weights)
        if isinstance(source, BroadcastRequest):
            loaded = await self.engine.receive_weights(source)
        else:
            loaded = await self.engine.load_weights(source)
        return loaded.step, loaded

    async def apply(self, prepared: LoadedWeights, inflight: str = "finish") -> None:
        await self.engine.swap(prepared.tensors, prepared.step, inflight)
        self.checksum = prepared.checksum

    def health(self) -> dict[str, Any]:
        e = self.engine
        counters = {"running": e.running, "waiting": e.waiting, "requests": e.requests, "iterations": e.iterations}
        counters |= {"generated_tokens": e.generated_tokens, "recomputed_rows": e.recomputed_rows}
        return counters | ({"adapter": e.adapter} if e.lora is not None else {})
