"""Operator errors through the real commands (issue 48, points 8-12; the table in docs/usage.md "Exit statuses
and operator errors"): each is one line and a documented exit status, and leaves the output dir as the table says.
The config cases that fail at parse are in tests/unit/test_config_errors.py."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
BIN = Path(sys.executable).parent
TINY = str(ROOT / "assets/tiny-qwen3")


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_rl_in_a_dir_holding_step_dirs_no_run_wrote_refuses_and_deletes_nothing(tmp_path):
    """Point 8: `rl --output-dir .` (or "", before it was refused at parse) in a dir with a user's own
    weights/step_1 and rollouts/step_0 deleted both at its fresh start."""
    (tmp_path / "weights/step_1").mkdir(parents=True)
    (tmp_path / "weights/step_1/model.safetensors").write_text("mine")
    (tmp_path / "rollouts/step_0").mkdir(parents=True)
    cmd = [BIN / "rl", "@", ROOT / "configs/debug/rl.toml", "--model.name", TINY, "--output-dir", "."]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines()[-1].endswith(
        f"rl ERROR {tmp_path} holds rollouts/step_0, weights/step_1 but no run/versions.json: no prime-rl run wrote "
        "them, and a run there would delete them; move them or choose another output_dir"
    )
    assert "Traceback" not in result.stderr
    # Its own log and the (released) locks' folder; the user's files as they were.
    assert files_under(tmp_path) == ["logs", "logs/rl.log", "rollouts", "rollouts/step_0", "run", "weights",
                                     "weights/step_1", "weights/step_1/model.safetensors"]  # fmt: skip
    assert (tmp_path / "weights/step_1/model.safetensors").read_text() == "mine"


def test_a_failed_trainer_under_torchrun_is_its_own_line_and_ours_without_torchs_summary(tmp_path):
    """Point 12: torch's agent logged `failed (exitcode: 1) local_rank: 0 (pid: ...)` beside our line."""
    cmd = [sys.executable, "-m", "prime_rl.launch.torchrun", "--standalone", "--nproc-per-node", "1", "-m",
           "prime_rl.entrypoints.trainer", "--model.name", TINY, "--output-dir", str(tmp_path),
           "--data.timeout", "1"]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.splitlines()
    assert lines[-1] == "trainer rank 0 failed first (exit status 1); its error is above"
    assert lines[-2].endswith(f"trainer ERROR timed out after 1s waiting for rollouts for step 0 "
                              f"({tmp_path}/rollouts/step_0/rank_0.safetensors)")  # fmt: skip
    assert "failed (exitcode" not in result.stderr and "Traceback" not in result.stderr


def test_sft_on_a_full_disk_exits_2_with_one_diskfull_line_and_no_half_written_dir(tmp_path):
    """Point 10: a real 3 MiB tmpfs (in a private mount namespace: `unshare -rm`, no root needed) fills during
    the background checkpoint of step 2 and the weights of step 4. It was torch's `[enforce fail at
    inline_container.cc:672] unexpected pos` and a checkpoints/step_n/trainer/ without STABLE."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1): cannot mount a small filesystem without root")
    disk = tmp_path / "disk"
    disk.mkdir()
    listing = tmp_path / "left.txt"
    sft = [str(BIN / "sft"), "@", str(ROOT / "configs/sft/debug.toml"), "--model.name", TINY, "--data.path",
           str(ROOT / "configs/sft/debug/data.jsonl"), "--output-dir", str(disk / "out"), "--max-steps", "6",
           "--ckpt.interval", "2", "--weights-interval", "2"]  # fmt: skip
    script = (
        f'mount -t tmpfs -o size=3m tmpfs {disk} || exit 99; "$@"; rc=$?; cd {disk}/out && find . > {listing}; exit $rc'
    )
    result = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *sft], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)  # fmt: skip
    if result.returncode == 99:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {result.stderr.strip()}")
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and errors[0].endswith(
        f"sft ERROR no space left on the device of {disk}/out/weights/step_4 while writing it; free space there"
    ), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "inline_container" not in result.stderr
    left = sorted(line.removeprefix("./") for line in listing.read_text().split())
    assert "checkpoints/step_2" not in left and not any(p.startswith("weights/step_4") for p in left)
    assert {p for p in left if p.startswith("weights/step_")} >= {"weights/step_2", "weights/step_2/STABLE"}
