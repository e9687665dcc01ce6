"""`rl` on environments whose episodes verifiers plays itself (`verifiers-env`): its chat program, interception
server and multi-agent envs through the pool endpoint, with faults in the env's own code counted and survived.

The tasksets: `prime_rl_reverse` (shipped), tests/tasksets/faulty_taskset.py (its scorer raises or hangs on
purpose) and verifiers' textarena games (Hangman), on the tiny calc model taught the bash harness
(assets/calc-bash-qwen3). verifiers' chat program needs its dependencies from PyPI once (uv caches them).
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prime_rl.utils.metrics import read_metrics
from tests.integration.test_rl import show_logs

pytestmark = pytest.mark.slow
MODEL = Path(__file__).resolve().parents[2] / "assets" / "calc-bash-qwen3"
TASKSETS = Path(__file__).resolve().parents[1] / "tasksets"
NULL_AGENT = 'agent = { harness = { id = "null" }, runtime = { type = "subprocess" } }'

# The shipped example's five envs (docs/examples/agents.md), and two whose scorer fails on purpose.
EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "examples" / "agents" / "rl.toml"
FAULTY = f"""
[[orchestrator.env]]
id = "verifiers-env"
name = "broken"
max_tokens = 16
[orchestrator.env.args]
taskset = {{ id = "faulty_taskset", task = {{ fault = "raise-some" }} }}
{NULL_AGENT}

[[orchestrator.env]]
id = "verifiers-env"
name = "slow"
max_tokens = 16
[orchestrator.env.args]
taskset = {{ id = "faulty_taskset", task = {{ fault = "hang-some" }} }}
timeout = {{ episode = 20 }}
{NULL_AGENT}
"""
ENVS = EXAMPLE.read_text() + FAULTY
STEPS = 3  # each faulty env fails episodes within them
# textarena's games draw their words from nltk's word lists, which nltk downloads from GitHub at load: this machine
# cannot reach it (the download fails at once, and the games read what NLTK_DATA holds), so the tests give Hangman
# a word list of their own.
WORDS = "cat\ndog\nsun\nhat\nred\nbox\n"

ALWAYS_BROKEN = f"""
[orchestrator]
batch_size = 2
rollouts_per_example = 2
max_env_errors = 2
seq_len = 512

[[orchestrator.env]]
id = "verifiers-env"
name = "broken"
[orchestrator.env.args]
taskset = {{ id = "faulty_taskset", task = {{ fault = "raise" }} }}
{NULL_AGENT}
"""


@pytest.fixture(autouse=True)
def needs_verifiers_and_uv():
    pytest.importorskip("verifiers.v1", reason="verifiers is not installed (uv sync --extra verifiers)")
    if shutil.which("uv") is None:
        pytest.skip("verifiers' harness programs run with uv, which is not on PATH")


def run(tmp_path, free_port, config: str, steps: int, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    (tmp_path / "rl.toml").write_text(config)
    args = [
        "@", str(tmp_path / "rl.toml"), "--model.name", str(MODEL), "--output-dir", str(out), "--max-steps",
        str(steps), "--async-level", "0", "--inference.server.port", str(free_port), "--inference.max-model-len",
        "2048", "--trainer.optim.lr", "1e-4", *extra,
    ]  # fmt: skip
    words = tmp_path / "nltk_data" / "corpora" / "words"
    words.mkdir(parents=True)
    for name in ("en", "en-basic"):
        (words / name).write_text(WORDS)
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TASKSETS), os.environ.get("PYTHONPATH")])),
        "NLTK_DATA": str(tmp_path / "nltk_data"),
    }
    rl = [sys.executable, "-m", "prime_rl.entrypoints.rl", *args]
    return subprocess.run(rl, capture_output=True, text=True, timeout=600, env=env), out


def test_rl_trains_on_episodes_verifiers_plays_on_policy_and_survives_a_scorer_that_raises_or_hangs(
    tmp_path, free_port
):
    """Seven envs, one group each per step: single-turn reverse-text, the calculator (a tool served by verifiers'
    tool server) with the `null` harness and with the `bash` harness (bash, edit and add offered), a user
    simulator (its user never trained), two whose scorer raises / hangs past the episode's 20 s deadline on
    some tasks, and a textarena game (Hangman: the engine plays the user, each move answered with the board).
    On-policy, the trainer's logprobs of the trained tokens match the servers' (mismatch KL < 1e-3); every failed
    group is counted and replaced."""
    start = time.perf_counter()
    result, out = run(tmp_path, free_port, ENVS, STEPS, "--orchestrator.batch-size", "14")  # 7 groups of 2
    assert result.returncode == 0, result.stderr + show_logs(out)
    orch, trainer = read_metrics(out, "orchestrator"), read_metrics(out, "trainer")
    envs = ("reverse", "calc", "bash", "sim", "broken", "slow", "game")
    errors = {env: sum(m[f"env_errors/{env}"] for m in orch) for env in envs}
    print(f"{STEPS} steps in {time.perf_counter() - start:.0f}s, env errors {errors}; per step: " + "; ".join(
        f"reverse {m['reward/reverse']:.3f}, calc {m['reward/calc']:.2f} over {m['turns/calc']:.1f} turns, "
        f"bash {m['reward/bash']:.2f} over {m['turns/bash']:.1f} turns, "
        f"sim {m['reward/sim']:.3f} over {m['turns/sim']:.1f} turns, "
        f"game {m['reward/game']:.2f} over {m['turns/game']:.1f} turns, "
        f"gen {m['time/generate']:.1f}s" for m in orch))  # fmt: skip
    assert [m["step"] for m in trainer] == list(range(STEPS))
    assert all(m["mismatch_kl"] < 1e-3 for m in trainer), [m["mismatch_kl"] for m in trainer]
    assert all(m[f"groups/{env}"] == 1 for m in orch for env in errors)
    assert all(m["untrained_traces/sim"] == 2 and m["untrained_traces/reverse"] == 0 for m in orch)
    # One sample per episode while each turn's prompt extends the last; a turn cut at max_tokens is closed by the
    # template on the next render (not what was sampled), which starts another branch: another sample.
    assert all(m["samples_per_episode/sim"] >= 1 for m in orch)
    assert max(m["turns/sim"] for m in orch) > 1  # the user answered and the assistant spoke again
    # The game engine answered a move with the board and the player moved again, all in one sequence (each turn's
    # prompt extends the last), scored off the engine (Hangman: the share of the letters found, 1 for the word); a
    # sample more only where a move was cut at max_tokens (the branch it ends is truncated).
    assert all(m["turns/game"] > 1 for m in orch)
    for m in orch:  # 2 episodes a step
        samples = round(m["samples_per_episode/game"] * 2)
        assert samples - 2 <= round(m["truncated_fraction/game"] * samples), m
    assert all(m["untrained_traces/game"] == 0 and 0 <= m["reward/game/game_reward"] <= 1 for m in orch)
    assert errors["reverse"] == errors["calc"] == errors["bash"] == errors["sim"] == errors["game"] == 0
    assert errors["broken"] > 0 and errors["slow"] > 0
    # The calc model calls `add` (served by verifiers' tool server in the runtime) and answers with its result.
    assert max(m["reward/calc"] for m in orch) > 0 and max(m["turns/calc"] for m in orch) > 1
    # Under the bash harness it runs `echo $((a + b))` through the harness's bash tool and answers with the output.
    assert max(m["reward/bash"] for m in orch) > 0 and max(m["turns/bash"] for m in orch) > 1
    log = (out / "logs" / "orchestrator.log").read_text()
    assert "the scorer broke on purpose" in log and "exceeded its 20s deadline" in log


def test_an_env_whose_every_group_fails_ends_the_run_with_its_own_error(tmp_path, free_port):
    result, out = run(tmp_path, free_port, ALWAYS_BROKEN, 3)
    assert result.returncode != 0
    assert "broken: 2 groups in a row failed (max_env_errors); the last:" in result.stderr, result.stderr[-3000:]
    assert "the scorer broke on purpose" in result.stderr and "Traceback" not in result.stderr
