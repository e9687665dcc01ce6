"""The reverse-text example learns: its three commands as a user runs them, into a temporary dir.

SFT of the shipped random-init model (Muon) on an imperfect demonstrator's answers (texts of 3-16
characters, one character in five slipped) until its loss on held-out exact answers is below the config's
target, RL on 5-16 scored on the exact reversal, eval of both on 512 held-out prompts. The eval reward
after RL must beat the one after SFT, and the training reward must rise over the RL run, by the margins
`benchmarks/learning.py reverse-text` supports (docs/examples/reverse_text.md: every run of its table gains more).
The seed is one that table does not use.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prime_rl.utils.metrics import read_metrics

# ~5 min on 2 cores: above the suite's 600 s per-test limit only if SFT needs most of its 2,000-step budget.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

CONFIGS = Path(__file__).parents[2] / "configs" / "examples" / "reverse_text"
RL_STEPS = 60  # as configured
SEED = "7"  # the doc's table uses seeds 0-2
# The doc's table (9 runs: 3 seeds x 1-2 threads x AVX2/AVX-512) gains +0.167 … +0.209 on 512 held-out
# prompts (standard error of a gain ~0.01), and its training reward rises by 0.128 … 0.204 (16 prompts a
# step, 6 steps a tenth): margins of about half the smallest leave room for machines it does not cover.
EVAL_GAIN = 0.10
TRAIN_RISE = 0.08


def run(module: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def test_sft_then_rl_raises_the_held_out_reward(tmp_path, free_port):
    sft, rl, ev = tmp_path / "sft", tmp_path / "rl", tmp_path / "eval"
    # SFT stops on its held-out loss after 210-370 steps in the doc's runs (1-2 min); its budget is 2,000.
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

    summary = {r["step"]: r["reward_mean"] for r in map(json.loads, (ev / "summary.jsonl").open())}
    print(f"eval reward: after SFT {summary[0]:.3f}, after RL {summary[RL_STEPS]:.3f}")
    assert summary[RL_STEPS] > summary[0] + EVAL_GAIN, summary
    rewards = [m["reward_mean"] for m in read_metrics(rl, "orchestrator")]
    tenth = len(rewards) // 10
    first, last = sum(rewards[:tenth]) / tenth, sum(rewards[-tenth:]) / tenth
    print(f"training reward: first 10% of steps {first:.3f}, last 10% {last:.3f}")
    assert last > first + TRAIN_RISE, rewards
    assert (rl / "plots" / "run.png").is_file()
    # Both packers count a shared prompt once where the CPU trainer computes it once: every row holds more tokens
    # than seq_len (SFT 512, RL 256), which rows packed whole never do.
    for out, service, seq_len in ((sft, "sft", 512), (rl, "trainer", 256)):
        assert all(m["num_rows"] * seq_len < m["num_tokens"] for m in read_metrics(out, service)), service
