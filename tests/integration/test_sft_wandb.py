"""`sft --wandb.offline`: the real entrypoint on the shipped debug config (3 steps in all), its W&B run read back
from W&B's own record file; a resumed run (`--ckpt.resume-step`) goes on in the same W&B run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
SFT = Path(sys.executable).parent / "sft"


def sft(out: Path, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    pytest.importorskip("wandb", reason="the wandb extra is not installed (uv sync --extra wandb)")
    cmd = [str(SFT), "@", str(ROOT / "configs/sft/debug.toml"), "--output-dir", str(out), "--max-steps", "3",
           "--model.name", str(ROOT / "assets/tiny-qwen3"), "--data.path", str(ROOT / "configs/sft/debug/data.jsonl"),
           "--val.data.path", str(ROOT / "configs/sft/debug/data.jsonl"), "--val.interval", "1",
           "--wandb.project", "sft-test", "--wandb.offline", *extra]  # fmt: skip
    # W&B's settings and cache in the test's tmp dir; no network, no login
    env = os.environ | {"WANDB_DIR": str(tmp), "WANDB_CONFIG_DIR": str(tmp), "WANDB_CACHE_DIR": str(tmp)}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_sft_logs_each_step_and_its_config_to_one_wandb_run_across_a_resume(tmp_path):
    from prime_rl.protocol import wandb_run_file
    from prime_rl.utils.metrics import read_metrics
    from prime_rl.utils.wandb import read_offline

    out = tmp_path / "out"
    first = sft(out, tmp_path, "--max-steps", "2", "--ckpt.interval", "2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run_id = json.loads(wandb_run_file(out).read_text())["id"]
    second = sft(out, tmp_path, "--ckpt.resume-step", "2")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert json.loads(wandb_run_file(out).read_text())["id"] == run_id

    run_dirs = sorted((out / "wandb").glob("offline-run-*"))
    assert [d.name.rsplit("-", 1)[1] for d in run_dirs] == [run_id, run_id]  # one W&B run, in two sittings
    (config, first_rows), (_, second_rows) = (read_offline(d) for d in run_dirs)
    rows = [row for row in first_rows + second_rows if "sft/step" in row]
    assert [row["sft/step"] for row in rows] == [0, 1, 2]
    records = read_metrics(out, "sft")
    for row, record in zip(rows, records, strict=True):
        assert row["sft/loss"] == pytest.approx(record["loss"]) and row["sft/val/loss"] == pytest.approx(
            record["val/loss"]
        )
    assert config["model"]["name"] == str(ROOT / "assets/tiny-qwen3") and config["wandb"]["offline"] is True
