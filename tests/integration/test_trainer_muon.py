"""The real `trainer` entrypoint takes a step with `--optim.type muon` (Muon for the decoder matrices)."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prime_rl.protocol import is_stable, weights_dir
from prime_rl.utils.hf_layout import iter_safetensors
from prime_rl.utils.metrics import read_metrics

pytestmark = pytest.mark.slow

TRAINER = Path(sys.executable).parent / "trainer"


def test_one_muon_step_on_fake_data_updates_the_weights(tiny_model, tmp_path):
    cmd = [str(TRAINER), "--model.name", str(tiny_model), "--output-dir", str(tmp_path), "--data.fake",
           "--max-steps", "1", "--data.fake-seq-len", "64", "--data.fake-micro-batches", "1",
           "--data.fake-max-len", "32", "--optim.type", "muon", "--optim.lr", "1e-3", "--optim.muon-lr", "2e-2",
           "--optim.muon-adjust-lr-fn", "original"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    [metrics] = read_metrics(tmp_path, "trainer")
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert is_stable(weights_dir(tmp_path, 1))
    before, after = dict(iter_safetensors(Path(tiny_model))), dict(iter_safetensors(weights_dir(tmp_path, 1)))
    change = (after["model.layers.0.mlp.up_proj.weight"] - before["model.layers.0.mlp.up_proj.weight"]).abs().max()
    assert change == pytest.approx(2e-2 * 0.4, rel=0.5)  # lr · sqrt(max(1, 128/64)) · |orthogonalized entry| ≈ 0.3
    assert not torch.equal(after["model.norm.weight"], before["model.norm.weight"])  # AdamW's part moved too
