"""A `kill -9` while a checkpoint is written in the background (the default, `ckpt.async_save`) leaves a dir
without STABLE, which `--ckpt.resume-step latest` never picks: the run resumes from the checkpoint before it,
every step's metrics record appears once, and the run finishes."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prime_rl.protocol import checkpoint_steps, is_stable, trainer_checkpoint_dir
from prime_rl.utils.metrics import read_metrics
from prime_rl.utils.tiny_model import create_tiny_model

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
SFT = Path(sys.executable).parent / "sft"
STEPS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # 42M parameters: a checkpoint of ~500 MB (fp32 weights + two AdamW moments) takes seconds to write.
    return create_tiny_model(tmp_path_factory.mktemp("models") / "qwen3-h1024", hidden_size=1024, num_layers=4,
                             vocab_size=2048)  # fmt: skip


def _sft(model: Path, out: Path, *extra: str) -> subprocess.Popen:
    cmd = [str(SFT), "@", str(ROOT / "configs/sft/debug.toml"), "--output-dir", str(out), "--model.name", str(model),
           "--data.path", str(ROOT / "configs/sft/debug/data.jsonl"), "--max-steps", str(STEPS),
           "--ckpt.interval", "1", "--no-log.file", *extra]  # fmt: skip
    # Its own process group: the kill takes the process and any thread or child it has.
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True)  # fmt: skip


def _kill_mid_write(model: Path, out: Path, timeout: float = 120) -> int:
    """Run sft and SIGKILL it while checkpoint step_k (k >= 2) is being written: its shard file exists, STABLE
    does not. Returns k, or 0 if the run got past every such window (or ended) first."""
    proc = _sft(model, out)
    deadline, step = time.monotonic() + timeout, 0
    try:
        while proc.poll() is None and time.monotonic() < deadline and not step:
            for k in range(2, STEPS + 1):
                path = trainer_checkpoint_dir(out, k)
                if (path / "__0_0.distcp").exists() and not is_stable(path):
                    os.killpg(proc.pid, signal.SIGKILL)
                    step = k
                    break
            time.sleep(0.02)
    finally:
        if proc.poll() is None and not step:
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    if not step and proc.returncode != 0:
        pytest.fail(f"sft failed or saw no checkpoint step_k (k >= 2) being written in {timeout}s:\n{output[-4000:]}")
    # STABLE may have landed between the check and the kill: that try does not count.
    return 0 if step and is_stable(trainer_checkpoint_dir(out, step)) else step


def test_a_kill_mid_write_leaves_no_stable_and_the_run_resumes_from_the_checkpoint_before(model, tmp_path):
    out = tmp_path / "run"
    killed = _kill_mid_write(model, out)
    if not killed:  # missed the window once (the machine was slow or fast): one more try, in a fresh dir
        out = tmp_path / "retry"
        killed = _kill_mid_write(model, out)
    assert killed, "the kill never landed while a checkpoint was being written (two tries)"
    print(f"killed while checkpoint step_{killed} was being written")
    partial = trainer_checkpoint_dir(out, killed)
    assert partial.is_dir() and not is_stable(partial)
    assert checkpoint_steps(out, ("trainer",))[-1] == killed - 1  # finished before step_k started

    proc = _sft(model, out, "--ckpt.resume-step", "latest")
    try:
        output, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the resumed sft did not finish within 180s:\n{output[-4000:]}")
    assert proc.returncode == 0, output[-4000:]
    assert f"resumed from checkpoints/step_{killed - 1} " in output
    assert [r["step"] for r in read_metrics(out, "sft")] == list(range(STEPS))  # each step once
    assert checkpoint_steps(out, ("trainer",))[-1] == STEPS  # the last one finished before the run ended
    assert all(is_stable(trainer_checkpoint_dir(out, k)) for k in range(killed - 1, STEPS + 1))
