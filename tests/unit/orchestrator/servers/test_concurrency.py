"""The in-flight limiter and the adaptive rule (orchestrator/servers/concurrency.py), on their own: no server.

A real built-in server under adaptive concurrency is tests/integration/test_concurrency.py.
"""

from __future__ import annotations

import asyncio

import pytest

from prime_rl.configs.orchestrator import ClientConfig
from prime_rl.orchestrator.servers.concurrency import AIMD, Limiter, Load
from prime_rl.orchestrator.servers.pool import ServerPool


async def hold(limiter: Limiter, release: asyncio.Event, admitted: list[int], i: int) -> None:
    async with limiter:
        admitted.append(i)
        await release.wait()


def test_lowering_the_limit_cancels_nothing_and_admits_fewer_raising_admits_at_once():
    async def main() -> None:
        limiter, gate, admitted = Limiter(4), asyncio.Event(), []
        tasks = [asyncio.create_task(hold(limiter, gate, admitted, i)) for i in range(8)]
        await asyncio.sleep(0.01)
        assert admitted == [0, 1, 2, 3] and limiter.waiting == 4
        limiter.set_limit(2)  # the 4 running go on
        assert limiter.inflight == 4 and not any(t.done() for t in tasks)
        limiter.set_limit(5)  # one more at once, in arrival order
        await asyncio.sleep(0.01)
        assert admitted == [0, 1, 2, 3, 4] and limiter.inflight == 5
        limiter.set_limit(1)
        gate.set()  # all five finish; from then on one at a time
        await asyncio.sleep(0.01)
        assert limiter.inflight <= 1
        await asyncio.gather(*tasks)
        assert admitted == list(range(8)) and limiter.inflight == 0

    asyncio.run(main())


def test_a_waiter_cancelled_as_it_is_admitted_gives_its_slot_back():
    async def main() -> None:
        limiter = Limiter(1)
        await limiter.acquire()
        waiter = asyncio.create_task(limiter.acquire())
        await asyncio.sleep(0)
        limiter.release()  # admits the waiter (its future done) ...
        waiter.cancel()  # ... which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert limiter.inflight == 0
        await asyncio.wait_for(limiter.acquire(), 1)  # the slot is free

    asyncio.run(main())


def test_take_gives_time_weighted_means_since_the_last_take():
    async def main() -> None:
        limiter = Limiter(4)
        limiter.take()
        await limiter.acquire()
        await asyncio.sleep(0.2)
        limiter.set_limit(2)
        await asyncio.sleep(0.2)
        limit, inflight = limiter.take()
        assert limit == pytest.approx(3, abs=0.2) and inflight == pytest.approx(1, abs=0.1)
        limiter.release()

    asyncio.run(main())


def test_the_rule_decreases_on_a_queue_and_increases_into_room():
    rule = AIMD(floor=2, ceiling=32)
    room = Load(waiting=0, running=2, capacity=64)
    assert rule.next_limit(4, inflight=4, held=True, load=room) == 8  # slow start: doubling
    assert rule.next_limit(4, inflight=3, held=False, load=room) == 4  # nothing held back: nothing to gain
    # A queue longer than the short one kept (ceil(limit / 8)): down to what the server serves of ours (in
    # flight minus its queue) plus the short queue, at most halving.
    assert rule.next_limit(16, inflight=16, held=True, load=Load(waiting=4, running=12, capacity=12)) == 14
    assert rule.next_limit(16, inflight=16, held=True, load=Load(waiting=14)) == 8
    assert rule.next_limit(16, inflight=20, held=True, load=Load(waiting=4)) == 16  # the last cut still drains
    assert rule.next_limit(3, inflight=3, held=True, load=Load(waiting=9)) == 2  # never below the floor
    # After the first queue: additive, and never past the server's free batch rows and the short queue.
    assert rule.next_limit(12, inflight=12, held=True, load=Load(waiting=0, running=10, capacity=16)) == 13
    assert rule.next_limit(12, inflight=12, held=True, load=Load(waiting=0, running=16, capacity=16)) == 13
    assert rule.next_limit(12, inflight=12, held=True, load=Load(waiting=2, running=16, capacity=16)) == 12
    assert rule.next_limit(32, inflight=32, held=True, load=Load(waiting=0, running=2, capacity=64)) == 32  # ceiling
    # vLLM: KV-cache use is the signal too; high = queueing (one less while nothing waits yet), between the
    # marks = hold.
    assert rule.next_limit(10, inflight=10, held=True, load=Load(waiting=0, kv=0.95)) == 9
    assert rule.next_limit(10, inflight=10, held=True, load=Load(waiting=5, kv=0.95)) == 7
    assert rule.next_limit(10, inflight=10, held=True, load=Load(waiting=0, kv=0.85)) == 10
    assert rule.next_limit(10, inflight=10, held=True, load=Load(waiting=0, kv=0.5)) == 11


def test_slow_start_stops_at_the_free_rows_of_a_built_in_engine():
    rule = AIMD(floor=4, ceiling=64)
    # 8 of ours use 16 rows (n=2) of 24: room for 4 more requests and a queue of 1, not 8.
    assert rule.next_limit(8, inflight=8, held=True, load=Load(waiting=0, running=16, capacity=24)) == 13


def test_fixed_mode_is_a_plain_semaphore_and_adaptive_starts_at_the_floor():
    fixed = ServerPool(ClientConfig(base_url=["http://a:1/v1"], max_concurrency=7), None)
    assert fixed.servers[0].slots.limit == 7 and fixed.servers[0].slots.controller is None
    config = ClientConfig(base_url=["http://a:1/v1"], concurrency="adaptive", min_concurrency=3, max_concurrency=9)
    slots = ServerPool(config, None).servers[0].slots
    assert slots.limit == 3 and (slots.controller.floor, slots.controller.ceiling) == (3, 9)
    slots.observe({"requests_waiting": 0.0, "requests_running": 0.0})  # nothing held back: it holds
    assert slots.limit == 3
    slots.held = True
    slots.observe({"requests_waiting": 0.0, "requests_running": 3.0, "batch_capacity": 64.0})
    assert slots.limit == 6
    fixed.servers[0].slots.observe({"requests_waiting": 50.0})  # fixed: reads change nothing
    assert fixed.servers[0].slots.limit == 7


def test_the_pool_gives_each_servers_step_means_under_its_host_and_port():
    async def main() -> dict[str, float]:
        pool = ServerPool(ClientConfig(base_url=["http://a:1/v1", "http://b:2/v1"], max_concurrency=3), None)
        pool.take_inflight()
        async with pool.servers[0].slots:
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.2)
        return pool.take_inflight()

    means = asyncio.run(main())
    assert means.keys() == {"inflight_limit/a:1", "inflight/a:1", "inflight_limit/b:2", "inflight/b:2"}
    assert means["inflight_limit/a:1"] == 3 and means["inflight/a:1"] == pytest.approx(0.5, abs=0.15)
    assert means["inflight/b:2"] == 0
