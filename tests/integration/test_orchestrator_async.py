"""Step/weight ordering of the async loop on real runs: `rl` with the real server, orchestrator and trainer.

For every step n the rollouts must come from weights step >= n - async_level (== n for async_level 0).
async_level 1 is held by the same assertions in tests/integration/test_rl.py (4 steps) and is not run
again here, to keep the suite's time budget. The async_level 2 run trains on an external environment
loaded by import path from a module outside the package (on PYTHONPATH), as a user's own would be.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from prime_rl.protocol import weights_dir
from prime_rl.utils.metrics import read_metrics

pytestmark = pytest.mark.slow

EXTERNAL_ENV = '''
import itertools
from prime_rl.orchestrator.envs import Example


class VariedAnswers:
    """Reward: distinct characters / 8 (dense, so every group has a signal); logs the length too."""

    def examples(self, seed):
        for i in itertools.count(seed):
            yield Example(prompt=[{"role": "user", "content": f"say {i}"}], answer=str(i))

    def score(self, completion, example):
        return {"reward": len(set(completion)) / 8, "chars": float(len(completion))}


def load(**args):
    return VariedAnswers(**args)
'''

STEPS = 3


@pytest.mark.parametrize("async_level", [0, 2])
def test_every_step_samples_from_weights_no_older_than_async_level(async_level, tiny_model, tmp_path, free_port):
    out = tmp_path / "out"
    env = dict(os.environ)
    args = [
        "--model.name", str(tiny_model), "--output-dir", str(out), "--max-steps", str(STEPS),
        "--async-level", str(async_level), "--inference.server.port", str(free_port),
        "--orchestrator.batch-size", "8", "--orchestrator.rollouts-per-example", "4",
        "--orchestrator.seq-len", "128", "--orchestrator.sampling.max-tokens", "8", "--trainer.optim.lr", "1e-3",
    ]  # fmt: skip
    if async_level == 2:
        (tmp_path / "my_env.py").write_text(EXTERNAL_ENV)
        env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
        args += ["--orchestrator.env.id", "my_env:load"]
    result = subprocess.run(
        [sys.executable, "-m", "prime_rl.rl", *args], capture_output=True, text=True, timeout=300, env=env
    )
    logs = "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted((out / "logs").glob("*.log")))
    assert result.returncode == 0, result.stderr + logs

    orch = read_metrics(out, "orchestrator")
    assert [m["step"] for m in orch] == list(range(STEPS))
    assert [m["step"] for m in read_metrics(out, "trainer")] == list(range(STEPS))
    for m in orch:
        n = m["step"]
        assert m["weight_step"] >= n - async_level, orch
        assert m["weight_step_max"] <= n  # never a policy from the future
        assert m["off_policy_gap"] == n - m["weight_step"]
        if async_level == 0:
            assert m["weight_step"] == m["weight_step_max"] == n
    if async_level == 2:
        assert all("reward/chars" in m for m in orch)  # the external env's own metric is logged
        base = load_file(tiny_model / "model.safetensors")
        last = load_file(weights_dir(out, STEPS) / "model.safetensors")
        assert any(not (base[k] == last[k]).all() for k in base)  # and it trained
