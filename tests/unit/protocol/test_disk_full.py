"""A full disk at any write of the output dir (issue 48, point 10): one DiskFull line naming what was being
written, and nothing half-written left that could pass for complete.

The disk is real: a 1 MiB tmpfs mounted in a private mount namespace (`unshare --user --map-root-user --mount`,
no root needed where unprivileged user namespaces are on), so the kernel answers ENOSPC as it would on a full
volume. Each case runs in a child process inside that namespace and prints what it saw and what is left."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SMALL = "1m"


def on_small_disk(tmp_path: Path, code: str) -> dict:
    """Run `code` (Python; `out` is the mounted dir, `report` a dict it fills) on a fresh SMALL tmpfs; what it
    reported, plus `left`: every path under `out` when it ended (relative)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1): cannot mount a small filesystem without root")
    out, result = tmp_path / "disk", tmp_path / "result.json"
    out.mkdir()
    script = (
        "import json, sys, traceback\nfrom pathlib import Path\nout, report = Path(sys.argv[1]), {}\n"
        f"try:\n{''.join('    ' + line + chr(10) for line in code.strip().splitlines())}"
        "except BaseException as e:\n    report['error'] = f'{type(e).__name__}: {e}'\n"
        "report['left'] = sorted(str(p.relative_to(out)) for p in out.rglob('*'))\n"
        "Path(sys.argv[2]).write_text(json.dumps(report))\n"
    )
    mount = f"mount -t tmpfs -o size={SMALL} tmpfs {out}"
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", mount], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.strip()}")
    done = subprocess.run(["unshare", "-rm", "sh", "-c", f'{mount} && exec "$0" -c "$1" "$2" "$3"', sys.executable,
                           script, str(out), str(result)], capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0 and result.is_file(), done.stderr[-3000:]
    return json.loads(result.read_text())


def test_a_rank_file_and_a_metrics_record_on_a_full_disk_are_one_diskfull_line_and_leave_no_temp_file(tmp_path):
    report = on_small_disk(
        tmp_path,
        """
import torch
from prime_rl.protocol import DiskFull, rank_file
from prime_rl.protocol.records import PackedRow, write_rank_file
from prime_rl.utils.metrics import MetricsWriter
metrics = MetricsWriter(out, "orchestrator")
try:
    write_rank_file(out, 0, 0, [PackedRow.padding(300_000, 1.0)])  # ~5 MB: more than the disk
except DiskFull as e:
    report["rank_file"] = str(e)
try:
    with open(out / "filler", "wb") as f:  # fill what is left
        f.write(b"x" * (2 << 20))
except OSError:
    pass
try:
    metrics.log(0, {"reward": 1.0, "text": "x" * 100_000})
except DiskFull as e:
    report["metrics"] = str(e)
""",
    )
    assert "error" not in report, report["error"]
    assert report["rank_file"] == (
        f"no space left on the device of {tmp_path}/disk/rollouts/step_0/rank_0.safetensors while writing it; "
        "free space there"
    )
    assert report["metrics"].startswith(f"no space left on the device of {tmp_path}/disk/metrics/orchestrator.jsonl")
    # No temporary file, no rank file: the trainer waits for one that never passes for complete.
    assert report["left"] == ["filler", "metrics", "metrics/orchestrator.jsonl", "rollouts", "rollouts/step_0"]


def test_a_background_checkpoint_on_a_full_disk_is_diskfull_and_leaves_no_trainer_dir(tmp_path, tiny_model):
    """It was `[enforce fail at inline_container.cc:672] unexpected pos ...` (torch's zip writer drops the
    errno), and checkpoints/step_1/trainer/ stayed half-written without STABLE."""
    code = f"""
import torch
from prime_rl.trainer.ckpt import AsyncCheckpointer, Progress, save_checkpoint
from prime_rl.trainer.model import build_model
from prime_rl.trainer.parallel import close_distributed, init_distributed
from prime_rl.trainer.weights import build_model_files
init_distributed("cpu")
model = build_model({str(tiny_model)!r})
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
sum((p.float() ** 2).sum() for p in model.parameters()).backward()
optimizer.step()  # AdamW moments: ~3x the weights, more than the disk
files = build_model_files({str(tiny_model)!r})
checkpointer = AsyncCheckpointer(0)
checkpointer.start(out, 1, model, optimizer, scheduler, Progress(step=1), files)
try:
    checkpointer.finish()
except BaseException as e:
    report["async"] = f"{{type(e).__name__}}: {{e}}"
try:
    save_checkpoint(out, 2, model, optimizer, scheduler, Progress(step=2), files, 0)
except BaseException as e:
    report["sync"] = f"{{type(e).__name__}}: {{e}}"
checkpointer.close()
close_distributed(clean=False)  # as the trainer leaves after an error
"""
    report = on_small_disk(tmp_path, code)
    assert "error" not in report, report["error"]
    for key, step in (("async", 1), ("sync", 2)):
        assert report[key] == (f"DiskFull: no space left on the device of {tmp_path}/disk/checkpoints/step_{step}/"
                               "trainer while writing it; free space there")  # fmt: skip
    assert report["left"] == ["checkpoints"]  # no step dir at all, let alone one without STABLE
