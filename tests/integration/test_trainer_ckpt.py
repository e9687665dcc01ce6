"""RL trainer checkpoints with the real `trainer` entrypoint on hand-written rank files.

4 straight steps == 2 steps with --ckpt, then --ckpt.resume-step latest for 2 more: same weights (on CPU in
fp32 the resumed run is bitwise equal; the test allows 1e-6), same losses, lr schedule and counters.
A one-rank run (an unsharded model) resumes on two ranks (FSDP shards) from the same checkpoint.
(Multi-node launches and checkpoint conversion are tested in test_trainer.py, beside the 2-rank run.)
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prime_rl.protocol import checkpoint_steps, is_stable, list_steps, weights_dir, weights_root
from prime_rl.protocol.records import write_rank_file
from prime_rl.trainer.fake_data import fake_micro_batches
from prime_rl.utils.hf_layout import iter_safetensors
from prime_rl.utils.metrics import read_metrics
from tests.processes import finish

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
TRAIN_PY = Path(__file__).parents[2] / "src" / "prime_rl" / "entrypoints" / "trainer.py"


def _write_rollouts(out: Path, world_size: int, steps=range(4)) -> None:
    """The same 4 packed rows per step however many ranks share them."""
    for step in steps:
        rows = fake_micro_batches(step, 0, 4, 192, 8, 64, 1000, seed=0)
        for rank in range(world_size):
            write_rank_file(out, step, rank, rows[rank::world_size])


def _args(tiny_model, out: Path, *extra: str) -> list[str]:
    return ["--model.name", str(tiny_model), "--output-dir", str(out), "--optim.lr", "1e-3", "--data.timeout", "60",
            "--optim.scheduler", "cosine", "--optim.warmup-steps", "1", *extra]  # fmt: skip


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 180) -> str:
    rc, output = finish(proc, "trainer", timeout)
    assert rc == 0, output[-6000:]
    return output


def _assert_same_weights(a: Path, b: Path, atol: float) -> None:
    wa, wb = dict(iter_safetensors(a)), dict(iter_safetensors(b))
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=atol, rtol=0, msg=name)


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """Every first-phase run, started together so their torch imports overlap."""
    root = tmp_path_factory.mktemp("ckpt")
    dirs = {name: root / name for name in ("straight", "resumed", "missing", "rescaled")}
    _write_rollouts(dirs["straight"], 1)
    _write_rollouts(dirs["resumed"], 1)
    _write_rollouts(dirs["rescaled"], 1, range(2))
    _write_rollouts(dirs["rescaled"], 2, range(2, 4))
    procs = {
        "straight": _start([str(BIN / "trainer"), *_args(tiny_model, dirs["straight"], "--max-steps", "4")]),
        "resumed": _start([str(BIN / "trainer"), *_args(tiny_model, dirs["resumed"], "--max-steps", "2", "--ckpt")]),
        "missing": _start([str(BIN / "trainer"), *_args(tiny_model, dirs["missing"], "--ckpt.resume-step", "3")]),
        "rescaled": _start([str(BIN / "trainer"), *_args(tiny_model, dirs["rescaled"], "--max-steps", "2", "--ckpt")]),
    }
    yield procs, dirs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_resumed_run_matches_an_uninterrupted_one(tiny_model, runs):
    procs, dirs = runs
    _finish(procs["resumed"])
    resumed = dirs["resumed"]
    assert checkpoint_steps(resumed, ("trainer",)) == [2]
    # The second half starts as soon as the checkpoint exists, overlapping the 4-step run still going.
    second_half = _start([str(BIN / "trainer"), *_args(tiny_model, resumed, "--max-steps", "4",
                                                       "--ckpt.resume-step", "latest")])  # fmt: skip
    _finish(procs["straight"])
    output = _finish(second_half)
    assert "Traceback" not in output
    assert "resumed from checkpoints/step_2" in (resumed / "logs" / "trainer.log").read_text()
    _assert_same_weights(weights_dir(dirs["straight"], 4), weights_dir(resumed, 4), atol=1e-6)
    # The checkpoint step's weights survive pruning (an orchestrator resuming at 2 needs them).
    assert list_steps(weights_root(resumed)) == [2, 3, 4] and is_stable(weights_dir(resumed, 2))
    assert checkpoint_steps(resumed, ("trainer",)) == [2, 4]  # saved again at the end of the run
    straight, again = read_metrics(dirs["straight"], "trainer"), read_metrics(resumed, "trainer")
    assert [m["step"] for m in again] == [0, 1, 2, 3]
    for a, b in zip(straight, again, strict=True):  # same loss, lr schedule and progress counters
        for key in ("loss", "lr", "grad_norm", "progress/tokens", "progress/samples"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-8), key


def test_a_one_rank_checkpoint_resumes_on_two_ranks(tiny_model, runs):
    procs, dirs = runs
    _finish(procs["rescaled"])
    rescaled = dirs["rescaled"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(TRAIN_PY)]
    output = _finish(_start([*torchrun, *_args(tiny_model, rescaled, "--max-steps", "4", "--ckpt.resume-step", "2")]))
    assert "Traceback" not in output
    _finish(procs["straight"])
    # Two ranks sum the same gradients in another order: equal up to float rounding.
    _assert_same_weights(weights_dir(dirs["straight"], 4), weights_dir(rescaled, 4), atol=1e-5)
    assert checkpoint_steps(rescaled, ("trainer",)) == [2, 4]
    straight, again = read_metrics(dirs["straight"], "trainer"), read_metrics(rescaled, "trainer")
    for a, b in zip(straight[2:], again[2:], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-7)


def test_resume_from_a_missing_checkpoint_exits_1_with_a_clear_message(runs):
    procs, _ = runs
    output, _ = procs["missing"].communicate(timeout=120)
    assert procs["missing"].returncode == 1
    assert "--ckpt.resume-step 3: no complete trainer checkpoint" in output and "Traceback" not in output
