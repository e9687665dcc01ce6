"""The parity gate's decisions (orchestrator/parity.py): the k3 arithmetic, which canaries a first batch gives,
and the one-line stops for a checksum or a KL over the bound. A real run tripping it: tests/integration/test_rl.py."""

from __future__ import annotations

import asyncio
import json
import math
import time
from types import SimpleNamespace

import pytest

from prime_rl.configs.orchestrator import OrchestratorConfig
from prime_rl.orchestrator.batch import Batch
from prime_rl.orchestrator.parity import ParityError, ParityGate, mismatch, robust_kl
from prime_rl.orchestrator.rollout import Group, Rollout
from prime_rl.orchestrator.servers.pool import Server
from prime_rl.protocol import heartbeat_file, mark_stable, weights_dir
from prime_rl.protocol.parity import (
    Checksum,
    canary_file,
    is_gate_step,
    read_canaries,
    sampled_file,
    write_checksum,
    write_sampled,
    write_trainer_scores,
)


def test_k3_over_the_sampled_tokens_only():
    total, worst, n = mismatch([0.0, -1.0, -2.0, -3.0], [0.0, -9.0, -2.1, -3.0], [False, False, True, True])
    assert n == 2 and worst == pytest.approx(0.1) and total == pytest.approx(math.exp(0.1) - 1 - 0.1)
    assert [s for s in range(7) if is_gate_step(s, 3)] == [0, 3, 6] and not is_gate_step(0, 0)


def rollout(prompt, completion, mask=None) -> Rollout:
    return Rollout(None, prompt, completion, mask or [True] * len(completion), [0.0] * len(completion), "", "stop", 0)


class FakeClient:
    """The two things the gate uses: the pool's live servers and `score`, whose answers a test sets."""

    def __init__(self, servers: dict[str, list[float]]):
        self.answers = servers
        self.pool = SimpleNamespace(servers=[Server(base, asyncio.Semaphore(1)) for base in servers])
        self.pool.live = lambda: self.pool.servers

    async def score(self, token_ids, server):
        return self.answers[server.base][: len(token_ids)]


def gate(tmp_path, **parity) -> ParityGate:
    """A gate of a run whose trainer beats in `tmp_path` (canaries are scored only then)."""
    heartbeat_file(tmp_path, "trainer-rank0").parent.mkdir(parents=True, exist_ok=True)
    heartbeat_file(tmp_path, "trainer-rank0").write_text(json.dumps({"time": time.time()}))
    config = OrchestratorConfig(
        output_dir=tmp_path, parity={"interval": 2, "max_kl": 1e-3, **parity}, weights_timeout=1
    )
    return ParityGate(config, resumed=False)


def test_the_first_batch_gives_the_canaries_across_envs_and_a_bad_server_stops_the_run(tmp_path):
    batch = Batch(
        groups=[
            Group(None, [rollout([1, 2], [3, 4]), rollout([1, 2], [5])], env="a"),
            Group(None, [rollout([6], [7, 8], [True, False])], env="a"),
            Group(None, [rollout([9, 10, 11], [12])], env="b"),
        ],
    )
    good, bad = "http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1"
    client = FakeClient({good: [0.0, -1.0, -1.0, -1.0], bad: [0.0, -1.5, -1.5, -1.5]})
    g = gate(tmp_path, num_canaries=2)
    asyncio.run(g.start_step(client))  # weight step 0, a gate step; no canaries yet
    asyncio.run(g.choose_canaries(client, batch))
    canaries = read_canaries(tmp_path)
    assert [(c["env"], c["token_ids"], c["scored"]) for c in canaries] == [
        ("a", [1, 2, 3, 4], [False, False, True, True]),
        ("b", [9, 10, 11, 12], [False, False, False, True]),  # one per env before a second of any
    ]
    assert asyncio.run(g.finish_step(client, 0)) == {}  # the trainer has not scored yet: nothing waits
    write_trainer_scores(tmp_path, 0, [[0.0, -1.0, -1.0, -1.0], [0.0, -1.0, -1.0, -1.0]])
    with pytest.raises(ParityError) as stop:
        asyncio.run(g.finish_step(client, 1))
    kl = math.expm1(0.5) - 0.5  # the first canary (two tokens off by 0.5, the larger Σ k3) is left out
    assert str(stop.value) == (
        f"parity: server {bad} at weight step 0: mismatch KL {kl:.3g} > 0.001 (max |Δ logprob| 0.5 over 1 canary "
        "tokens, the worst 1 of 2 canaries left out); it does not compute the trainer's policy"
    )
    # the canaries stay: a later step (or a resumed run) scores the same sequences
    before = canary_file(tmp_path).read_text()
    asyncio.run(g.choose_canaries(client, batch))
    assert canary_file(tmp_path).read_text() == before


def test_a_good_server_gives_metrics_and_only_the_last_step_waits_for_the_trainers_file(tmp_path):
    base = "http://127.0.0.1:1/v1"
    client = FakeClient({base: [0.0, -1.0, -2.0]})
    g = gate(tmp_path)
    from prime_rl.protocol.parity import write_canaries

    write_canaries(tmp_path, [{"env": "a", "token_ids": [1, 2, 3], "scored": [False, True, True]}])
    client.pool.servers[0].step = 2
    asyncio.run(g.start_step(client))  # weight step 2: a gate step
    write_trainer_scores(tmp_path, 2, [[0.0, -1.0, -2.0]])
    assert asyncio.run(g.finish_step(client, 3)) == {
        "parity_kl/127.0.0.1:1": 0.0, "parity_max_dlogprob/127.0.0.1:1": 0.0, "parity_step": 2
    }  # fmt: skip
    client.pool.servers[0].step = 4
    asyncio.run(g.start_step(client))
    assert asyncio.run(g.finish_step(client, 5)) == {}
    with pytest.raises(Exception, match=r"the trainer's canary logprobs at weight step 4 \(.*parity/step_4.json\)"):
        asyncio.run(g.finish_step(client, 19))  # the run's last step (max_steps 20) waits for it, bounded


def test_a_server_that_loaded_other_weights_than_the_trainers_stops_the_run_naming_both(tmp_path):
    step_dir = weights_dir(tmp_path, 3)
    step_dir.mkdir(parents=True)
    write_checksum(step_dir, Checksum(0xABC, 2))
    mark_stable(step_dir)
    client = FakeClient({"http://127.0.0.1:1/v1": []})
    server = client.pool.servers[0]
    server.step, server.checksum = 3, f"{0xABC:016x}"
    g = gate(tmp_path, interval=0)
    asyncio.run(g.start_step(client))  # the same: nothing happens
    server.checksum = f"{0xABD:016x}"
    with pytest.raises(ParityError) as stop:
        asyncio.run(g.start_step(client))
    assert str(stop.value) == (
        "checksum: server http://127.0.0.1:1/v1 at weight step 3: loaded 0000000000000abd, the trainer exported "
        f"0000000000000abc ({step_dir / 'checksum.json'}); it serves other weights than the trainer's"
    )


def test_without_a_trainer_in_the_output_dir_no_server_is_asked_to_score(tmp_path):
    config = OrchestratorConfig(output_dir=tmp_path, parity={"interval": 1})
    client = FakeClient({"http://127.0.0.1:1/v1": []})
    client.score = None  # a server that cannot score (e.g. a test's fake one) is never asked
    g = ParityGate(config, resumed=False)
    asyncio.run(g.start_step(client))
    asyncio.run(g.choose_canaries(client, Batch(groups=[Group(None, [rollout([1], [2])], env="a")])))
    assert read_canaries(tmp_path) is None and asyncio.run(g.finish_step(client, 19)) == {}


def k3(d: float) -> float:
    return math.expm1(d) - d


def test_one_token_off_by_two_alone_never_stops_a_run_and_a_fault_on_every_sequence_does():
    honest = [(100, 100 * k3(0.01), 0.02)] * 30  # 30 samples of 100 tokens: KL 5e-5
    outlier = [(100, 99 * k3(0.01) + k3(2.0), 2.0)]  # one more, one of its tokens 2 nats off
    kl, tokens, worst, dropped = robust_kl(honest + outlier)
    assert (tokens, worst, dropped) == (3000, 0.02, 1) and kl == pytest.approx(k3(0.01))
    # the plain mean with it: 1.5e-3, over a 1e-3 bound
    assert sum(e[1] for e in honest + outlier) / 3100 > 1e-3
    kl, *_ = robust_kl([(100, 100 * k3(0.1), 0.1)] * 31)  # every sample 0.1 off: stays judged
    assert kl == pytest.approx(k3(0.1)) and kl > 1e-3
    assert robust_kl([(100, 5.0, 3.0)]) is None  # one entry: reported, never judged alone


def test_an_on_policy_gate_step_judges_each_servers_sampled_tokens_from_the_trainers_report(tmp_path):
    good, bad = "http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1"
    client = FakeClient({good: [], bad: []})
    g = gate(tmp_path, interval=2)
    config = g.config.model_copy(update={"num_train_workers": 2, "max_steps": 20})
    g.config = config
    assert [s for s in range(5) if g.on_policy(s)] == [0, 2, 4]
    assert asyncio.run(g.finish_step(client, 2, on_policy=True)) == {}  # the trainer has not reported yet
    write_sampled(tmp_path, 2, 0, [[0, 10, 10 * k3(0.01), 0.02], [1, 8, 8 * k3(0.3), 0.3]])
    assert asyncio.run(g.finish_step(client, 3)) == {}  # rank 1's file is missing: not complete
    write_sampled(tmp_path, 2, 1, [[0, 10, 10 * k3(0.01), 0.02], [1, 8, 8 * k3(0.3), 0.3], [1, 2, 2 * k3(0.3), 0.3]])
    with pytest.raises(ParityError) as stop:
        asyncio.run(g.finish_step(client, 4))
    assert str(stop.value) == (
        f"parity: server {bad} at weight step 2: sampled-token mismatch KL {k3(0.3):.3g} > 0.001 (max |Δ logprob| "
        "0.3 over 10 on-policy tokens the trainer scored, the worst 1 of 3 samples left out); it samples another "
        "policy than the trainer's"
    )
    assert not sampled_file(tmp_path, 2, 0).exists()  # read once, then gone
    # a good pool: metrics only; the run's last step waits for the report, bounded and named
    client = FakeClient({good: []})
    write_sampled(tmp_path, 4, 0, [[0, 10, 10 * k3(0.01), 0.02]] * 2)
    write_sampled(tmp_path, 4, 1, [])
    metrics = asyncio.run(g.finish_step(client, 4, on_policy=True))
    assert metrics == {
        "parity_sampled_kl/127.0.0.1:1": pytest.approx(k3(0.01)), "parity_sampled_tokens/127.0.0.1:1": 20,
        "parity_sampled_step": 4,
    }  # fmt: skip
    with pytest.raises(Exception, match=r"the trainer's sampled-token mismatch of step 19 \(.*sampled_step_19_rank_0"):
        asyncio.run(g.finish_step(client, 19, on_policy=True))  # the run's last step (max_steps 20)


def test_a_server_holding_an_earlier_publish_of_a_redone_step_is_no_fault_and_its_samples_are_not_judged(tmp_path):
    """A resumed trainer redid step 3 (other weights: CUDA is not bit-reproducible) while the server kept its first
    attempt: it is no fault whether the step's file names the earlier publish or the gate read it before (a
    broadcast announcement names only the newest); other weights still stop the run."""
    step_dir = weights_dir(tmp_path, 3)
    step_dir.mkdir(parents=True)
    mark_stable(step_dir)
    client = FakeClient({"http://127.0.0.1:1/v1": []})
    server = client.pool.servers[0]
    server.step, server.checksum = 3, f"{0xA:016x}"
    write_checksum(step_dir, Checksum(0xB, 2), earlier=[f"{0xA:016x}"])
    g = gate(tmp_path, interval=1)
    asyncio.run(g.start_step(client))  # the file names the earlier publish: passes
    g = gate(tmp_path, interval=1)
    write_checksum(step_dir, Checksum(0xA, 2))
    asyncio.run(g.start_step(client))  # read before the redo ...
    write_checksum(step_dir, Checksum(0xB, 2))
    asyncio.run(g.start_step(client))  # ... still known after it
    entries = [[0, 10, 10.0, 3.0], [0, 10, 10.0, 3.0]]  # far off: the trainer's weights of step 3 are the redo's
    write_sampled(tmp_path, 3, 0, entries)
    assert asyncio.run(g.finish_step(client, 3, on_policy=True)) == {"parity_sampled_step": 3}
    server.checksum = f"{0xC:016x}"
    with pytest.raises(ParityError, match="loaded 000000000000000c, the trainer exported 000000000000000b"):
        asyncio.run(g.start_step(client))
