"""The three panes of docs/usage.md: inference, orchestrator and trainer started by hand, as separate commands
on the debug configs, twice in the same output dir; and with only `export OUTPUT_DIR` (the multi-node recipe)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prime_rl.utils.metrics import read_metrics

pytestmark = pytest.mark.slow


ROOT = Path(__file__).parents[2]


def service(name: str, *args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", f"prime_rl.entrypoints.{name}", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env,
    )  # fmt: skip


def age_heartbeats(out, seconds: float) -> None:
    """As if the run that wrote them ended `seconds` ago (no sleep: the file's clock is what counts)."""
    for path in (out / "heartbeat").glob("*.json"):
        beat = json.loads(path.read_text())
        for key in ("started", "time", "progress"):
            beat[key] -= seconds
        path.write_text(json.dumps(beat))


def waiting_for_the_trainer(log: Path, since: int, proc: subprocess.Popen) -> None:
    """Until the orchestrator's log says, after byte `since`, that a step waits for the trainer's weights."""
    deadline = time.monotonic() + 120
    while "waiting for the trainer" not in (log.read_text()[since:] if log.is_file() else ""):
        assert proc.poll() is None, f"the orchestrator ended (exit {proc.returncode}):\n{proc.stderr.read()}"
        assert time.monotonic() < deadline, "the orchestrator never waited for the trainer"
        time.sleep(0.2)


def test_three_panes_run_again_in_a_used_output_dir_whose_heartbeats_are_old(tmp_path, free_port):
    """A new run in a dir whose last run ended long ago (heartbeats older than any heartbeat timeout) used to
    die at once on the previous run's trainer heartbeat; a beat from before a service started is not its
    peer's, and the run completes. The trainer is started last, once the orchestrator waits for it. The server
    runs on from the first run, holding its last weights: the second run samples from its base model again
    (it used to sample the first run's step 3 for its steps 0-4, at mismatch KL 0.001-0.005)."""
    out = tmp_path / "out"
    url = f"http://127.0.0.1:{free_port}/v1"
    log = out / "logs" / "orchestrator.log"
    server = service("inference", "@", "configs/debug/infer.toml", "--output-dir", str(out),
                     "--server.port", str(free_port))  # fmt: skip
    try:
        for attempt in range(2):
            since = log.stat().st_size if log.is_file() else 0
            orchestrator = service("orchestrator", "@", "configs/debug/orch.toml", "--output-dir", str(out),
                                   "--client.base-url", url, "--heartbeat-timeout", "5")  # fmt: skip
            waiting_for_the_trainer(log, since, orchestrator)
            trainer = service("trainer", "@", "configs/debug/train.toml", "--output-dir", str(out))
            for proc, name in ((orchestrator, "orchestrator"), (trainer, "trainer")):
                _, stderr = proc.communicate(timeout=300)
                assert proc.returncode == 0, f"run {attempt}, {name}:\n{stderr}"
                if name == "orchestrator":
                    assert ("servers hold an earlier run's weights" in stderr) == (attempt == 1), stderr
            trainer_steps, orch = read_metrics(out, "trainer"), read_metrics(out, "orchestrator")
            assert [m["step"] for m in trainer_steps] == list(range(5))
            assert orch[0]["weight_step"] == 0 and all(m["off_policy_gap"] >= 0 for m in orch), orch
            assert all(m["mismatch_kl"] < 1e-3 for m in trainer_steps), trainer_steps
            age_heartbeats(out, 1000)
    finally:
        for proc in (server, orchestrator, trainer):
            if proc.poll() is None:
                proc.kill()


def test_three_panes_with_only_output_dir_exported_write_there(tmp_path, free_port):
    """README's pane commands (`uv run inference @ configs/debug/infer.toml`, orchestrator, trainer) with
    `export OUTPUT_DIR=...` as the only say on where: every configs/debug/*.toml sets output_dir = "outputs/debug",
    which used to win without a word, so each node wrote its own outputs/debug. Run from a scratch dir that links
    configs/ and assets/: all three write to $OUTPUT_DIR, none to ./outputs, and each says its file was overruled.
    The port flags only keep clear of a server on :8000; --max-steps 2 keeps it short."""
    for name in ("configs", "assets"):
        (tmp_path / name).symlink_to(ROOT / name)
    shared = tmp_path / "shared"
    env = {**os.environ, "OUTPUT_DIR": str(shared)}
    url = f"http://127.0.0.1:{free_port}/v1"
    server = service("inference", "@", "configs/debug/infer.toml", "--server.port", str(free_port), cwd=tmp_path,
                     env=env)  # fmt: skip
    orchestrator = service("orchestrator", "@", "configs/debug/orch.toml", "--client.base-url", url, "--max-steps", "2",
                           cwd=tmp_path, env=env)  # fmt: skip
    trainer = service("trainer", "@", "configs/debug/train.toml", "--max-steps", "2", cwd=tmp_path, env=env)
    try:
        for proc, name in ((orchestrator, "orchestrator"), (trainer, "trainer")):
            _, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"{name}:\n{stderr}"
            assert f"{name}: output_dir: $OUTPUT_DIR ({shared}) over configs/debug/" in stderr, stderr
        assert (shared / "weights" / "step_2" / "STABLE").is_file()
        assert [m["step"] for m in read_metrics(shared, "trainer")] == [0, 1]
        assert {p.name for p in (shared / "logs").glob("*.log")} >= {"inference.log", "orchestrator.log", "trainer.log"}
        assert not (tmp_path / "outputs").exists(), sorted(str(p) for p in (tmp_path / "outputs").rglob("*"))
    finally:
        for proc in (server, orchestrator, trainer):
            if proc.poll() is None:
                proc.kill()
