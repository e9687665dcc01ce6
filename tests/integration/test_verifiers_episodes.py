"""Episodes verifiers plays itself (`verifiers-env`, orchestrator/episodes.py) on our servers: its harness program
(the `null` chat program, run by `uv` on the subprocess runtime), interception server and multi-agent env
(`user_sim`: a simulated user, untrainable, opens and answers) reach the model through its `TrainClient` on the
pool endpoint, and what we train on is what the servers sampled.

The servers are the session's calc-qwen3 pair (tests/conftest.py `calc_servers`); verifiers' chat program needs
its dependencies from PyPI once (uv caches them).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import pytest

from tests.samples import trainer_logprobs

pytestmark = pytest.mark.slow
CALC_MODEL = Path(__file__).resolve().parents[2] / "assets" / "calc-qwen3"
SUMS = "from prime_rl.envs.verifiers_examples import SumsTaskset\n__all__ = ['SumsTaskset']\n"
SUBPROCESS = {"type": "subprocess"}


@pytest.fixture(scope="module")
def server(calc_server):
    if shutil.which("uv") is None:
        pytest.skip("verifiers' harness programs run with uv, which is not on PATH")
    return calc_server


@pytest.fixture
def sums_taskset(tmp_path, monkeypatch) -> str:
    """A taskset id verifiers' loader imports (a top-level module exporting one Taskset)."""
    (tmp_path / "sums_taskset.py").write_text(SUMS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "sums_taskset"


def play(server, args: dict, n: int, temperature: float = 0.7):
    """`n` episodes of the env's first task through the pool endpoint: the group, and each episode with its answers."""
    from prime_rl.configs.orchestrator import ClientConfig, SamplingConfig
    from prime_rl.envs import load_environment
    from prime_rl.orchestrator.episodes import EpisodeSource
    from prime_rl.orchestrator.servers.client import InferenceClient

    env = load_environment("verifiers-env", **args)
    sampling = SamplingConfig(temperature=temperature, max_tokens=16)
    source = EpisodeSource(env, "sim", sampling, 512, str(CALC_MODEL), masks=True)
    example = next(env.examples(0))

    async def run():
        async with InferenceClient(ClientConfig(base_url=[f"{server.url}/v1"]), str(CALC_MODEL)) as client:
            async with source.serving(client):
                group = await source.group(client, example, n)
                await source.score(group)
                played = await source.play(example.info["task"], 1)
                async with httpx.AsyncClient(timeout=30) as http:
                    root = source.endpoint.url.removesuffix("/v1")
                    body = {"token_ids": [72, 105], "sampling_params": {"max_tokens": 2}}
                    keyless = await http.post(f"{root}/inference/v1/generate", json=body)
                    headers = {"Authorization": f"Bearer {source.endpoint.token}"}
                    ended = await http.post(f"{root}/episodes/0123/inference/v1/generate", json=body, headers=headers)
        return group, played, keyless, ended

    return asyncio.run(run())


def test_a_user_sim_episode_trains_the_assistants_turns_as_one_sequence_at_the_servers_logprobs(server, sums_taskset):
    from prime_rl.envs import EnvError
    from prime_rl.orchestrator.episodes import episode_rollouts

    args = {"id": "user_sim", "taskset": {"id": sums_taskset, "num_tasks": 4}, "user": {"max_turns": 3,
            "runtime": SUBPROCESS}, "assistant": {"harness": {"id": "null"}, "runtime": SUBPROCESS}}  # fmt: skip
    group, played, keyless, ended = play(server, args, 2)
    # Only the assistant's traces train: one sample per episode (its turns extend each other), the users' not.
    assert group.episodes == 2 and group.untrained == 2 and len(group.rollouts) == 2
    gaps = []
    for r in group.rollouts:
        assert r.turns >= 2 and r.token_steps.count(0) == sum(r.completion_mask)
        assert set(r.token_servers) == {-1, 0}
        # Model turns and the user's replies alternate inside one sequence; the replies are masked.
        runs = [m for i, m in enumerate(r.completion_mask) if i == 0 or m != r.completion_mask[i - 1]]
        assert runs[:3] == [True, False, True]
        sampled = [i for i, m in enumerate(r.completion_mask) if m]
        ids = r.prompt_ids + r.completion_ids
        trainer = trainer_logprobs(CALC_MODEL, r.prompt_ids, r.completion_ids, 0.7)
        gaps += [abs(r.logprobs[i] - trainer[i]) for i in sampled]
        assert len(ids) == r.num_tokens and set(r.metrics) >= {"correct", "boxed", "user_turns"}
    print(f"{server.backend}: {len(gaps)} assistant tokens over {sum(r.turns for r in group.rollouts)} turns, "
          f"max |recorded - trainer| {max(gaps):.1e}")  # fmt: skip
    assert max(gaps) <= 1e-4
    # A model turn the servers did not sample for that context is refused, never trained on.
    ((episode, answers),) = played
    assert episode_rollouts(episode, answers, group.example, 512, "sim")[0]
    with pytest.raises(EnvError, match="is not an answer our servers gave for that context"):
        episode_rollouts(episode, [], group.example, 512, "sim")
    assert keyless.status_code == 401
    assert ended.status_code == 404 and "no episode 0123 in flight" in ended.json()["error"]["message"]
