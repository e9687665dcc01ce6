"""The client's floor retry against real HTTP servers on loopback: a server restarted mid-step (it holds its base
weights, step 0) while the orchestrator never posted an update itself (after the orchestrator's own restart, and
always with weight broadcasts) is given weights of a step >= the floor from `weights/step_k` on disk, or benched
(no requests) where none are there; a request ends within a bound, naming the servers and steps.

Before this, the client asked weight control to reload the server with nothing and retried without bound (the
reviewer's probe threw 57 generations away in 3 s, no error): each test here bounds the run with a timeout, which
is what failed on that code. The servers are small fake OpenAI servers in this process (threads), which restart
on their port on cue; the real server's /update_weights is covered by tests/integration.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

import pytest

from prime_rl.configs.orchestrator import ClientConfig, OrchestratorConfig, SamplingConfig
from prime_rl.orchestrator.policy import wait_for_policy
from prime_rl.orchestrator.servers import STALE_ANSWERS, Servers, StaleAnswer
from prime_rl.orchestrator.servers.client import InferenceClient, InferenceError
from prime_rl.protocol import weights_dir
from prime_rl.protocol.files import mark_stable
from tests.fake_server import FakeServer

BOUND = 15.0  # seconds a test's requests get; the restores take well under 1 s on loopback


@pytest.fixture
def started():
    servers: list[FakeServer] = []
    yield servers
    for server in servers:
        try:
            server.kill()
        except OSError:
            pass


def server_at(step: int) -> FakeServer:
    """A fake server holding `step` that loads only complete weight dirs; a gated request waits at most BOUND."""
    return FakeServer(step, require_stable=True, gate_timeout=BOUND)


def write_weights(out: Path, *steps: int) -> None:
    for step in steps:
        weights_dir(out, step).mkdir(parents=True)
        mark_stable(weights_dir(out, step))


async def requests_after_a_restart(servers: list[FakeServer], started: list[FakeServer], out: Path, floor: int,
                                   n: int = 8, lying: bool = False) -> tuple[list, FakeServer, float]:  # fmt: skip
    """A fresh client (the orchestrator restarted: it posted no update) finds the servers on step 3 and sets the
    floor; then server 0 restarts and `n` requests run. Their results (or the error), the restarted server, and
    the seconds they took."""
    config = ClientConfig(base_url=[s.url for s in servers], max_retries=0)
    async with InferenceClient(config, "m", output_dir=out) as client:
        assert await client.server_step() == 3
        client.set_floor(floor)
        restarted = servers[0].restart(lying=lying)
        started.append(restarted)
        start = time.monotonic()
        requests = asyncio.gather(*(client.chat([], 1, SamplingConfig()) for _ in range(n)), return_exceptions=True)
        results = await asyncio.wait_for(requests, BOUND)  # before: never returned
        return results, restarted, time.monotonic() - start


@pytest.mark.parametrize("count", [1, 2])
def test_a_restarted_server_is_given_the_weights_on_disk_and_every_request_is_answered_at_the_floor(
    tmp_path, started, caplog, count
):
    """Filesystem mode after an orchestrator restart, one server and two: the restarted server gets
    weights/step_3 (the step the others hold), once for all the requests that found it on step 0."""
    write_weights(tmp_path, 1, 2, 3)
    servers = [server_at(3) for _ in range(count)]
    started.extend(servers)
    with caplog.at_level(logging.WARNING, logger="prime_rl"):
        results, restarted, seconds = asyncio.run(requests_after_a_restart(servers, started, tmp_path, floor=3))
    assert all(r[0].weight_step == 3 for r in results), results
    assert restarted.updates == [str(weights_dir(tmp_path, 3))] and restarted.requests >= 1
    assert "answered from weight step 0, older than 3" in caplog.text and "step_3 onto it (step 3)" in caplog.text
    print(f"{count} server(s): 8 requests answered at step 3 in {seconds:.2f}s, one reload of weights/step_3")


def test_with_broadcasts_a_checkpoint_step_on_disk_at_or_above_the_floor_restores_the_server(tmp_path, started):
    """Broadcast mode writes weights/step_k at checkpoint steps: one at the floor serves the restarted server."""
    write_weights(tmp_path, 2)
    servers = [server_at(3)]
    started.extend(servers)
    results, restarted, _ = asyncio.run(requests_after_a_restart(servers, started, tmp_path, floor=2))
    assert restarted.updates == [str(weights_dir(tmp_path, 2))] and all(r[0].weight_step == 2 for r in results)


def test_with_broadcasts_and_no_weights_on_disk_the_restarted_server_is_benched_and_the_other_serves(
    tmp_path, started, caplog
):
    """Broadcast mode, two servers, nothing on disk at or above the floor (the last checkpoint is step 1): the
    restarted one gets no requests after its first answers, the other answers them all at step 3; the next
    update (a broadcast, or a dir: both end in the same bookkeeping) puts it back in the rotation."""
    write_weights(tmp_path, 1)
    servers = [
        server_at(3),
        server_at(3),
    ]
    started.extend(servers)
    config = ClientConfig(base_url=[s.url for s in servers], max_retries=0)

    async def go():
        async with InferenceClient(config, "m", output_dir=tmp_path) as client:
            assert await client.server_step() == 3
            client.set_floor(3)
            restarted = servers[0].restart()
            started.append(restarted)
            chats = asyncio.gather(*(client.chat([], 1, SamplingConfig()) for _ in range(8)))
            results = await asyncio.wait_for(chats, BOUND)  # before: never returned
            benched = (restarted.requests, client.pool.servers[0].benched)
            write_weights(tmp_path, 4)
            assert await client.update_weights(str(weights_dir(tmp_path, 4))) == 4
            await asyncio.gather(*(client.chat([], 1, SamplingConfig()) for _ in range(4)))
            return results, restarted, benched, client.pool.servers[0].benched

    with caplog.at_level(logging.WARNING, logger="prime_rl"):
        results, restarted, (answered, why), after = asyncio.run(go())
    assert all(r[0].weight_step == 3 for r in results)
    # The 4 requests the rotation sent it before its first answer came back, none after; then 2 of the next 4.
    assert answered == 4 and restarted.requests == 6 and after is None
    assert why.endswith(f"older than 3, and no complete weights of a step >= 3 are in {tmp_path / 'weights'}")
    assert "it gets no requests until a weight update reaches it" in caplog.text


def test_with_broadcasts_one_server_and_no_weights_on_disk_the_request_fails_at_once_naming_server_and_steps(
    tmp_path, started
):
    """Nothing can give the only server a usable policy mid-step: the requests fail within a second, naming it,
    the step it holds and the floor, and what to do (the orchestrator exits 1 with that line; `rl --restart`
    resumes it, and the next step's broadcast reaches the server)."""
    servers = [server_at(3)]
    started.extend(servers)
    results, restarted, seconds = asyncio.run(requests_after_a_restart(servers, started, tmp_path, floor=3))
    assert all(isinstance(r, InferenceError) for r in results) and seconds < 2.0
    message = str(results[0])
    assert message.startswith(f"no inference server can serve this step: {restarted.url} holds weight step 0")
    assert "older than 3" in message and "--ckpt.resume-step latest" in message
    assert restarted.requests == 8  # the 8 sent before its first answer came back; none after it was benched
    print(f"fails in {seconds:.2f}s: {message}")


def test_a_server_that_keeps_sampling_old_weights_after_reloads_fails_the_request_after_the_bound(tmp_path, started):
    """A server that reports the step it loaded but samples from its base weights: the request gives up after
    STALE_ANSWERS answers, naming the server and each answer's step."""
    write_weights(tmp_path, 3)
    servers = [server_at(3)]
    started.extend(servers)
    results, restarted, seconds = asyncio.run(
        requests_after_a_restart(servers, started, tmp_path, floor=3, n=1, lying=True)
    )
    (error,) = results
    assert isinstance(error, InferenceError) and seconds < 5.0
    assert str(error) == (
        f"POST /chat/completions: {STALE_ANSWERS} answers sampled from weights older than step 3 (the oldest this "
        f"step may use), each after its server was given weights >= 3: "
        + ", ".join([f"{restarted.url} step 0"] * STALE_ANSWERS)
    )
    assert restarted.requests == STALE_ANSWERS


def test_requests_running_while_the_trainers_weights_are_awaited_keep_the_previous_floor(tmp_path, started):
    """Continuous mode with max_off_policy_steps = async_level = 1: step 3 needs weights 2, which the trainer has
    not written yet. Requests running meanwhile sample weights 1, still the previous step's policy: they are
    answered (the floor rises once the servers hold step 2), not thrown away or failed for an absent step_2."""
    write_weights(tmp_path, 1)
    servers = [server_at(1)]
    started.extend(servers)
    config = OrchestratorConfig(
        output_dir=tmp_path, batch_size=4, rollouts_per_example=2, max_inflight=8, max_off_policy_steps=1,
        async_level=1, client={"base_url": [servers[0].url]},
    )  # fmt: skip

    async def go():
        async with InferenceClient(config.client, "m", output_dir=tmp_path) as client:
            assert await wait_for_policy(client, config, 2, {}) == 1 and client.weights.floor == 1
            policy = asyncio.create_task(wait_for_policy(client, config, 3, {}))
            answers = await asyncio.gather(*(client.chat([], 1, SamplingConfig()) for _ in range(4)))
            assert not policy.done()  # still waiting for weights/step_2
            write_weights(tmp_path, 2)
            held = await asyncio.wait_for(policy, BOUND)
            return answers, held, client.weights.floor

    answers, held, floor = asyncio.run(go())
    assert [a[0].weight_step for a in answers] == [1] * 4 and (held, floor) == (2, 2)
    assert servers[0].updates == [str(weights_dir(tmp_path, 2))]


def test_answers_older_than_updates_they_ran_across_are_asked_again_without_a_restore_or_a_count(
    tmp_path, started, caplog
):
    """A request (an eval, say) that arrived before an update and answers after the floor rose: its policy was
    current when it started, so it is asked again on the new weights, with no restore, and not counted towards
    STALE_ANSWERS: here it runs across STALE_ANSWERS updates in a row and is still answered."""
    write_weights(tmp_path, *range(3, 4 + STALE_ANSWERS))
    servers = [server_at(3)]
    servers[0].gate = threading.Semaphore(0)
    started.extend(servers)
    config = ClientConfig(base_url=[servers[0].url], max_retries=0)

    async def go():
        async with InferenceClient(config, "m", output_dir=tmp_path) as client:
            client.set_floor(3)
            request = asyncio.create_task(client.chat([], 1, SamplingConfig()))
            for step in range(4, 4 + STALE_ANSWERS):
                while servers[0].requests < step - 3:  # attempt step - 3 arrived, on weights step - 1
                    await asyncio.sleep(0.01)
                assert await client.update_weights(str(weights_dir(tmp_path, step))) == step
                client.set_floor(step)
                servers[0].gate.release()  # it answers, stamped step - 1
            servers[0].gate.release()  # the last attempt, on the newest weights
            return await asyncio.wait_for(request, BOUND)

    with caplog.at_level(logging.WARNING, logger="prime_rl"):
        (answer,) = asyncio.run(go())
    assert answer.weight_step == 3 + STALE_ANSWERS and servers[0].requests == 1 + STALE_ANSWERS
    assert len(servers[0].updates) == STALE_ANSWERS and "restarted?" not in caplog.text


def test_one_attempt_from_below_the_floor_is_a_stale_answer_and_restores_nothing(started):
    """`Servers._generate` is one attempt: an answer from below the floor raises StaleAnswer naming the server and
    the step it answered from, and loads nothing; restoring the server and asking again is `Servers.generate`'s."""
    server = server_at(0)
    started.append(server)

    async def attempt() -> StaleAnswer:
        servers = Servers(ClientConfig(base_url=[server.url], max_retries=0), "m")
        try:
            servers.weights.floor = 3
            with pytest.raises(StaleAnswer) as caught:
                await servers._generate(servers.pool.servers[0], "/chat/completions", {"n": 1, "messages": []})
            return caught.value
        finally:
            await servers.close()

    stale = asyncio.run(attempt())
    assert (stale.server.base, stale.step, str(stale)) == (server.url, 0, f"{server.url} step 0")
    assert server.requests == 1 and server.updates == []
