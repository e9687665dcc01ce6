"""A real two-environment `rl` run with a custom loss module and the ratio masks: the trainer imports the loss
from the config's import path and writes per-environment metrics to metrics/trainer.jsonl."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prime_rl.utils.metrics import read_metrics

pytestmark = pytest.mark.slow

TWO_ENVS = """
[orchestrator]
batch_size = 8
rollouts_per_example = 2

[[orchestrator.env]]
id = "reverse-text"

[[orchestrator.env]]
id = "arithmetic"
name = "math"
max_tokens = 4

[trainer.loss]
type = "custom"
import_path = "custom_loss_aipo:aipo"
kwargs = { max_ratio = 8.0 }
kl_coef = 0.01
kl_type = "k2"
mask = { token_low = 0.5, token_high = 2.0, sequence_low = 0.5, sequence_high = 2.0, tv_max = 0.5 }
"""


def test_two_env_rl_with_a_custom_masked_loss_reports_per_env_trainer_metrics(tiny_model, tmp_path, free_port):
    out = tmp_path / "out"
    (tmp_path / "two_envs.toml").write_text(TWO_ENVS)
    args = [
        "@", str(tmp_path / "two_envs.toml"), "--model.name", str(tiny_model), "--output-dir", str(out),
        "--max-steps", "3", "--inference.server.port", str(free_port), "--orchestrator.seq-len", "128",
        "--orchestrator.sampling.max-tokens", "8", "--trainer.optim.lr", "1e-3",
    ]  # fmt: skip
    # The custom loss module lives beside the unit tests; the trainer finds it on PYTHONPATH.
    custom_dir = Path(__file__).parents[1] / "unit" / "trainer" / "rl"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(custom_dir), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-m", "prime_rl.entrypoints.rl", *args], capture_output=True, text=True, timeout=300, env=env
    )
    logs = "\n".join(p.read_text()[-3000:] for p in sorted((out / "logs").glob("*.log")))
    assert result.returncode == 0, result.stderr + logs

    records = read_metrics(out, "trainer")
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        for metric in ("mismatch_kl", "is_masked", "entropy"):
            per_env = [r[f"{metric}/reverse-text"], r[f"{metric}/math"]]
            # The step's mean over all loss tokens is a weighted mean of the two environments' means.
            assert min(per_env) - 1e-9 <= r[metric] <= max(per_env) + 1e-9, (metric, r)
        assert all(0 <= r[k] <= 1 for k in ("is_masked", "is_masked/token", "is_masked/sequence", "is_masked/tv"))
        assert r["is_masked"] >= max(r["is_masked/token"], r["is_masked/sequence"], r["is_masked/tv"])
        assert r["mismatch_kl/math"] >= 0 and r["mismatch_kl/reverse-text"] >= 0
        assert r["entropy/math"] > 0 and r["entropy/reverse-text"] > 0
    assert records[-1]["mismatch_kl"] < 0.5  # the servers sample (nearly) the policy being trained
