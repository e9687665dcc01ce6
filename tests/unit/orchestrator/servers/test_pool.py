"""The server pool against three real HTTP servers on loopback.

The servers are small fake OpenAI servers in this process (threads), not the real inference server:
these tests are about how the client spreads, retries and re-routes requests, which needs servers that
answer instantly and can be killed on cue. The real server is covered by tests/integration.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from prime_rl.configs.orchestrator import ClientConfig, SamplingConfig
from prime_rl.orchestrator.servers.client import InferenceClient, InferenceError
from tests.fake_server import FakeServer


@pytest.fixture
def servers():
    started = [FakeServer(), FakeServer(), FakeServer()]
    yield started
    for s in started:
        try:
            s.kill()
        except OSError:
            pass


def test_weights_2_1_1_split_1000_requests_50_25_25_within_5_percent(servers):
    config = ClientConfig(base_url=[s.url for s in servers], traffic_share=[2, 1, 1], max_concurrency=16)

    async def go():
        async with InferenceClient(config, "m") as client:
            await asyncio.gather(*(client.chat([], 1, SamplingConfig()) for _ in range(1000)))

    asyncio.run(go())
    shares = [s.requests / 1000 for s in servers]
    assert sum(s.requests for s in servers) == 1000
    for share, expected in zip(shares, [0.5, 0.25, 0.25], strict=True):
        assert abs(share - expected) <= 0.05, shares


def test_a_server_killed_mid_step_is_taken_out_and_its_requests_go_elsewhere(servers, monkeypatch, caplog):
    monkeypatch.setattr("prime_rl.orchestrator.servers.http.BACKOFF", 0.01)
    for s in servers:
        s.delay = 0.01
    config = ClientConfig(base_url=[s.url for s in servers], max_concurrency=4, max_retries=1)
    victim = servers[2]

    async def step():
        async with InferenceClient(config, "m") as client:

            async def killer():
                while victim.requests < 10:
                    await asyncio.sleep(0.005)
                victim.kill()

            results, _ = await asyncio.gather(
                asyncio.gather(*(client.chat([], 2, SamplingConfig()) for _ in range(150))), killer()
            )
            steps = await client.update_weights("/w/step_3")
            return results, client, steps

    with caplog.at_level(logging.WARNING, logger="prime_rl"):
        results, client, steps = asyncio.run(step())
    assert len(results) == 150 and all(len(r) == 2 for r in results)  # the step completed in full
    assert [s.alive for s in client.pool.servers] == [True, True, False]
    assert f"inference server {victim.url} is down, taking it out of the pool" in caplog.text
    assert servers[0].requests + servers[1].requests + victim.requests >= 150
    # The next weight update reaches the live servers only.
    assert steps == 3 and servers[0].updates == servers[1].updates == ["/w/step_3"] and victim.updates == []


def test_a_removed_server_rejoins_at_the_next_health_check_once_it_answers_again(servers, monkeypatch, caplog):
    monkeypatch.setattr("prime_rl.orchestrator.servers.http.BACKOFF", 0.01)
    config = ClientConfig(base_url=[s.url for s in servers], max_retries=0)
    victim = servers[1]
    port = int(victim.url.rsplit(":", 1)[1].removesuffix("/v1"))

    async def go():
        async with InferenceClient(config, "m") as client:
            victim.kill()
            await asyncio.gather(*(client.chat([], 1, SamplingConfig()) for _ in range(6)))
            out = [s.alive for s in client.pool.servers]
            assert await client.server_step() == 0  # still down: the probe fails quietly, it stays out
            still_out = [s.alive for s in client.pool.servers]
            servers.append(FakeServer(port=port))  # back on the same address (the fixture stops it)
            await client.server_step()
            back = [s.alive for s in client.pool.servers]
            await asyncio.gather(*(client.chat([], 1, SamplingConfig()) for _ in range(6)))
            return out, still_out, back

    with caplog.at_level(logging.INFO, logger="prime_rl"):
        out, still_out, back = asyncio.run(go())
    assert out == still_out == [True, False, True]
    assert back == [True, True, True]
    assert f"inference server {victim.url} answers /health; in the pool" in caplog.text
    assert servers[-1].requests == 2  # its share of the next 6 requests
    assert servers[0].requests + servers[2].requests == 10


def test_every_server_dead_fails_with_a_clear_error_after_health_timeout(servers, monkeypatch):
    monkeypatch.setattr("prime_rl.orchestrator.servers.http.BACKOFF", 0.01)
    config = ClientConfig(base_url=[s.url for s in servers], max_retries=0, health_timeout=1.5)
    for s in servers:
        s.kill()

    async def go():
        async with InferenceClient(config, "m") as client:
            await client.chat([], 1, SamplingConfig())

    start = time.monotonic()
    with pytest.raises(InferenceError, match=r"no live inference server left .* answered /health within 2s"):
        asyncio.run(go())
    assert 1.5 <= time.monotonic() - start < 10


def test_requests_ride_through_a_restart_of_the_only_server_which_gets_the_weights_first(monkeypatch, caplog):
    """As under `rl --restart`: the one server dies mid-step and comes back on its port with the base model.
    The step's requests wait for it, it is given the pool's weights before it samples again, and no answer
    comes from a policy older than the step's floor."""
    monkeypatch.setattr("prime_rl.orchestrator.servers.http.BACKOFF", 0.01)
    first = FakeServer(delay=0.05)
    port = int(first.url.rsplit(":", 1)[1].removesuffix("/v1"))
    config = ClientConfig(base_url=[first.url], max_retries=1, health_timeout=30)
    restarted: list[FakeServer] = []

    async def go():
        async with InferenceClient(config, "m") as client:
            assert await client.update_weights("/w/step_3") == 3
            client.set_floor(3)
            first.kill()

            async def come_back():
                await asyncio.sleep(1.0)
                restarted.append(FakeServer(port=port))  # step 0 until it is given weights

            results, _ = await asyncio.gather(
                asyncio.gather(*(client.chat([], 1, SamplingConfig()) for _ in range(8))), come_back()
            )
            return results

    try:
        with caplog.at_level(logging.INFO, logger="prime_rl"):
            results = asyncio.run(go())
    finally:
        for s in restarted:
            s.kill()
    assert len(results) == 8 and all(r[0].weight_step == 3 for r in results)
    assert restarted[0].updates == ["/w/step_3"] and restarted[0].requests == 8
    assert "no inference server is up" in caplog.text and "answers /health; in the pool (weight step 3)" in caplog.text


def test_traffic_share_must_match_base_urls():
    with pytest.raises(ValueError, match="client.traffic_share has 2 entries for 1 base_url"):
        ClientConfig(base_url=["http://a/v1"], traffic_share=[1, 2])
    with pytest.raises(ValueError, match="client.weights is now client.traffic_share"):
        ClientConfig(base_url=["http://a/v1"], weights=[1])


def test_reload_weights_returns_every_server_to_its_base(servers):
    async def run():
        async with InferenceClient(ClientConfig(base_url=[s.url for s in servers]), "m") as client:
            assert await client.update_weights("/w/step_3") == 3
            assert await client.reload_weights() == 0
            return client.pool.steps, client.weight_dir

    steps, weight_dir = asyncio.run(run())
    assert set(steps.values()) == {0} and weight_dir is None
    assert [s.updates for s in servers] == [["/w/step_3", "base"]] * 3
