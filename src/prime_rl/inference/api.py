"""HTTP routes of the built-in engine (DESIGN §4): OpenAI completions and chat, health, weight updates.

Requests are pydantic models; everything a client can get wrong (bad JSON, wrong types, a prompt too
long for `max_model_len`, an unusable weight dir) is answered 4xx with an OpenAI-style error body, never
a 500. Responses carry vLLM's extras so the orchestrator never re-tokenizes sampled text: prompt and
completion token ids (`return_token_ids`) and logprob tokens spelled `token_id:<id>`
(`return_tokens_as_token_ids`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException

from prime_rl.inference.config import InferenceConfig
from prime_rl.inference.engine import Engine, Sample, SamplingParams, WeightsError

logger = logging.getLogger("prime_rl")
MAX_TOP_LOGPROBS = 20


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type


# ---- request models (unknown fields are ignored, as vLLM does; unsupported known ones are refused) --

# Parameters the built-in engine does not implement yet, with the value that means "off": any other value
# is refused rather than silently ignored, since it would change what the caller samples.
UNSUPPORTED = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
    "logit_bias": None,
    "best_of": 1,
    "echo": False,
    "tools": None,
    "response_format": None,
}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: Annotated[int, Field(ge=1)] = 1
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    temperature: Annotated[float | None, Field(ge=0)] = None
    top_p: Annotated[float | None, Field(gt=0, le=1)] = None
    top_k: Annotated[int | None, Field(ge=-1)] = None
    min_p: Annotated[float | None, Field(ge=0, le=1)] = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _Sampling:
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in (None, UNSUPPORTED[name]):
                raise ValueError(f"{name}={value!r} is not supported by the built-in engine yet")
        return self


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: passed to the chat template
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None
    logprobs: bool = False
    top_logprobs: Annotated[int | None, Field(ge=0, le=MAX_TOP_LOGPROBS)] = None
    chat_template_kwargs: dict[str, Any] | None = None


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    weight_dir: str


# ---- app ------------------------------------------------------------------------------------------


def build_app(engine: Engine, config: InferenceConfig) -> FastAPI:
    app = FastAPI(title="prime-rl inference", docs_url=None, redoc_url=None)
    model_name = config.model.name
    tokenizer = engine.tokenizer

    @app.middleware("http")
    async def require_api_key(request: Request, call_next):
        if config.api_key and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
                return _error(
                    401, "missing or wrong API key (send `Authorization: Bearer <key>`)", "authentication_error"
                )
        return await call_next(request)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError):
        return _error(e.status, e.message, e.type)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_request(request: Request, e: RequestValidationError):
        return _error(400, _describe(e))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, e: HTTPException):
        return _error(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error")

    @app.exception_handler(Exception)
    async def on_internal_error(request: Request, e: Exception):
        logger.exception(f"{request.method} {request.url.path} failed")
        return _error(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    @app.get("/health")
    async def health():
        return {"status": "ok", "step": engine.step, "batches": engine.batches, "requests": engine.requests}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "prime-rl"}
        return {"object": "list", "data": [card | {"max_model_len": config.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        _check_model(request.model, model_name)
        prompts = [_prompt_ids(p, tokenizer, engine.vocab_size) for p in _split_prompts(request.prompt)]
        params = [_sampling_params(request, len(ids), 16, request.logprobs or 0, config) for ids in prompts]
        results = await asyncio.gather(*(engine.generate(ids, p) for ids, p in zip(prompts, params, strict=True)))
        choices = []
        for i, (ids, samples) in enumerate(zip(prompts, results, strict=True)):
            for j, sample in enumerate(samples):
                choice = {
                    "index": i * request.n + j,
                    "text": sample.text,
                    "logprobs": None,
                    "finish_reason": sample.finish_reason,
                }
                if request.logprobs is not None:
                    choice["logprobs"] = _completion_logprobs(sample, tokenizer, request.return_tokens_as_token_ids)
                if request.return_token_ids:
                    choice |= {"prompt_token_ids": ids, "token_ids": sample.token_ids}
                choices.append(choice)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": _usage(prompts, results),
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest):
        _check_model(request.model, model_name)
        ids = _chat_prompt_ids(request, tokenizer)
        top = (request.top_logprobs or 0) if request.logprobs else 0
        params = _sampling_params(request, len(ids), None, top, config)
        samples = await engine.generate(ids, params)
        choices = []
        for j, sample in enumerate(samples):
            choice = {
                "index": j,
                "message": {"role": "assistant", "content": sample.text},
                "logprobs": None,
                "finish_reason": sample.finish_reason,
            }
            if request.logprobs:
                choice["logprobs"] = {"content": _chat_logprobs(sample, tokenizer, request.return_tokens_as_token_ids)}
            if request.return_token_ids:
                choice["token_ids"] = sample.token_ids
            choices.append(choice)
        response = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": choices,
            "usage": _usage([ids], [samples]),
        }
        if request.return_token_ids:
            response["prompt_token_ids"] = ids
        return response

    @app.post("/update_weights")
    async def update_weights(request: UpdateWeightsRequest):
        start = time.perf_counter()
        try:
            step = await engine.update_weights(Path(request.weight_dir))
        except WeightsError as e:
            raise APIError(400, str(e)) from None
        return {"step": step, "weight_dir": request.weight_dir, "seconds": round(time.perf_counter() - start, 3)}

    @app.post("/reload_weights")
    async def reload_weights():
        start = time.perf_counter()
        step = await engine.reload_weights()
        return {"step": step, "seconds": round(time.perf_counter() - start, 3)}

    return app


# ---- request -> engine ----------------------------------------------------------------------------


def _check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(404, f"The model `{requested}` does not exist; this server serves `{served}`.", "NotFoundError")


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


def _chat_prompt_ids(request: ChatCompletionRequest, tokenizer: Any) -> list[int]:
    messages = [_message_dict(m) for m in request.messages]
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(request.chat_template_kwargs or {})
        )
    except Exception as e:  # jinja raises its own errors for messages the template rejects
        raise APIError(400, f"cannot apply the chat template: {e}") from None
    return tokenizer(text, add_special_tokens=False).input_ids


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    out = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        if any(part.get("type") != "text" for part in message.content):
            raise APIError(400, "only text content parts are supported")
        out["content"] = "".join(str(part.get("text", "")) for part in message.content)
    return out


def _sampling_params(
    request: _Sampling, prompt_len: int, default_max_tokens: int | None, top_logprobs: int, config: InferenceConfig
) -> SamplingParams:
    if request.stream:
        raise APIError(400, "streaming is not supported yet by the built-in engine")
    if prompt_len == 0:
        raise APIError(400, "prompt must contain at least one token")
    room = config.max_model_len - prompt_len
    max_tokens = getattr(request, "max_completion_tokens", None) or request.max_tokens or default_max_tokens or room
    if room < 1 or max_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {config.max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion).",
        )
    stop = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
    return SamplingParams(
        n=request.n,
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=-1 if request.top_k is None else request.top_k,
        min_p=request.min_p or 0.0,
        seed=request.seed,
        stop=tuple(s for s in stop if s),
        top_logprobs=top_logprobs,
    )


# ---- engine -> response ---------------------------------------------------------------------------


def _usage(prompts: list[list[int]], results: list[list[Sample]]) -> dict[str, int]:
    prompt_tokens = sum(len(ids) for ids in prompts)
    completion_tokens = sum(len(s.token_ids) for samples in results for s in samples)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _token_name(token_id: int, tokenizer: Any, as_id: bool) -> str:
    return f"token_id:{token_id}" if as_id else tokenizer.decode([token_id])


def _completion_logprobs(sample: Sample, tokenizer: Any, as_ids: bool) -> dict[str, Any]:
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


def _chat_logprobs(sample: Sample, tokenizer: Any, as_ids: bool) -> list[dict[str, Any]]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": _token_name(token_id, tokenizer, as_ids), "logprob": logprob, "bytes": list(text.encode())}

    alternatives = sample.top_logprobs or [[]] * len(sample.token_ids)
    return [
        entry(token, logprob) | {"top_logprobs": [entry(t, lp) for t, lp in top]}
        for token, logprob, top in zip(sample.token_ids, sample.logprobs, alternatives, strict=True)
    ]


def _error(status: int, message: str, type: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "code": status}}, status_code=status)


def _describe(error: RequestValidationError) -> str:
    """One readable line per problem, e.g. `body.n: Input should be greater than or equal to 1`."""
    problems = []
    for e in error.errors():
        where = ".".join(str(part) for part in e.get("loc", ()))
        problems.append(f"{where}: {e.get('msg', 'invalid')}" if where else str(e.get("msg", "invalid")))
    return "invalid request: " + "; ".join(problems)
