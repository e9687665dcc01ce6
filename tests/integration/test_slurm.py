"""`rl --slurm` on a real one-node Slurm cluster (the `slurm_cluster` fixture): the job script is submitted with
sbatch, its steps run under slurmd, and the job ends COMPLETED with the outputs `rl` writes."""

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prime_rl.utils.metrics import read_metrics

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]


def submit(out: Path, *flags: str) -> str:
    """`rl @ configs/debug/rl.toml --slurm ...` from the repo root; the job id it printed."""
    result = subprocess.run(
        [sys.executable, "-m", "prime_rl.rl", "@", "configs/debug/rl.toml", "--output-dir", str(out), *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return re.search(r"submitted job (\d+)", result.stdout).group(1)


def wait_for_job(job_id: str, timeout: float) -> dict[str, str]:
    """`scontrol show job` fields once the job has ended (no accounting database here: no sacct)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        if fields.get("JobState") not in (None, "PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return fields
        time.sleep(2)
    subprocess.run(["scancel", job_id])
    raise TimeoutError(f"job {job_id} still running after {timeout:.0f}s")


def show_logs(out: Path) -> str:
    return "\n".join(f"===== {p.name}\n{p.read_text()[-3000:]}" for p in sorted((out / "logs").glob("*.log")))


def assert_five_steps(out: Path) -> None:
    assert [r["step"] for r in read_metrics(out, "trainer")] == [0, 1, 2, 3, 4]
    assert len(read_metrics(out, "orchestrator")) == 5
    assert (out / "weights" / "step_5" / "STABLE").exists()


def test_rl_on_one_node_runs_to_completion_as_a_slurm_job(slurm_cluster, tmp_path, free_port):
    out = tmp_path / "out"
    job_id = submit(out, "--inference.server.port", str(free_port), "--slurm.time", "00:10:00")
    job = wait_for_job(job_id, 300)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", show_logs(out)
    assert_five_steps(out)
    logs = {p.name for p in (out / "logs").glob("*.log")}
    assert {f"slurm-{job_id}.log", "rl.log", "inference.log", "orchestrator.log", "trainer.log"} <= logs
    assert (out / "run" / "slurm" / "job.sbatch").exists() and (out / "run" / "rl.toml").exists()


def test_the_multi_node_layout_runs_on_one_node_with_its_own_srun_steps(slurm_cluster, tmp_path, free_port):
    from prime_rl.utils.net import free_port as another_free_port

    out, host = tmp_path / "out", socket.gethostname().split(".")[0]
    job_id = submit(out, "--inference.server.port", str(free_port), "--slurm.nodes", "1",
                    "--slurm.inference-nodes", "1", "--slurm.trainer-nodes", "1",
                    "--slurm.rdzv-port", str(another_free_port()))  # fmt: skip
    job = wait_for_job(job_id, 300)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", show_logs(out)
    assert_five_steps(out)
    batch_log = (out / "logs" / f"slurm-{job_id}.log").read_text()
    assert "step trainer done" in batch_log and "step orchestrator done" in batch_log
    for name in (f"inference-{host}.log", f"trainer-{host}.log", "orchestrator.log"):
        assert (out / "logs" / name).stat().st_size > 0, name
    # The server required the job's key, which lived in the job's environment only: never in a recorded config.
    assert 'api_key_var = "INFERENCE_SERVER_API_KEY"' in (out / "run" / "inference.toml").read_text()
    assert not any("api_key =" in p.read_text() for p in (out / "run").rglob("*.toml"))
