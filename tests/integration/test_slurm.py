"""`rl --slurm` on a real one-node Slurm cluster (the `slurm_cluster` fixture): the job script is submitted with
sbatch, its steps run under slurmd, and the job ends COMPLETED with the outputs `rl` writes. Both layouts (`rl`
on one node; the multi-node layout's srun steps on this node): `scancel --signal=USR1` (or TERM) mid-run ->
checkpoint -> the job requeues itself -> it resumes at the next step (every step once in the metrics); a service
killed in the job -> the job FAILED within seconds, naming it, and no process of the run is left."""

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
        [sys.executable, "-m", "prime_rl.entrypoints.rl", "@", "configs/debug/rl.toml", "--output-dir", str(out),
         *flags],
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


def multi_node_on_one() -> list[str]:
    """The multi-node layout's flags for this one node (a fresh rendezvous port each time)."""
    from prime_rl.utils.net import free_port

    return ["--slurm.nodes", "1", "--slurm.inference-nodes", "1", "--slurm.trainer-nodes", "1",
            "--slurm.rdzv-port", str(free_port())]  # fmt: skip


def job_fields(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def wait_for(what: str, ready, timeout: float, out: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := ready():
            return value
        time.sleep(0.2)
    raise TimeoutError(f"no {what} after {timeout:.0f}s\n{show_logs(out)}")


# USR1: what `--signal=USR1@N` sends before the time limit; TERM: what preemption sends to the tasks of every step.
@pytest.mark.parametrize(("layout", "sig"), [("rl", "USR1"), ("multi-node", "TERM")])
def test_rl_runs_as_a_slurm_job_and_a_stop_signal_requeues_it_to_resume_with_every_step_once(
    slurm_cluster, tmp_path, free_port, layout, sig
):
    """The debug config as a job, `rl` on one node or the multi-node layout's three srun steps (torchrun's
    rendezvous from the node list); mid-run stop signal -> checkpoint -> requeue -> resume -> COMPLETED."""
    out, steps, host = tmp_path / "out", 12, socket.gethostname().split(".")[0]
    flags = multi_node_on_one() if layout == "multi-node" else ["--slurm.time", "00:10:00"]
    job_id = submit(out, "--inference.server.port", str(free_port), "--max-steps", str(steps), "--ckpt",
                    "--slurm.requeue", *flags)  # fmt: skip
    assert "#SBATCH --signal=USR1@300" in (out / "run/slurm/job.sbatch").read_text()
    wait_for("3 trainer steps", lambda: len(read_metrics(out, "trainer")) >= 3, 240, out)
    subprocess.run(["scancel", f"--signal={sig}", job_id], check=True)
    wait_for("requeue", lambda: job_fields(job_id).get("Restarts") == "1", 120, out)
    # Slurm makes a requeued job wait ~2 min before it may start again; the test does not wait for that.
    wait_for("pending requeued job", lambda: job_fields(job_id).get("JobState") == "PENDING", 60, out)
    # slurmd refuses a job credential issued in the same second its earlier one was revoked (the requeue):
    # starting it again at once fails the job ("Job credential revoked"), which the 2-minute hold prevents.
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
    job = wait_for_job(job_id, 300)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0" and job["Restarts"] == "1", show_logs(out)

    batch = (out / "logs" / f"slurm-{job_id}.log").read_text()
    assert f"requeued job {job_id}" in batch and "resuming from the newest checkpoint" in batch, batch
    trainer = (out / "logs" / ("trainer.log" if layout == "rl" else f"trainer-{host}.log")).read_text()
    stopped = int(re.search(rf"stopped on SIG{sig} after (\d+) step\(s\): checkpoint checkpoints/step_\1", trainer)[1])
    assert 3 <= stopped < steps and f"resumed from checkpoints/step_{stopped} " in trainer
    assert f"stopped on SIG{sig} during step" in (out / "logs" / "orchestrator.log").read_text()
    print(f"{layout}, SIG{sig}: stopped after {stopped} trainer steps, requeued, resumed there; 0..{steps - 1} once")
    # Every step once, in order: the steps after the checkpoint were trained (and their rollouts made) once more
    # on resume and their earlier records replaced.
    assert [r["step"] for r in read_metrics(out, "trainer")] == list(range(steps))
    assert [r["step"] for r in read_metrics(out, "orchestrator")] == list(range(steps))
    assert (out / "weights" / f"step_{steps}" / "STABLE").exists()
    # The outputs `rl` writes, logs per service (and per node).
    logs = {p.name for p in (out / "logs").glob("*.log")}
    if layout == "rl":
        assert {f"slurm-{job_id}.log", "rl.log", "inference.log", "orchestrator.log", "trainer.log"} <= logs
        assert (out / "run" / "rl.toml").exists()
    else:
        assert {f"slurm-{job_id}.log", f"inference-{host}.log", f"trainer-{host}.log", "orchestrator.log"} <= logs
        assert "step trainer done" in batch and "step orchestrator done" in batch
        # The server required the job's key, which lived in the job's environment only: never in a recorded config.
        assert 'api_key_var = "INFERENCE_SERVER_API_KEY"' in (out / "run" / "inference.toml").read_text()
        assert not any("api_key =" in p.read_text() for p in (out / "run").rglob("*.toml"))


@pytest.mark.parametrize("layout", ["rl", "multi-node"])
def test_a_killed_service_fails_the_job_naming_it_and_leaves_no_process(slurm_cluster, tmp_path, free_port, layout):
    import json
    import os
    import signal

    out = tmp_path / "out"
    job_id = submit(out, "--inference.server.port", str(free_port), "--max-steps", "200", "--slurm",
                    *(multi_node_on_one() if layout == "multi-node" else []))  # fmt: skip
    wait_for("a trainer step", lambda: read_metrics(out, "trainer"), 240, out)
    pid = json.loads((out / "heartbeat" / "orchestrator.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    job = wait_for_job(job_id, 60)
    took = time.monotonic() - killed
    assert job["JobState"] == "FAILED", show_logs(out)
    assert took < 30, f"the job took {took:.0f}s to end"  # heartbeat timeouts are 60 s: we must not rely on them
    named = "orchestrator failed (exit -9)" if layout == "rl" else "step orchestrator failed (exit 137)"
    assert named in (out / "logs" / f"slurm-{job_id}.log").read_text()

    def survivors() -> list[str]:
        ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout.splitlines()
        return [line for line in ps if str(out) in line]

    deadline = time.monotonic() + 15
    while survivors() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not survivors()
    print(f"{layout}: job {job_id} FAILED {took:.1f}s after the orchestrator was killed, naming it; no process left")


def test_sft_on_slurm_stops_on_the_signal_and_the_requeued_job_resumes(slurm_cluster, tmp_path):
    """`sft --slurm`: torchrun over the job's node list; USR1 -> both the checkpoint and run/sft.stopped -> the
    script ends the run as stopped (torchrun itself exits 0) and requeues; the job resumes and completes."""
    from prime_rl.utils.net import free_port

    out, steps, host = tmp_path / "out", 200, socket.gethostname().split(".")[0]  # steps take ~30 ms here
    result = subprocess.run(
        [sys.executable, "-m", "prime_rl.entrypoints.sft", "@", "configs/sft/debug.toml", "--output-dir", str(out),
         "--max-steps", str(steps), "--ckpt", "--slurm.requeue", "--slurm.rdzv-port", str(free_port())],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    job_id = re.search(r"submitted job (\d+)", result.stdout).group(1)
    wait_for("2 sft steps", lambda: len(read_metrics(out, "sft")) >= 2, 240, out)
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True)
    wait_for("requeue", lambda: job_fields(job_id).get("Restarts") == "1", 120, out)
    wait_for("pending requeued job", lambda: job_fields(job_id).get("JobState") == "PENDING", 60, out)
    time.sleep(2)  # see the test above
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
    job = wait_for_job(job_id, 300)
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", show_logs(out)
    log = (out / "logs" / f"sft-{host}.log").read_text()
    stopped = int(re.search(r"stopped on SIGUSR1 after (\d+) step\(s\)", log)[1])
    assert f"resumed from checkpoints/step_{stopped} " in log
    assert f"requeued job {job_id}" in (out / "logs" / f"slurm-{job_id}.log").read_text()
    assert [r["step"] for r in read_metrics(out, "sft")] == list(range(steps))
    print(f"sft: stopped after {stopped} steps, requeued, resumed at step {stopped}; 0..{steps - 1} once")
