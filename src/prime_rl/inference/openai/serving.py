"""Request → engine and engine → response for the built-in engine's OpenAI routes (non-streamed; stream.py
streams the same choices).

A request becomes prompt token ids and `SamplingParams` here, with every client mistake (unknown model, a
prompt too long for `max_model_len`, token ids out of range, a chat template that fails) an `APIError`; an
engine refusal becomes a 429 (queue full) or 503 (shutting down), a request the engine failed (alone: the
others in its batch go on) a 500. Responses carry vLLM's extras so the orchestrator never re-tokenizes
sampled text: prompt and completion token ids (`return_token_ids`) and logprob tokens spelled `token_id:<id>`
(`return_tokens_as_token_ids`); with `return_sampling_mask` each logprob entry also holds its token's kept set
(`sampling_mask`, sorted ids; [] = nothing filtered) and a logprob renormalised over it (sampling.py). Every
choice carries `weight_steps`, the weight-step spans of its tokens (one span unless weights were swapped
while it ran; streamed: on its last chunk). Every choice, streamed or not, is built by `build_choice`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random
from collections.abc import Awaitable
from typing import Any

from fastapi import Request

from prime_rl.configs.inference import InferenceConfig
from prime_rl.inference.engine import Delta, Engine, EngineBusy, EngineClosed, RequestFailed, Sample, SamplingParams
from prime_rl.inference.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    SamplingFields,
    context_overflow,
)
from prime_rl.utils.tool_calls import parse_tool_calls

SAMPLING_EPS = 1e-5  # vLLM's: temperatures below it sample greedily

# ---- request -> engine ----------------------------------------------------------------------------


def check_model(requested: str | None, served: str, adapter: str | None) -> str:
    """The model name a request is answered under: the served model's, or the loaded LoRA adapter's. Both
    name the same (merged) weights: the engine serves one policy, the step stamped on the response."""
    if requested is None or requested in (served, adapter):
        return requested or served
    names = f"`{served}`" + (f" and the LoRA adapter `{adapter}`" if adapter else "")
    raise APIError(404, f"The model `{requested}` does not exist; this server serves {names}.", "NotFoundError")


async def completion_prompts(body: CompletionRequest, engine: Engine) -> list[list[int]]:
    """The token ids of each prompt of a completion request."""
    split = _split_prompts(body.prompt)
    if any(isinstance(p, str) for p in split):
        # Text prompts are tokenized off the event loop (an 8 MB prompt took ~6 s of it).
        return await asyncio.to_thread(
            lambda: [prompt_token_ids(p, engine.tokenizer, engine.vocab_size) for p in split]
        )
    return [prompt_token_ids(p, engine.tokenizer, engine.vocab_size) for p in split]


def _split_prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """One prompt (text or token ids), or a list of them."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty")
    return list(prompt)


def prompt_token_ids(prompt: str | list[int], tokenizer: Any, vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(prompt).input_ids
    bad = [i for i in prompt if not 0 <= i < vocab_size]
    if bad:
        raise APIError(400, f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    return list(prompt)


def chat_prompt_ids(request: ChatCompletionRequest, tokenizer: Any, trust_template: bool) -> list[int]:
    """The messages (and tools) rendered by the chat template, with the generation prompt, as token ids."""
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


def parses_tool_calls(request: ChatCompletionRequest, parser: str | None) -> bool:
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


def sampling_params(
    request: SamplingFields,
    prompt_len: int,
    default_max_tokens: int | None,
    top_logprobs: int,
    config: InferenceConfig,
    engine: Engine,
) -> SamplingParams:
    """The engine's parameters for one prompt of `request`, refusing what does not fit the server."""
    if prompt_len == 0:
        raise APIError(400, "prompt must contain at least one token")
    if request.n > engine.max_batch_size:
        raise APIError(400, f"n={request.n} is more than this server's engine.max_batch_size {engine.max_batch_size}")
    room = config.max_model_len - prompt_len
    # Only chat declares max_completion_tokens; on a completion it is an unknown field (ignored, as vLLM does).
    chat_max = request.max_completion_tokens if isinstance(request, ChatCompletionRequest) else None
    max_tokens = chat_max or request.max_tokens or default_max_tokens or room
    if (overflow := context_overflow(config.max_model_len, prompt_len, max_tokens)) is not None:
        raise APIError(400, overflow)
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
        return_sampling_mask=request.return_sampling_mask,
        prompt_logprobs=request.prompt_logprobs if isinstance(request, CompletionRequest) else None,
    )


def with_prompt_scoring(params: SamplingParams, body: CompletionRequest, prompts: list[list[int]], vocab: int):
    """`params` with the prompt scoring of our extension (`prompt_logprobs_temperature`, `prompt_logprobs_kept`,
    protocol.CompletionRequest), each kept set checked against the one prompt it is for: a position in [1, L),
    ids in the vocabulary, the prompt's token among them (else its logprob would be -inf)."""
    kept = body.prompt_logprobs_kept
    if kept and len(prompts) != 1:
        raise APIError(400, f"prompt_logprobs_kept names positions of one prompt; this request has {len(prompts)}")
    for position, ids in (kept or {}).items():
        prompt = prompts[0]
        if not 1 <= position < len(prompt):
            raise APIError(400, f"prompt_logprobs_kept position {position} is outside [1, {len(prompt)})")
        if any(not 0 <= i < vocab for i in ids):
            raise APIError(400, f"prompt_logprobs_kept[{position}] has token ids outside [0, {vocab})")
        if prompt[position] not in ids:
            raise APIError(400, f"prompt_logprobs_kept[{position}] does not hold the prompt's token {prompt[position]}")
    temperature = _temperature(body.prompt_logprobs_temperature)
    return dataclasses.replace(params, prompt_temperature=temperature, prompt_kept=kept or None)


def _temperature(requested: float | None) -> float:
    """1 when unset; below 1e-5 greedy (0), as vLLM: logits / 1e-39 overflow to inf and the logprobs to NaN."""
    if requested is None:
        return 1.0
    return 0.0 if requested < SAMPLING_EPS else requested


def http_error(e: BaseException) -> BaseException:
    """The HTTP error for an engine refusal or failure (also inside a TaskGroup's ExceptionGroup); others pass
    through."""
    while isinstance(e, ExceptionGroup):
        e = e.exceptions[0]
    if isinstance(e, EngineBusy):
        return APIError(429, str(e), "rate_limit_error")
    if isinstance(e, EngineClosed):
        return APIError(503, str(e), "server_error")
    if isinstance(e, RequestFailed):
        return APIError(500, str(e), "server_error")
    return e


def open_stream(fn, *args):
    """Submit a stream now (so a full queue is a 429 before any bytes are streamed); it is read later."""
    try:
        return fn(*args)
    except (EngineBusy, EngineClosed) as e:
        raise http_error(e) from None


def request_id() -> str:
    # 128 random bits like uuid4, without uuid4's os.urandom call per request (7% of the event loop at c=64).
    return f"{random.getrandbits(128):032x}"


async def generate_all(engine: Engine, prompts, params) -> list[list[Sample]]:
    async with asyncio.TaskGroup() as group:  # one failure cancels the siblings
        tasks = [group.create_task(engine.generate(ids, p)) for ids, p in zip(prompts, params, strict=True)]
    return [t.result() for t in tasks]


async def guarded(http: Request, work: Awaitable, timeout: float):
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
        except (EngineBusy, EngineClosed, RequestFailed, ExceptionGroup) as e:
            raise http_error(e) from None
    task.cancel()
    if watcher in done:
        raise APIError(499, "client disconnected")
    raise APIError(504, f"generation did not finish within request_timeout={timeout}s", "timeout_error")


# ---- engine -> response ---------------------------------------------------------------------------


def build_choice(
    index: int,
    sample: Sample | Delta,
    body: CompletionRequest | ChatCompletionRequest,
    tokenizer: Any,
    fields: dict[str, Any],
    finish_reason: str | None,
    prompt_ids: list[int] | None = None,
) -> dict[str, Any]:
    """One entry of a response's `choices`, streamed or not, with its `weight_steps` (which step sampled which
    tokens, protocol/spans.py; on a streamed choice's last chunk).

    `fields` are the choice's own: `{"text"}` of a completion, `{"message"}` or `{"delta"}` of a chat, whose
    logprobs are spelled differently. `prompt_ids` go into a completion choice (a chat response carries them
    once, beside its choices).
    """
    choice = {"index": index} | fields | {"logprobs": None, "finish_reason": finish_reason}
    as_ids = body.return_tokens_as_token_ids
    if "text" in fields and body.logprobs is not None:
        choice["logprobs"] = completion_logprobs(sample, tokenizer, as_ids)
    elif "text" not in fields and body.logprobs:
        choice["logprobs"] = {"content": chat_logprobs(sample, tokenizer, as_ids)}
    if body.return_token_ids:
        choice |= ({} if prompt_ids is None else {"prompt_token_ids": prompt_ids}) | {"token_ids": sample.token_ids}
    if sample.weight_steps is not None:  # a sample's, or the last delta of a streamed one
        choice["weight_steps"] = sample.weight_steps
    return choice


def completion_response(meta, body: CompletionRequest, prompts, results: list[list[Sample]], tokenizer: Any):
    """The `text_completion` answer: `body.n` choices per prompt, numbered across prompts."""
    choices = [
        build_choice(i * body.n + j, sample, body, tokenizer, {"text": sample.text}, sample.finish_reason, ids)
        for i, (ids, samples) in enumerate(zip(prompts, results, strict=True))
        for j, sample in enumerate(samples)
    ]
    if body.prompt_logprobs is not None:
        pairs = zip(prompts, results, strict=True)
        scored = [prompt_logprobs_json(ids, samples[0].prompt_logprobs, tokenizer) for ids, samples in pairs]
        for i, choice in enumerate(choices):
            choice["prompt_logprobs"] = scored[i // body.n]
            if body.prompt_logprobs_temperature is not None:  # the echo a client checks (protocol.py)
                choice["prompt_logprobs_temperature"] = body.prompt_logprobs_temperature
    return meta | {"object": "text_completion", "choices": choices, "usage": _usage(prompts, results)}


def prompt_logprobs_json(prompt_ids: list[int], scores: list, tokenizer: Any) -> list[dict[str, Any] | None]:
    """A choice's `prompt_logprobs` as vLLM writes them: None for the first token, then per position a dict
    {token id: {"logprob", "rank", "decoded_token"}} holding the prompt token and the top alternatives (ranked
    1..k); -inf is written -9999.0, as vLLM clamps it.

    prompt [5, 7] scored with top 0 -> [None, {"7": {"logprob": -1.2, "rank": 3, "decoded_token": "b"}}]
    """
    named = sorted(set(prompt_ids[1:]) | {t for s in scores[1:] for t, _ in s.top})
    text = dict(zip(named, tokenizer.batch_decode([[t] for t in named]), strict=True))

    def entry(logprob: float, rank: int, token: int) -> dict[str, Any]:
        return {"logprob": max(logprob, -9999.0), "rank": rank, "decoded_token": text[token]}

    out: list[dict[str, Any] | None] = [None]
    for token, score in zip(prompt_ids[1:], scores[1:], strict=True):
        position = {str(token): entry(score.logprob, score.rank, token)}
        position |= {str(t): entry(lp, k + 1, t) for k, (t, lp) in enumerate(score.top)}
        out.append(position)
    return out


def chat_response(meta, body: ChatCompletionRequest, ids, samples: list[Sample], tokenizer: Any, parse_calls: bool):
    """The `chat.completion` answer, with tool calls parsed out of each message when `parse_calls`."""
    choices = []
    for j, sample in enumerate(samples):
        message = assistant_message(sample.text, parse_calls, body.parallel_tool_calls)
        finish_reason = "tool_calls" if "tool_calls" in message else sample.finish_reason
        choices.append(build_choice(j, sample, body, tokenizer, {"message": message}, finish_reason))
    response = meta | {"object": "chat.completion", "choices": choices, "usage": _usage([ids], [samples])}
    if body.return_token_ids:
        response["prompt_token_ids"] = ids
    return response


def assistant_message(text: str, parse_calls: bool, parallel_tool_calls: bool | None) -> dict[str, Any]:
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
    return usage_of(prompt_tokens, completion_tokens)


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _token_name(token_id: int, tokenizer: Any, as_id: bool) -> str:
    return f"token_id:{token_id}" if as_id else tokenizer.decode([token_id])


def completion_logprobs(sample: Sample | Delta, tokenizer: Any, as_ids: bool) -> dict[str, Any]:
    texts = [tokenizer.decode([t]) for t in sample.token_ids]
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    tops = []
    for token, logprob, alternatives in zip(
        sample.token_ids, sample.logprobs, sample.top_logprobs or [[]] * len(sample.token_ids), strict=True
    ):
        top = {_token_name(t, tokenizer, as_ids): lp for t, lp in alternatives}
        top.setdefault(_token_name(token, tokenizer, as_ids), logprob)  # the sampled token is always listed
        tops.append(top)
    out = {
        "tokens": [_token_name(t, tokenizer, as_ids) for t in sample.token_ids],
        "token_logprobs": sample.logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    if sample.sampling_mask:  # per token its kept set (return_sampling_mask)
        out["sampling_mask"] = sample.sampling_mask
    return out


def chat_logprobs(sample: Sample | Delta, tokenizer: Any, as_ids: bool) -> list[dict[str, Any]]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": _token_name(token_id, tokenizer, as_ids), "logprob": logprob, "bytes": list(text.encode())}

    alternatives = sample.top_logprobs or [[]] * len(sample.token_ids)
    entries = [
        entry(token, logprob) | {"top_logprobs": [entry(t, lp) for t, lp in top]}
        for token, logprob, top in zip(sample.token_ids, sample.logprobs, alternatives, strict=True)
    ]
    for e, kept in zip(entries, sample.sampling_mask, strict=False):  # with return_sampling_mask: the kept set
        e["sampling_mask"] = kept
    return entries
