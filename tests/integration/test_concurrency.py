"""Adaptive concurrency against a real built-in inference server (tiny model, CPU, a batch of 4 rows).

The orchestrator's client starts a server at the floor (1 request in flight); while the server has free rows
the limit rises to its batch capacity (and a short queue), and when another client's burst makes requests
queue at the server the limit falls, without cancelling a request.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from prime_rl.configs.orchestrator import ClientConfig, SamplingConfig
from prime_rl.orchestrator.servers.client import InferenceClient

pytestmark = pytest.mark.slow
CAPACITY = 4  # the engine's max_batch_size
TOKENS = 1500  # at most (a random model may stop sooner): about 2-3 s at a full batch of 4 on 2 CPU cores


def test_the_limit_rises_to_the_batch_capacity_and_falls_when_requests_queue(inference_process, tiny_model, tmp_path):
    server = inference_process("builtin", tiny_model, tmp_path, "--engine.max-batch-size", str(CAPACITY))
    try:
        server.wait_ready()
        trace, burst_at, results = asyncio.run(run(server.url, str(tiny_model)))
    finally:
        server.stop()
    for t, limit, inflight, waiting in trace:
        print(f"{t:5.1f}s limit {limit:2d} in flight {inflight:2d} server waiting {waiting}")
    assert len(results) >= 12 and all(len(r) == 1 and r[0].completion_ids for r in results)  # none cancelled
    before = [limit for t, limit, _, _ in trace if t < burst_at]
    after = [limit for t, limit, _, _ in trace if t > burst_at]
    # From the floor up to the batch and a short queue (1 request at this limit), not past them.
    assert before[0] == 1 and CAPACITY <= max(before) <= CAPACITY + 1
    assert max(inflight for _, _, inflight, _ in trace) <= CAPACITY + 1
    assert min(after) <= 2, "the limit did not fall while the other client's requests queued at the server"
    assert any(waiting and waiting > 0 for t, _, _, waiting in trace if t > burst_at)  # they did queue


async def run(url: str, model: str) -> tuple[list[tuple[float, int, int, float | None]], float, list]:
    config = ClientConfig(base_url=[f"{url}/v1"], concurrency="adaptive", min_concurrency=1, max_concurrency=16)
    sampling = SamplingConfig(max_tokens=TOKENS)
    async with InferenceClient(config, model) as client, httpx.AsyncClient(timeout=120) as other:
        slots, start = client.pool.servers[0].slots, time.monotonic()
        trace, burst_done = [], asyncio.Event()

        async def watch() -> None:
            while True:
                load = slots.load.waiting if slots.load is not None else None
                trace.append((time.monotonic() - start, slots.limit, slots.inflight, load))
                await asyncio.sleep(0.1)

        async def burst() -> float:
            """Another client's 8 requests straight to the server, once our limit reached the batch."""
            while slots.limit < CAPACITY:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            at = time.monotonic() - start
            body = {"model": model, "prompt": "hello", "max_tokens": TOKENS, "ignore_eos": True}
            answers = await asyncio.gather(*(other.post(f"{url}/v1/completions", json=body) for _ in range(8)))
            assert all(a.status_code == 200 for a in answers)
            burst_done.set()
            return at

        async def caller() -> list:
            """One of our 12 callers, asking again until the burst is answered: a random model may stop at EOS
            long before TOKENS, and the limit can only fall while we still want slots (as an orchestrator does)."""
            answers = [await client.complete("hello", 1, sampling)]
            while not burst_done.is_set():
                answers.append(await client.complete("hello", 1, sampling))
            return answers

        watcher = asyncio.create_task(watch())
        burst_at, *callers = await asyncio.wait_for(asyncio.gather(burst(), *(caller() for _ in range(12))), 50)
        watcher.cancel()
    return trace, burst_at, [answer for answers in callers for answer in answers]
