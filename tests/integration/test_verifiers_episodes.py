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


def play(server, args: dict, n: int, temperature: float = 0.7, max_tokens: int = 16):
    """`n` episodes of the env's first task through the pool endpoint: the example, each episode with its answers,
    and the endpoint's answers to a request without its key and to one under an episode key never opened."""
    from prime_rl.configs.orchestrator import ClientConfig, SamplingConfig
    from prime_rl.envs import load_environment
    from prime_rl.orchestrator.episodes import EpisodeSource
    from prime_rl.orchestrator.servers.client import InferenceClient

    env = load_environment("verifiers-env", **args)
    sampling = SamplingConfig(temperature=temperature, max_tokens=max_tokens)
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


def test_a_long_episode_is_one_sequence_a_branch_of_the_servers_tokens_and_is_cut_at_seq_len(server):
    """A long episode: a simulated user and the assistant taking turns (each turn a model call through a harness
    program of its own; some twenty calls, until the user's prompt outgrows the servers' context and it closes).
    Each assistant branch is one sequence, its model turns exactly the servers' answers for their contexts (at the
    trainer's logprobs) with the user's turns masked between them; with a seq_len shorter than the branch it is cut
    there, marked cut (trained as a truncated episode), the tokens before the cut as they were."""
    from prime_rl.orchestrator.episodes import describe, episode_rollouts

    if server.backend != "builtin":
        pytest.skip("the episode's packing is the orchestrator's, alike on both backends")
    # reverse-text's short prompts and 6-token turns, so that many turns fit the servers' 1,024 tokens (a user turn
    # whose prompt would not is refused, which the simulated user takes as closing)
    taskset = {"id": "prime_rl_reverse", "min_chars": 5, "max_chars": 8}
    args = {"id": "user_sim", "taskset": taskset, "user": {"max_turns": 16, "runtime": SUBPROCESS},
            "assistant": {"harness": {"id": "null"}, "runtime": SUBPROCESS, "max_turns": 16}}  # fmt: skip
    example, [(episode, answers)], _, _ = play(server, args, 1, max_tokens=6)
    whole, untrained = episode_rollouts(episode, answers, example, 4096, "sim")
    assert untrained == 1 and len(answers) >= 16, describe((episode, answers))  # 20 here: the user closes at 10
    assistant_turns = sum(r.turns for r in whole)
    assert assistant_turns >= 8 and not any(r.cut for r in whole)
    longest = max(whole, key=lambda r: len(r.completion_ids))
    runs = [m for i, m in enumerate(longest.completion_mask) if i == 0 or m != longest.completion_mask[i - 1]]
    assert runs == [True, False] * (len(runs) // 2) + [True] * (len(runs) % 2) and len(runs) >= 15
    trainer = trainer_logprobs(CALC_MODEL, longest.prompt_ids, longest.completion_ids, 0.7)
    gaps = [abs(a - b) for a, b, m in zip(longest.logprobs, trainer, longest.completion_mask, strict=True) if m]
    assert max(gaps) <= 1e-4
    # The same episode in rows of half its length: cut there, its first tokens unchanged.
    seq_len = (len(longest.prompt_ids) + len(longest.completion_ids)) // 2
    cut = max(episode_rollouts(episode, answers, example, seq_len, "sim")[0], key=lambda r: len(r.completion_ids))
    assert cut.cut and cut.truncated and len(cut.prompt_ids) + len(cut.completion_ids) == seq_len
    assert cut.completion_ids == longest.completion_ids[: len(cut.completion_ids)]
    assert cut.logprobs == longest.logprobs[: len(cut.logprobs)]
    print(
        f"{len(answers)} model calls, {assistant_turns} assistant turns in {len(whole)} sample(s); the longest "
        f"{len(longest.prompt_ids) + len(longest.completion_ids)} tokens, max |recorded - trainer| {max(gaps):.1e}"
    )


def test_eval_of_a_verifiers_env_counts_the_groups_that_failed_and_its_seed_replays_its_episodes(server, monkeypatch):
    """The `eval` core on `verifiers-env` (a taskset whose scorer raises on about one text in four): the groups
    that failed are left out and counted (`failed_groups`), not the end of the evaluation; with sampling.seed the
    same evaluation samples the same tokens again, while the episodes of one group differ."""
    if server.backend != "builtin":
        pytest.skip("the eval core and the endpoint's seeds are the orchestrator's, alike on both backends")
    from prime_rl.configs.eval import EvalConfig
    from prime_rl.configs.orchestrator import ClientConfig
    from prime_rl.eval.eval import evaluate_env
    from prime_rl.orchestrator.servers.client import InferenceClient

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tasksets"))
    args = {"taskset": {"id": "faulty_taskset", "task": {"fault": "raise-some"}},
            "agent": {"harness": {"id": "null"}, "runtime": SUBPROCESS}}  # fmt: skip
    config = EvalConfig(
        model={"name": str(CALC_MODEL)}, env_ids=["verifiers-env"], env_args={"verifiers-env": args},
        num_examples=2, seed=0, rollouts_per_example=2, sampling={"temperature": 1.0, "max_tokens": 8, "seed": 7},
        client={"base_url": [f"{server.url}/v1"]},
    )  # fmt: skip

    async def evaluate():
        async with InferenceClient(ClientConfig(base_url=[f"{server.url}/v1"]), str(CALC_MODEL)) as client:
            return await evaluate_env(client, config, "verifiers-env", 0)

    first, again = asyncio.run(evaluate()), asyncio.run(evaluate())
    summary = first.summary()
    print(f"eval: {summary}")
    # seed 0 draws first a text of a length the scorer breaks on (a multiple of 4), then one it scores
    assert summary["failed_groups"] == 1 and len(first.groups) == 1 and summary["samples"] == 2, summary
    assert all("the scorer broke on purpose" in why for why in first.failed), first.failed
    tokens = [[r.completion_ids for r in g.rollouts] for g in first.groups]
    assert tokens == [[r.completion_ids for r in g.rollouts] for g in again.groups]
    assert any(a != b for a, b in tokens), "the two episodes of a group sampled alike: one seed for both?"


def test_a_killed_harness_a_killed_env_server_and_a_blocking_scorer_fail_only_their_episodes(server, monkeypatch):
    """The env runs in a server process of its own (orchestrator/env_server.py). A harness program killed mid-episode
    is a failed episode (verifiers records it; training counts and replaces it). The env server killed mid-episode,
    or a scorer that blocks its event loop (past timeout.episode + GRACE: nothing there answers), fail the episodes
    in flight, never the orchestrator; the server is started again and the next episode plays."""
    if server.backend != "builtin":
        pytest.skip("the env server is the orchestrator's, alike on both backends")
    import itertools
    import os
    import signal
    import time

    from prime_rl.configs.orchestrator import ClientConfig, SamplingConfig
    from prime_rl.envs import EpisodeFailed, load_environment
    from prime_rl.orchestrator import env_server
    from prime_rl.orchestrator.episodes import EpisodeSource
    from prime_rl.orchestrator.servers.client import InferenceClient
    from prime_rl.utils.process import children

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tasksets"))
    EPISODE_S = 10  # timeout.episode: room for a fresh harness program on a busy machine, short for the blocked one
    grace = 2  # env_server.GRACE, shortened: how long the blocked episode takes is the test's cost
    monkeypatch.setattr(env_server, "GRACE", grace)
    args = {"taskset": {"id": "faulty_taskset", "task": {"fault": "block-some"}}, "timeout": {"episode": EPISODE_S},
            "agent": {"harness": {"id": "null"}, "runtime": SUBPROCESS}}  # fmt: skip
    env = load_environment("verifiers-env", **args)
    source = EpisodeSource(env, "faulty", SamplingConfig(temperature=0.7, max_tokens=8), 512, str(CALC_MODEL))
    tasks = [example.info["task"] for example in itertools.islice(env.examples(0), 16)]
    blocking = next(t for t in tasks if len(t.data.text) % 4 == 0)
    fine = next(t for t in tasks if len(t.data.text) % 4)

    async def kill_when_a_harness_runs(pid: int, victim: str) -> float:
        deadline = time.monotonic() + 60
        while not (harnesses := children(pid)):
            assert time.monotonic() < deadline, "no harness program started"
            await asyncio.sleep(0.02)
        os.kill(harnesses[0] if victim == "harness" else pid, signal.SIGKILL)
        return time.monotonic()

    async def run():
        async with InferenceClient(ClientConfig(base_url=[f"{server.url}/v1"]), str(CALC_MODEL)) as client:
            async with source.serving(client):
                first = source.server.process.pid
                playing = asyncio.create_task(source.play(fine, 1))
                await kill_when_a_harness_runs(first, "harness")
                ((killed_harness, _),) = await playing
                playing = asyncio.create_task(source.play(fine, 2))  # two in flight: each fails, one restart
                killed_at = await kill_when_a_harness_runs(first, "server")
                # the first to fail: the one that saw the death, or the other, whose server was restarted under it
                with pytest.raises(EpisodeFailed, match=r"its env server (died \(exit -9\)|was restarted under it)"):
                    await playing
                noticed = time.monotonic() - killed_at
                second = source.server.process.pid
                ((after_kill, _),) = await source.play(fine, 1)
                started = time.monotonic()
                with pytest.raises(EpisodeFailed, match=rf"no answer from its env server in {EPISODE_S + grace:.0f}s"):
                    await source.play(blocking, 1)
                blocked = time.monotonic() - started
                ((after_block, _),) = await source.play(fine, 1)
                pids = (first, second, source.server.process.pid)
                return killed_harness, noticed, pids, after_kill, blocked, after_block

    killed_harness, noticed, pids, after_kill, blocked, after_block = asyncio.run(run())
    print(f"killed env server noticed in {noticed:.1f}s; blocked one failed after {blocked:.1f}s; pids {pids}")
    assert not killed_harness.ok
    assert noticed < 15 and len(set(pids)) == 3  # a poll (0.5 s), then the new server's start
    assert EPISODE_S + grace <= blocked < EPISODE_S + grace + 20
    assert after_kill.ok and after_block.ok, (after_kill.last_error, after_block.last_error)


HANGING_TOOL_S = 30  # its timeout.episode: room to start the harness program and the tool server (~10-18 s, busy)


def play_the_hanging_tool(server) -> tuple:
    """One episode of tests/tasksets/hanging_tool_taskset.py (its `add` never answers): the example, the episode, its
    answers and how long it took."""
    import time

    renderer = {"name": "custom", "import_path": "prime_rl.envs.hermes_renderer.HermesTextRenderer"}
    args = {"taskset": {"id": "hanging_tool_taskset"}, "timeout": {"episode": HANGING_TOOL_S}, "renderer": renderer,
            "agent": {"harness": {"id": "null"}, "runtime": SUBPROCESS}}  # fmt: skip
    started = time.monotonic()
    example, [(episode, answers)], _, _ = play(server, args, 1, max_tokens=96)
    return example, episode, answers, time.monotonic() - started


@pytest.fixture(scope="module", autouse=True)
def hanging_tool(request):
    """The never-answering tool's episode, played on the built-in server in a thread from the module's first test:
    it spends its bound waiting with the machine idle, so it waits beside the tests before its own (none of them
    bounded in time). None where the session does not run its test."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    wanted = any(item.originalname == "test_a_tool_that_never_answers_fails_its_episode_at_the_episode_bound"
                 for item in request.session.items)  # fmt: skip
    if not wanted or shutil.which("uv") is None:
        yield None
        return
    server = request.getfixturevalue("calc_servers").ready("builtin")
    tasksets = str(Path(__file__).resolve().parents[1] / "tasksets")
    patch = pytest.MonkeyPatch()
    patch.syspath_prepend(tasksets)  # the env server imports the taskset, the tool server runs its module
    patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tasksets, os.environ.get("PYTHONPATH")])))
    try:
        with ThreadPoolExecutor(1) as pool:
            yield pool.submit(play_the_hanging_tool, server)
    finally:
        patch.undo()


def test_a_tool_that_never_answers_fails_its_episode_at_the_episode_bound(server, hanging_tool):
    """The model calls the `add` tool and verifiers' tool server in the runtime never answers: the episode ends at
    timeout.episode as a failed one (training counts it and draws another), not a stuck group."""
    from prime_rl.envs import EpisodeFailed
    from prime_rl.orchestrator.episodes import describe, episode_rollouts

    if server.backend != "builtin":
        pytest.skip("the episode's bound is verifiers' and the orchestrator's, alike on both backends")
    example, episode, answers, took = hanging_tool.result(timeout=HANGING_TOOL_S + 300)
    error = episode.last_error
    print(f"{describe((episode, answers))}; ended after {took:.1f}s: {error and error.type}: {error and error.message}")
    # the model's turn was answered (verifiers serves the tools before it asks the model), then the tool hung
    assert not episode.ok and len(answers) >= 1
    assert error.type == "TimeoutError" and f"exceeded its {HANGING_TOOL_S}s deadline" in error.message
    assert HANGING_TOOL_S <= took < HANGING_TOOL_S + 60  # the env server's start, then the bound
    with pytest.raises(EpisodeFailed, match="verifiers' episode of task .* failed"):
        episode_rollouts(episode, answers, example, 512, "hanging")
