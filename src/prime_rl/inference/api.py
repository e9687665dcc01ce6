"""HTTP routes of the built-in engine (DESIGN §4): OpenAI completions and chat (plain or streamed; chat
with tools, whose `<tool_call>` blocks come back as `tool_calls`, parsed by utils/tool_calls.py) and
Prometheus metrics, behind the control plane both backends share (control.py: health, API key, body
limit, weight updates).

Requests are pydantic models; everything a client can get wrong (bad JSON, wrong types, a prompt too
long for `max_model_len`, an oversized body, an unusable weight dir) is answered 4xx with an OpenAI-style
error body, never a 500. A full waiting queue is a 429, a request past `request_timeout` a 504; a client
that disconnects cancels its generation. Responses carry vLLM's extras so the orchestrator never
re-tokenizes sampled text: prompt and completion token ids (`return_token_ids`) and logprob tokens spelled
`token_id:<id>` (`return_tokens_as_token_ids`).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.exceptions import HTTPException

from prime_rl.configs.inference import InferenceConfig, StartupError
from prime_rl.inference.control import BroadcastRequest, ControlPlane, error
from prime_rl.inference.engine import Engine, SamplingParams
from prime_rl.inference.engine.engine import Delta, EngineBusy, EngineClosed, Sample
from prime_rl.inference.engine.weights import LoadedWeights
from prime_rl.utils.tool_calls import parse_tool_calls

logger = logging.getLogger("prime_rl")
MAX_TOP_LOGPROBS = 20
SAMPLING_EPS = 1e-5  # vLLM's: temperatures below it sample greedily


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type


# ---- request models (unknown fields are ignored, as vLLM does; unsupported known ones are refused) --

# Parameters the built-in engine does not implement, with the value that means "off": any other value
# is refused rather than silently ignored, since it would change what the caller samples.
UNSUPPORTED = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": None,
    "best_of": 1,
    "echo": False,
    "tools": None,
    "response_format": None,
    "include_stop_str_in_output": False,
}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    n: Annotated[int, Field(ge=1)] = 1
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    temperature: Annotated[float | None, Field(ge=0)] = None
    top_p: Annotated[float | None, Field(gt=0, le=1)] = None
    top_k: Annotated[int | None, Field(ge=-1)] = None
    min_p: Annotated[float | None, Field(ge=0, le=1)] = None
    repetition_penalty: Annotated[float | None, Field(gt=0)] = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _Sampling:
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in (None, UNSUPPORTED[name]):
                raise ValueError(f"{name}={value!r} is not supported by the built-in engine")
        return self


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None


class FunctionDefinition(BaseModel):
    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema, rendered by the chat template as given
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(BaseModel):
    name: Annotated[str, Field(min_length=1)]
    arguments: str | dict[str, Any] = ""

    @field_validator("arguments")
    @classmethod
    def _arguments_object(cls, value: str | dict[str, Any]) -> dict[str, Any]:
        """OpenAI sends the arguments as a JSON string; templates expect the object (as vLLM passes them)."""
        if isinstance(value, dict):
            return value
        if not value:
            return {}
        try:
            parsed = json.loads(value)
        except ValueError:
            raise ValueError("function.arguments must be a JSON object (as a string)") from None
        if not isinstance(parsed, dict):
            raise ValueError("function.arguments must be a JSON object (as a string)")
        return parsed


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, ...: passed to the chat template
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool result: the id of the call it answers

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id (the id of the tool call it answers)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None
    logprobs: bool = False
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[Tool] | None, Field(min_length=1)] = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # unset = auto with tools
    parallel_tool_calls: bool | None = None  # False keeps only the first call of a turn (as vLLM)


# ---- app ------------------------------------------------------------------------------------------


def build_app(engine: Engine, config: InferenceConfig) -> ControlPlane:
    """The OpenAI routes and /metrics behind the shared control plane (health, auth, weight swaps)."""
    if config.tool_call_parser not in (None, "hermes"):
        raise StartupError(
            f"tool_call_parser {config.tool_call_parser!r}: the built-in engine parses only `hermes` tool calls "
            "(other parsers are vLLM's)"
        )
    http_counts: collections.Counter[tuple[str, int]] = collections.Counter()
    app = FastAPI(title="prime-rl inference", docs_url=None, redoc_url=None, openapi_url=None)
    model_name = config.model.name
    tokenizer = engine.tokenizer

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError):
        return error(e.status, e.message, e.type)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_request(request: Request, e: RequestValidationError):
        return error(400, _describe(e))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, e: HTTPException):
        return error(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error")

    @app.exception_handler(Exception)
    async def on_internal_error(request: Request, e: Exception):
        logger.exception(f"{request.method} {request.url.path} failed")
        return error(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    @app.get("/metrics")
    async def metrics():
        return Response(prometheus_text(engine, http_counts), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "prime-rl"}
        cards = [card | {"max_model_len": config.max_model_len}]
        if engine.adapter is not None:  # as vLLM lists a loaded adapter
            cards.append(card | {"id": engine.adapter, "parent": model_name, "max_model_len": config.max_model_len})
        return {"object": "list", "data": cards}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        name = _check_model(body.model, model_name, engine.adapter)
        # Text prompts are tokenized off the event loop (an 8 MB prompt took ~6 s of it).
        split = _split_prompts(body.prompt)
        if any(isinstance(p, str) for p in split):
            prompts = await asyncio.to_thread(lambda: [_prompt_ids(p, tokenizer, engine.vocab_size) for p in split])
        else:
            prompts = [_prompt_ids(p, tokenizer, engine.vocab_size) for p in split]
        params = [_sampling_params(body, len(ids), 16, body.logprobs or 0, config, engine) for ids in prompts]
        meta = {"id": f"cmpl-{_request_id()}", "created": int(time.time()), "model": name}
        if body.stream:
            streams = [_open(engine.stream, ids, p) for ids, p in zip(prompts, params, strict=True)]
            chunks = _completion_chunks(meta, body, prompts, _merge(streams), tokenizer)
            return _sse(chunks, config.request_timeout)
        results = await _guarded(http, _generate_all(engine, prompts, params), config.request_timeout)
        choices = []
        for i, (ids, samples) in enumerate(zip(prompts, results, strict=True)):
            for j, sample in enumerate(samples):
                choice = {
                    "index": i * body.n + j,
                    "text": sample.text,
                    "logprobs": None,
                    "finish_reason": sample.finish_reason,
                }
                if body.logprobs is not None:
                    choice["logprobs"] = _completion_logprobs(sample, tokenizer, body.return_tokens_as_token_ids)
                if body.return_token_ids:
                    choice |= {"prompt_token_ids": ids, "token_ids": sample.token_ids}
                choices.append(choice)
        # A JSONResponse skips FastAPI's recursive jsonable_encoder, which is slow on long token-id lists.
        return JSONResponse(meta | {"object": "text_completion", "choices": choices, "usage": _usage(prompts, results)})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        name = _check_model(body.model, model_name, engine.adapter)
        parse_calls = _parses_tool_calls(body, config.tool_call_parser)
        ids = await asyncio.to_thread(_chat_prompt_ids, body, tokenizer, config.trust_request_chat_template)
        top = (body.top_logprobs or 0) if body.logprobs else 0
        params = _sampling_params(body, len(ids), None, top, config, engine)
        meta = {"id": f"chatcmpl-{_request_id()}", "created": int(time.time()), "model": name}
        if body.stream:
            chunks = _chat_chunks(meta, body, ids, _open(engine.stream, ids, params), tokenizer, parse_calls)
            return _sse(chunks, config.request_timeout)
        samples = await _guarded(http, engine.generate(ids, params), config.request_timeout)
        choices = []
        for j, sample in enumerate(samples):
            message = _assistant_message(sample.text, parse_calls, body.parallel_tool_calls)
            choice = {
                "index": j,
                "message": message,
                "logprobs": None,
                "finish_reason": "tool_calls" if "tool_calls" in message else sample.finish_reason,
            }
            if body.logprobs:
                choice["logprobs"] = {"content": _chat_logprobs(sample, tokenizer, body.return_tokens_as_token_ids)}
            if body.return_token_ids:
                choice["token_ids"] = sample.token_ids
            choices.append(choice)
        response = meta | {"object": "chat.completion", "choices": choices, "usage": _usage([ids], [samples])}
        if body.return_token_ids:
            response["prompt_token_ids"] = ids
        return JSONResponse(response)

    served = BuiltinModel(engine)
    broadcast = config.weight_transfer == "broadcast"
    return ControlPlane(app, served, config.api_key, config.max_body_bytes, http_counts, broadcast=broadcast)


class BuiltinModel:
    """The built-in engine as the control plane sees it."""

    backend = "builtin"
    receivers = 1  # seats in a weight broadcast group
    base_name = None  # a LoRA adapter is merged: every name gets the current weights

    def __init__(self, engine: Engine):
        self.engine = engine

    async def prepare(self, source: Path | BroadcastRequest | None) -> tuple[int, LoadedWeights]:
        if source is None:
            return 0, LoadedWeights(0, Path(), self.engine.base_weights)
        if isinstance(source, BroadcastRequest):
            loaded = await self.engine.receive_weights(source)
        else:
            loaded = await self.engine.load_weights(source)
        return loaded.step, loaded

    async def apply(self, prepared: LoadedWeights) -> None:
        await self.engine.swap(prepared.tensors, prepared.step)

    def health(self) -> dict[str, Any]:
        e = self.engine
        counters = {"running": e.running, "waiting": e.waiting, "requests": e.requests, "iterations": e.iterations}
        counters |= {"generated_tokens": e.generated_tokens}
        return counters | ({"adapter": e.adapter} if e.lora is not None else {})


# ---- request -> engine ----------------------------------------------------------------------------


def _check_model(requested: str | None, served: str, adapter: str | None) -> str:
    """The model name a request is answered under: the served model's, or the loaded LoRA adapter's. Both
    name the same (merged) weights: the engine serves one policy, the step stamped on the response."""
    if requested is None or requested in (served, adapter):
        return requested or served
    names = f"`{served}`" + (f" and the LoRA adapter `{adapter}`" if adapter else "")
    raise APIError(404, f"The model `{requested}` does not exist; this server serves {names}.", "NotFoundError")


def _split_prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """One prompt (text or token ids), or a list of them."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty")
    return list(prompt)


def _prompt_ids(prompt: str | list[int], tokenizer: Any, vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(prompt).input_ids
    bad = [i for i in prompt if not 0 <= i < vocab_size]
    if bad:
        raise APIError(400, f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    return list(prompt)


def _chat_prompt_ids(request: ChatCompletionRequest, tokenizer: Any, trust_template: bool) -> list[int]:
    kwargs = request.chat_template_kwargs or {}
    if not trust_template and ("chat_template" in kwargs or request.model_extra.get("chat_template") is not None):
        # A template is code the server runs; one from a request could loop forever (as vLLM, opt-in only).
        raise APIError(
            400, "a chat_template in the request is refused (start the server with --trust-request-chat-template)"
        )
    if request.model_extra.get("chat_template") is not None:
        kwargs = kwargs | {"chat_template": request.model_extra["chat_template"]}
    messages = [_message_dict(m) for m in request.messages]
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    try:
        if tools and not _template_uses_tools(tokenizer.get_chat_template(kwargs.get("chat_template"), tools)):
            # The model would never see the tools: its answer could not call them, and nothing would say why.
            raise APIError(
                400, "tools were given, but this model's chat template does not render them (it never uses `tools`)"
            )
        text = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
        )
    except APIError:
        raise
    except Exception as e:  # jinja raises its own errors for messages the template rejects
        raise APIError(400, f"cannot apply the chat template: {e}") from None
    if not isinstance(text, str):
        raise APIError(400, "the chat template did not produce text for these messages")
    return tokenizer(text, add_special_tokens=False).input_ids


@functools.lru_cache(maxsize=16)
def _template_uses_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` variable (a template that cannot be parsed here is given the
    benefit of the doubt: rendering it reports its own errors)."""
    import jinja2
    import jinja2.meta
    import jinja2.sandbox

    try:
        ast = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return True
    return "tools" in jinja2.meta.find_undeclared_variables(ast)


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    out = message.model_dump(exclude_none=True)
    out.setdefault("content", "")  # e.g. an assistant turn of tool calls only (vLLM renders it as "")
    if isinstance(message.content, list):
        if any(part.get("type") != "text" for part in message.content):
            raise APIError(400, "only text content parts are supported")
        out["content"] = "".join(str(part.get("text", "")) for part in message.content)
    return out


def _parses_tool_calls(request: ChatCompletionRequest, parser: str | None) -> bool:
    """Whether this request's answers are parsed for tool calls (tools given, tool_choice unset or "auto").

    Tools are rendered into the prompt whatever the tool_choice (also "none", as vLLM does). "required" and
    a named function are refused: forcing a call takes constrained decoding, which the built-in engine does
    not have (and tokens the server forced would not be the policy's samples that RL trains on).
    """
    choice = request.tool_choice
    if request.tools is None:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools")
        return False
    if choice == "none":
        return False
    if parser is None:
        raise APIError(400, 'tool calling is off on this server (tool_call_parser unset); send tool_choice "none"')
    if choice == "required" or isinstance(choice, NamedToolChoice):
        shown = choice if choice == "required" else f"function {choice.function.name!r}"
        raise APIError(
            400,
            f"tool_choice {shown} needs constrained decoding, which the built-in engine does not have: "
            'use "auto" (the model decides) or the vLLM backend',
        )
    return True


def _sampling_params(
    request: _Sampling,
    prompt_len: int,
    default_max_tokens: int | None,
    top_logprobs: int,
    config: InferenceConfig,
    engine: Engine,
) -> SamplingParams:
    if prompt_len == 0:
        raise APIError(400, "prompt must contain at least one token")
    if request.n > engine.max_batch_size:
        raise APIError(400, f"n={request.n} is more than this server's engine.max_batch_size {engine.max_batch_size}")
    room = config.max_model_len - prompt_len
    max_tokens = getattr(request, "max_completion_tokens", None) or request.max_tokens or default_max_tokens or room
    if room < 1 or max_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {config.max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion).",
        )
    stop_ids = request.stop_token_ids or []
    if any(not 0 <= i < engine.vocab_size for i in stop_ids):
        raise APIError(400, f"stop_token_ids must be in [0, {engine.vocab_size})")
    stop = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
    return SamplingParams(
        n=request.n,
        max_tokens=max_tokens,
        min_tokens=min(request.min_tokens, max_tokens),
        temperature=_temperature(request.temperature),
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=-1 if request.top_k is None else request.top_k,
        min_p=request.min_p or 0.0,
        repetition_penalty=request.repetition_penalty or 1.0,
        seed=request.seed,
        stop=tuple(s for s in stop if s),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=request.ignore_eos,
        top_logprobs=top_logprobs,
    )


def _temperature(requested: float | None) -> float:
    """1 when unset; below 1e-5 greedy (0), as vLLM: logits / 1e-39 overflow to inf and the logprobs to NaN."""
    if requested is None:
        return 1.0
    return 0.0 if requested < SAMPLING_EPS else requested


def _http_error(e: BaseException) -> BaseException:
    """The HTTP error for an engine refusal (also inside a TaskGroup's ExceptionGroup); others pass through."""
    while isinstance(e, ExceptionGroup):
        e = e.exceptions[0]
    if isinstance(e, EngineBusy):
        return APIError(429, str(e), "rate_limit_error")
    if isinstance(e, EngineClosed):
        return APIError(503, str(e), "server_error")
    return e


def _open(fn, *args):
    """Submit a stream now (so a full queue is a 429 before any bytes are streamed); it is read later."""
    try:
        return fn(*args)
    except (EngineBusy, EngineClosed) as e:
        raise _http_error(e) from None


def _request_id() -> str:
    # 128 random bits like uuid4, without uuid4's os.urandom call per request (7% of the event loop at c=64).
    return f"{random.getrandbits(128):032x}"


async def _generate_all(engine: Engine, prompts, params) -> list[list[Sample]]:
    async with asyncio.TaskGroup() as group:  # one failure cancels the siblings
        tasks = [group.create_task(engine.generate(ids, p)) for ids, p in zip(prompts, params, strict=True)]
    return [t.result() for t in tasks]


async def _guarded(http: Request, work: Awaitable, timeout: float):
    """Await `work`; cancel it when the client disconnects (answering nothing) or after `timeout` (504)."""

    async def disconnected() -> None:
        # The body was read already (the control plane replays it), so the next ASGI message is the
        # disconnect. Awaiting it costs nothing while the request runs; polling `is_disconnected()` every
        # 0.2 s per request took a quarter of the event loop's time at 64 requests in flight and competed
        # with the engine for the GIL.
        while (await http.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        try:
            return task.result()
        except (EngineBusy, EngineClosed, ExceptionGroup) as e:
            raise _http_error(e) from None
    task.cancel()
    if watcher in done:
        raise APIError(499, "client disconnected")
    raise APIError(504, f"generation did not finish within request_timeout={timeout}s", "timeout_error")


async def _merge(streams: list[AsyncIterator[list[Delta]]]) -> AsyncIterator[tuple[int, list[Delta]]]:
    """(prompt index, deltas) from several streams as they come."""
    if len(streams) == 1:
        async for deltas in streams[0]:
            yield 0, deltas
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        try:
            async for deltas in stream:
                await queue.put((i, deltas))
            await queue.put((i, None))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


# ---- engine -> response ---------------------------------------------------------------------------


def _sse(chunks: AsyncIterator[dict[str, Any]], timeout: float) -> StreamingResponse:
    """Server-sent events in OpenAI's format: `data: <json>` per chunk, then `data: [DONE]`."""

    async def events() -> AsyncIterator[str]:
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            while True:
                # The deadline covers waiting for the next chunk only: a timeout around the `yield` would
                # cancel the response's own `send` instead, cutting the stream without the error or [DONE].
                async with asyncio.timeout_at(deadline):
                    try:
                        chunk = await anext(chunks)
                    except StopAsyncIteration:
                        break
                yield f"data: {json.dumps(chunk)}\n\n"
        except TimeoutError:
            error = {"message": f"generation did not finish within request_timeout={timeout}s", "code": 504}
            yield f"data: {json.dumps({'error': error | {'type': 'timeout_error'}})}\n\n"
        except (EngineClosed, RuntimeError) as e:
            yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error', 'code': 503}})}\n\n"
        finally:
            await chunks.aclose()  # a client that left mid-stream cancels its generation now, not at GC
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _completion_chunks(meta, body: CompletionRequest, prompts, merged, tokenizer):
    """One chunk per choice update (as vLLM streams), then a usage chunk when asked for."""
    generated = 0
    async for i, deltas in merged:
        for d in deltas:
            choice = {"index": i * body.n + d.index, "text": d.text, "logprobs": None, "finish_reason": d.finish_reason}
            if body.logprobs is not None:
                choice["logprobs"] = _completion_logprobs(d, tokenizer, body.return_tokens_as_token_ids)
            if body.return_token_ids:
                choice |= {"prompt_token_ids": prompts[i], "token_ids": d.token_ids}
            generated += len(d.token_ids)
            yield meta | {"object": "text_completion", "choices": [choice]}
    if (body.stream_options or {}).get("include_usage"):
        prompt_tokens = sum(len(p) for p in prompts) * body.n
        yield meta | {"object": "text_completion", "choices": [], "usage": _usage_of(prompt_tokens, generated)}


async def _chat_chunks(meta, body: ChatCompletionRequest, prompt_ids, stream, tokenizer, parse_calls: bool):
    """One chunk per choice update; a choice's first chunk carries the role (and `prompt_token_ids`).

    With tool parsing on, a choice's text is held back (its chunks still carry token ids and logprobs as
    they come) and its last chunk carries the whole parsed message: content, then `tool_calls`, each with
    its `index`, as OpenAI streams them. Simple and never wrong; the text arrives only at the end.
    """
    generated, started = 0, set()
    held: collections.defaultdict[int, list[str]] = collections.defaultdict(list)
    meta = meta | {"object": "chat.completion.chunk"}
    async for deltas in stream:
        for d in deltas:
            delta: dict[str, Any] = {"content": d.text}
            finish_reason = d.finish_reason
            if parse_calls:
                held[d.index].append(d.text)
                delta["content"] = ""
                if d.finish_reason is not None:
                    message = _assistant_message("".join(held.pop(d.index)), True, body.parallel_tool_calls)
                    delta["content"] = message["content"]
                    if "tool_calls" in message:
                        delta["tool_calls"] = [call | {"index": k} for k, call in enumerate(message["tool_calls"])]
                        finish_reason = "tool_calls"
            first = d.index not in started
            if first:
                started.add(d.index)
                delta = {"role": "assistant"} | delta
            choice = {"index": d.index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            if body.logprobs:
                choice["logprobs"] = {"content": _chat_logprobs(d, tokenizer, body.return_tokens_as_token_ids)}
            if body.return_token_ids:
                choice["token_ids"] = d.token_ids
            generated += len(d.token_ids)
            chunk = meta | {"choices": [choice]}
            if body.return_token_ids and first:
                chunk["prompt_token_ids"] = prompt_ids
            yield chunk
    if (body.stream_options or {}).get("include_usage"):
        yield meta | {"choices": [], "usage": _usage_of(len(prompt_ids), generated)}


def _assistant_message(text: str, parse_calls: bool, parallel_tool_calls: bool | None) -> dict[str, Any]:
    """The assistant message of a sample. With tool parsing on, its well-formed `<tool_call>` blocks become
    `tool_calls` and leave the content (None when nothing else is said, as OpenAI); the text is unchanged
    when it holds no call. Token ids and logprobs are the raw sample's either way."""
    if parse_calls:
        content, calls = parse_tool_calls(text)
        if calls:
            calls = calls[:1] if parallel_tool_calls is False else calls
            return {"role": "assistant", "content": content or None, "tool_calls": calls}
    return {"role": "assistant", "content": text}


def _usage(prompts: list[list[int]], results: list[list[Sample]]) -> dict[str, int]:
    prompt_tokens = sum(len(ids) for ids in prompts)
    completion_tokens = sum(len(s.token_ids) for samples in results for s in samples)
    return _usage_of(prompt_tokens, completion_tokens)


def _usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _token_name(token_id: int, tokenizer: Any, as_id: bool) -> str:
    return f"token_id:{token_id}" if as_id else tokenizer.decode([token_id])


def _completion_logprobs(sample: Sample | Delta, tokenizer: Any, as_ids: bool) -> dict[str, Any]:
    texts = [tokenizer.decode([t]) for t in sample.token_ids]
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    tops = []
    for token, logprob, alternatives in zip(
        sample.token_ids, sample.logprobs, sample.top_logprobs or [[]] * len(sample.token_ids), strict=True
    ):
        top = {_token_name(t, tokenizer, as_ids): lp for t, lp in alternatives}
        top.setdefault(_token_name(token, tokenizer, as_ids), logprob)  # the sampled token is always listed
        tops.append(top)
    return {
        "tokens": [_token_name(t, tokenizer, as_ids) for t in sample.token_ids],
        "token_logprobs": sample.logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _chat_logprobs(sample: Sample | Delta, tokenizer: Any, as_ids: bool) -> list[dict[str, Any]]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": _token_name(token_id, tokenizer, as_ids), "logprob": logprob, "bytes": list(text.encode())}

    alternatives = sample.top_logprobs or [[]] * len(sample.token_ids)
    return [
        entry(token, logprob) | {"top_logprobs": [entry(t, lp) for t, lp in top]}
        for token, logprob, top in zip(sample.token_ids, sample.logprobs, alternatives, strict=True)
    ]


def prometheus_text(engine: Engine, http_counts: collections.Counter) -> bytes:
    """The engine's state in Prometheus text format (one fresh registry per scrape, so no global state)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class Snapshot:
        def collect(self):
            http = CounterMetricFamily(
                "prime_rl_inference_http_requests", "HTTP requests answered", labels=["route", "status"]
            )
            for (route, status), count in sorted(http_counts.items()):
                http.add_metric([route, str(status)], count)
            yield http
            yield CounterMetricFamily(
                "prime_rl_inference_requests", "generation requests admitted to the batch", value=engine.requests
            )
            yield CounterMetricFamily(
                "prime_rl_inference_generated_tokens", "tokens generated", value=engine.generated_tokens
            )
            yield GaugeMetricFamily("prime_rl_inference_running", "sequences being decoded", value=engine.running)
            yield GaugeMetricFamily("prime_rl_inference_waiting", "requests waiting for a slot", value=engine.waiting)
            yield GaugeMetricFamily(
                "prime_rl_inference_tokens_per_second",
                "generated tokens per second over the last 10 s",
                value=engine.tokens_per_second(),
            )
            yield GaugeMetricFamily("prime_rl_inference_weight_step", "weight step being served", value=engine.step)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Snapshot())
    return generate_latest(registry)


def _describe(error: RequestValidationError) -> str:
    """One readable line per problem, e.g. `body.n: Input should be greater than or equal to 1`."""
    problems = []
    for e in error.errors():
        where = ".".join(str(part) for part in e.get("loc", ()))
        problems.append(f"{where}: {e.get('msg', 'invalid')}" if where else str(e.get("msg", "invalid")))
    return "invalid request: " + "; ".join(problems)[:2000]
