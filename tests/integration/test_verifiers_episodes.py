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
    """`n` episodes of the env's first task through the pool endpoint: the example, each episode with its answers,
    and the endpoint's answers to a request without its key and to one under an episode key never opened."""
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
                played = await source.play(example.info["task"], n)
                async with httpx.AsyncClient(timeout=30) as http:
                    root = source.endpoint.url.removesuffix("/v1")
                    body = {"token_ids": [72, 105], "sampling_params": {"max_tokens": 2}}
                    keyless = await http.post(f"{root}/inference/v1/generate", json=body)
                    headers = {"Authorization": f"Bearer {source.endpoint.token}"}
                    ended = await http.post(f"{root}/episodes/0123/inference/v1/generate", json=body, headers=headers)
        return example, played, keyless, ended

    return asyncio.run(run())


def test_a_user_sim_episode_trains_the_assistants_turns_at_the_servers_logprobs_and_never_the_users(
    server, sums_taskset
):
    from prime_rl.envs import EnvError
    from prime_rl.orchestrator.episodes import episode_rollouts

    args = {"id": "user_sim", "taskset": {"id": sums_taskset, "num_tasks": 4}, "user": {"max_turns": 2,
            "runtime": SUBPROCESS}, "assistant": {"harness": {"id": "null"}, "runtime": SUBPROCESS}}  # fmt: skip
    example, played, keyless, ended = play(server, args, 2)
    samples, gaps = [], []
    for episode, answers in played:
        rollouts, untrained = episode_rollouts(episode, answers, example, 512, "sim")
        assert untrained == 1  # the simulated user's trace
        samples += rollouts
    # The assistant's turns: one sample while each prompt extends the last turn's tokens (more where a turn cut at
    # max_tokens was re-rendered closed); the user's replies between them masked.
    assert len(samples) >= 2 and max(r.turns for r in samples) >= 2
    for r in samples:
        assert r.token_steps.count(0) == sum(r.completion_mask) and set(r.token_servers) <= {-1, 0}
        runs = [m for i, m in enumerate(r.completion_mask) if i == 0 or m != r.completion_mask[i - 1]]
        assert runs[0] is True and runs == [True, False] * (len(runs) // 2) + [True] * (len(runs) % 2)
        trainer = trainer_logprobs(CALC_MODEL, r.prompt_ids, r.completion_ids, 0.7)
        gaps += [abs(r.logprobs[i] - trainer[i]) for i, m in enumerate(r.completion_mask) if m]
    print(f"{server.backend}: {len(samples)} samples, {len(gaps)} assistant tokens over "
          f"{sum(r.turns for r in samples)} turns, max |recorded - trainer| {max(gaps):.1e}")  # fmt: skip
    assert max(gaps) <= 1e-4
    # A model turn the servers did not sample for that context is refused, never trained on.
    episode, _ = played[0]
    with pytest.raises(EnvError, match="is not an answer our servers gave for that context"):
        episode_rollouts(episode, [], example, 512, "sim")
    assert keyless.status_code == 401
    assert ended.status_code == 404 and "no episode 0123 in flight" in ended.json()["error"]["message"]
