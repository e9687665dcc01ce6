"""What an iteration comes to for each request, and how the worker thread tells the asyncio side: each row's
next token drawn and recorded with the weight step that sampled it (`record_draws`), finished rows answered
as `Sample`s carrying their tokens' weight-step spans (`retire`), a streamed request's new tokens and text
sent as `Delta`s, the spans on a sample's last one (`post_deltas`), and a failure kept to the request it
belongs to (`fail_request`: its draw or its text fails it alone, the others go on). Every answer, delta and
error crosses to the request's event loop through `post`. When rows run is engine.py's; a row's rules are
rows.py's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch

from prime_rl.inference.engine.batch import NativeBatch, TransformersBatch
from prime_rl.inference.engine.rows import Decode, Row
from prime_rl.inference.engine.sampling import sample_batch
from prime_rl.inference.engine.types import Delta, Request, RequestFailed, Sample
from prime_rl.protocol.spans import spans_of

logger = logging.getLogger("prime_rl")


def record_draws(logits: torch.Tensor, rows: list[Row], eos_ids: set[int], decode: Decode, step: int) -> None:
    """Draw each row's next token and record it (sampled by weight `step`). Sampling is batched, but what fails
    in it fails only the requests whose own rows fail: the batch is drawn again row by row when its draw
    raises."""
    try:
        draws = draw(logits, rows, eos_ids)
    except Exception:
        draws = None
    for b, row in enumerate(rows):
        try:
            if draws is not None:
                token, logprob, top, kept = draws.tokens[b], draws.logprobs[b], draws.top[b], draws.kept[b]
            else:
                alone = draw(logits[b : b + 1], [row], eos_ids)
                token, logprob, top, kept = alone.tokens[0], alone.logprobs[0], alone.top[0], alone.kept[0]
            row.append(token, logprob, top, eos_ids, decode, kept, step)
        except Exception as e:
            fail_request(row.request, e)


def draw(logits: torch.Tensor, rows: list[Row], eos_ids: set[int]):
    """One `sample_batch` over `rows`: each its own parameters and generator, the tokens it has seen (for a
    repetition penalty) and the tokens it may not draw yet."""
    params = [row.request.params for row in rows]
    seen = None
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        for b, row in enumerate(rows):
            if row.request.params.repetition_penalty != 1.0:
                seen[b, row.request.prompt_ids + row.token_ids] = True
    blocked = [row.blocked(eos_ids) for row in rows]
    return sample_batch(logits, params, [row.generator for row in rows], seen, blocked)


def retire(batch: NativeBatch | TransformersBatch, candidates: range) -> None:
    """Answer requests whose rows are all finished (each sample with the weight steps of its tokens) and drop
    finished rows from the batch."""
    rows = batch.rows
    done = [b for b in candidates if rows[b].finish_reason is not None]
    if not done:
        return
    for b in done:
        row = rows[b]
        request = row.request
        request.samples[row.index] = Sample(
            row.token_ids,
            row.logprobs,
            row.top_logprobs,
            row.text or "",
            row.finish_reason,
            row.steps[0],
            spans_of(row.steps),
            sampling_mask=row.sampling_mask,
            stop_reason=row.stop_reason,
        )
        if all(s is not None for s in request.samples):
            post(request.loop, resolve, request.future, request.samples)
    finished = set(done)
    batch.keep([b for b in range(len(rows)) if b not in finished])


def post_deltas(rows: list[Row], decode: Decode) -> None:
    """Send each streamed request what its rows gained this iteration (one event per request)."""
    by_request: dict[int, tuple[Request, list[Delta]]] = {}
    for row in rows:
        request = row.request
        if request.events is None or request.cancelled:
            continue
        try:
            text = row.stream_text(decode)
        except Exception as e:
            fail_request(request, e)
            continue
        delta = Delta(
            row.index,
            row.token_ids[row.streamed :],
            row.logprobs[row.streamed :],
            row.top_logprobs[row.streamed :],
            text,
            row.finish_reason,
            row.sampling_mask[row.streamed :],
            None if row.finish_reason is None else spans_of(row.steps),
        )
        row.streamed = len(row.token_ids)
        by_request.setdefault(id(request), (request, []))[1].append(delta)
    for request, deltas in by_request.values():
        post(request.loop, request.events.put_nowait, deltas)


def fail_request(request: Request, error: Exception) -> None:
    """Fail one request (its rows leave the batch at the worker's next drop of cancelled rows); the others go on."""
    if request.cancelled:
        return
    logger.exception(f"the engine failed a request: {error}", exc_info=error)
    request.cancelled = True
    fail([request], RequestFailed(f"the engine failed on this request: {type(error).__name__}: {error}"))


def fail(requests: list[Request], error: BaseException) -> None:
    """End each request (once, however often it is listed) with `error`: its future, and its stream if it has one."""
    for request in {id(r): r for r in requests}.values():
        post(request.loop, resolve, request.future, error)
        if request.events is not None:
            post(request.loop, request.events.put_nowait, error)


def post(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Run `fn(*args)` on the awaiting side's loop; a loop that is gone has no one left to tell."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is closed
        pass


def resolve(future: asyncio.Future, result: Any) -> None:
    if future.done():  # the client went away and the route was cancelled
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
