"""Streamed answers of the built-in engine's OpenAI routes: engine deltas → OpenAI chunks → server-sent events.

Chunks carry the same choices as the non-streamed answers (serving.build_choice), one per choice update as
vLLM streams them, then a usage chunk when `stream_options.include_usage` asks for it. Every stream ends with
`data: [DONE]`: one past `request_timeout`, one the engine ends (shutting down, or failing this request) or
one whose chunk cannot be built gets an error event first. A client that leaves mid-stream cancels its
generation.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from prime_rl.inference.engine import Delta
from prime_rl.inference.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest
from prime_rl.inference.openai.serving import assistant_message, build_choice, http_error, usage_of

logger = logging.getLogger("prime_rl")


async def merge(streams: list[AsyncIterator[list[Delta]]]) -> AsyncIterator[tuple[int, list[Delta]]]:
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


def sse(chunks: AsyncIterator[dict[str, Any]], timeout: float) -> StreamingResponse:
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
        except Exception as e:  # the engine failed it or shuts down, or a chunk could not be built: say so
            failure = http_error(e)
            if not isinstance(failure, APIError):
                logger.exception("a stream failed")
                failure = APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")
            error = {"message": failure.message, "type": failure.type, "code": failure.status}
            yield f"data: {json.dumps({'error': error})}\n\n"
        finally:
            await chunks.aclose()  # a client that left mid-stream cancels its generation now, not at GC
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def completion_chunks(meta, body: CompletionRequest, prompts, merged, tokenizer):
    """One chunk per choice update (as vLLM streams), then a usage chunk when asked for."""
    generated = 0
    async for i, deltas in merged:
        for d in deltas:
            choice = build_choice(
                i * body.n + d.index, d, body, tokenizer, {"text": d.text}, d.finish_reason, prompts[i]
            )
            generated += len(d.token_ids)
            yield meta | {"object": "text_completion", "choices": [choice]}
    if (body.stream_options or {}).get("include_usage"):
        prompt_tokens = sum(len(p) for p in prompts) * body.n
        yield meta | {"object": "text_completion", "choices": [], "usage": usage_of(prompt_tokens, generated)}


async def chat_chunks(meta, body: ChatCompletionRequest, prompt_ids, stream, tokenizer, parse_calls: bool):
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
            delta, finish_reason = _chat_delta(d, held, body.parallel_tool_calls) if parse_calls else _plain(d)
            first = d.index not in started
            if first:
                started.add(d.index)
                delta = {"role": "assistant"} | delta
            choice = build_choice(d.index, d, body, tokenizer, {"delta": delta}, finish_reason)
            generated += len(d.token_ids)
            chunk = meta | {"choices": [choice]}
            if body.return_token_ids and first:
                chunk["prompt_token_ids"] = prompt_ids
            yield chunk
    if (body.stream_options or {}).get("include_usage"):
        yield meta | {"choices": [], "usage": usage_of(len(prompt_ids), generated)}


def _plain(d: Delta) -> tuple[dict[str, Any], str | None]:
    return {"content": d.text}, d.finish_reason


def _chat_delta(d: Delta, held: dict[int, list[str]], parallel_tool_calls: bool | None) -> tuple[dict, str | None]:
    """The delta of a choice whose tool calls are parsed: empty until its last, which carries the message."""
    held[d.index].append(d.text)
    if d.finish_reason is None:
        return {"content": ""}, None
    message = assistant_message("".join(held.pop(d.index)), True, parallel_tool_calls)
    delta: dict[str, Any] = {"content": message["content"]}
    if "tool_calls" not in message:
        return delta, d.finish_reason
    delta["tool_calls"] = [call | {"index": k} for k, call in enumerate(message["tool_calls"])]
    return delta, "tool_calls"
