"""The reverse-text example learns: its three commands as a user runs them, into a temporary dir.

SFT of the shipped random-init model on texts of 3-16 characters until its held-out loss is below the
config's target, RL on 5-16, eval of both on 512 held-out prompts. The eval reward after RL must beat the
one after SFT by the margin `benchmarks/reverse_text.py` supports (docs/examples/reverse_text.md: every run
of its table gains more), and the training reward must rise over the RL run. The seed is one that table
does not use.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prime_rl.utils.metrics import read_metrics

# 4-15 min on 2 cores (SFT 2-13 of it, by where its plateau ends): above the suite's 600 s per-test limit.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2700)]

CONFIGS = Path(__file__).parents[2] / "configs" / "examples" / "reverse_text"
RL_STEPS = 60  # as configured: at 30 steps the training reward has not clearly risen yet
SEED = "7"  # the doc's table uses seeds 0-2
# The doc's table (5 runs) gains +0.008 … +0.140 on 512 held-out prompts (median +0.079; standard error of a
# gain ~0.01): the margin that spread supports is 0, i.e. RL must improve on SFT. The training reward (16
# prompts a step, 6 steps a tenth) is noisier still: it must rise.
EVAL_GAIN = 0.0


def run(module: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def test_sft_then_rl_raises_the_held_out_reward(tmp_path, free_port):
    sft, rl, ev = tmp_path / "sft", tmp_path / "rl", tmp_path / "eval"
    # SFT's budget is 5,000 steps (~13 min here) for a machine where the plateau lasts; most runs take 1-4 min.
    run("prime_rl.entrypoints.sft", "@", str(CONFIGS / "sft.toml"), "--output-dir", str(sft), "--seed", SEED,
        timeout=1800)  # fmt: skip
    sft_weights = sft / "weights" / "final"
    run(
        "prime_rl.entrypoints.rl", "@", str(CONFIGS / "rl.toml"), "--output-dir", str(rl),
        "--model.name", str(sft_weights),
        "--max-steps", str(RL_STEPS), "--inference.server.port", str(free_port),
        "--orchestrator.seed", SEED, "--inference.seed", SEED,
    )  # fmt: skip
    run(
        "prime_rl.entrypoints.eval", "@", str(CONFIGS / "eval.toml"), "--output-dir", str(ev),
        "--model.name", str(sft_weights), "--weights-dir", str(rl / "weights"), "--steps", f"0,{RL_STEPS}",
    )  # fmt: skip

    summary = {r["step"]: r["reward_mean"] for r in map(json.loads, (ev / "eval" / "summary.jsonl").open())}
    print(f"eval reward: after SFT {summary[0]:.3f}, after RL {summary[RL_STEPS]:.3f}")
    assert summary[RL_STEPS] > summary[0] + EVAL_GAIN, summary
    rewards = [m["reward_mean"] for m in read_metrics(rl, "orchestrator")]
    tenth = len(rewards) // 10
    first, last = sum(rewards[:tenth]) / tenth, sum(rewards[-tenth:]) / tenth
    print(f"training reward: first 10% of steps {first:.3f}, last 10% {last:.3f}")
    assert last > first, rewards
    assert (rl / "plots" / "run.png").is_file()
