"""Step/weight ordering of the async loop on real runs: `rl` with the real server, orchestrator and trainer.

For every step n the rollouts must come from weights step >= n - async_level (== n for async_level 0) and
never from a policy newer than n. Off-policy sampling is asserted deterministically: the servers start at
weights step 0 and the orchestrator relays new weights only when a step needs them, so every step
n <= async_level samples from step 0, i.e. runs exactly n steps off-policy (step 1 with async_level 1,
steps 1 and 2 with async_level 2), however fast the trainer is. The async_level 2 run trains on an external
environment loaded by import path from a module outside the package (on PYTHONPATH), as a user's own would be.
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
from prime_rl.envs import Example


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

# async_level + 2 steps (so the bound n - async_level is hit at least once), but at most 3: each further step
# costs a trainer step, the runs are dominated by starting the three services.
STEPS = {0: 2, 1: 3, 2: 3}


@pytest.mark.parametrize("async_level", [0, 1, 2])
def test_every_step_samples_from_weights_no_older_than_async_level(async_level, tiny_model, tmp_path, free_port):
    out, steps = tmp_path / "out", STEPS[async_level]
    env = dict(os.environ)
    args = [
        "--model.name", str(tiny_model), "--output-dir", str(out), "--max-steps", str(steps),
        "--async-level", str(async_level), "--inference.server.port", str(free_port),
        "--orchestrator.batch-size", "8", "--orchestrator.rollouts-per-example", "4",
        "--orchestrator.seq-len", "128", "--orchestrator.sampling.max-tokens", "8", "--trainer.optim.lr", "1e-3",
    ]  # fmt: skip
    if async_level == 2:
        (tmp_path / "my_env.py").write_text(EXTERNAL_ENV)
        env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
        args += ["--orchestrator.env.id", "my_env:load"]
    result = subprocess.run(
        [sys.executable, "-m", "prime_rl.entrypoints.rl", *args], capture_output=True, text=True, timeout=300, env=env
    )
    logs = "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted((out / "logs").glob("*.log")))
    assert result.returncode == 0, result.stderr + logs

    orch = read_metrics(out, "orchestrator")
    assert [m["step"] for m in orch] == list(range(steps))
    assert [m["step"] for m in read_metrics(out, "trainer")] == list(range(steps))
    for m in orch:
        n = m["step"]
        assert m["weight_step"] >= n - async_level, orch
        assert m["weight_step_max"] <= n  # never a policy from the future
        assert m["off_policy_gap"] == n - m["weight_step"]
        if async_level == 0:
            assert m["weight_step"] == m["weight_step_max"] == n
        if n <= async_level:  # still on the base weights: exactly n steps off-policy
            assert m["weight_step_max"] == 0 and m["off_policy_gap"] == n, orch
    assert max(m["off_policy_gap"] for m in orch) == async_level  # the run really was async_level off-policy
    if async_level == 2:
        assert all("reward/chars" in m for m in orch)  # the external env's own metric is logged
        base = load_file(tiny_model / "model.safetensors")
        last = load_file(weights_dir(out, steps) / "model.safetensors")
        assert any(not (base[k] == last[k]).all() for k in base)  # and it trained
