"""The three panes of docs/usage.md: inference, orchestrator and trainer started by hand, as separate commands
on the debug configs, twice in the same output dir."""

import json
import subprocess
import sys
import time

import pytest

from prime_rl.utils.metrics import read_metrics

pytestmark = pytest.mark.slow


def service(name: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", f"prime_rl.entrypoints.{name}", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def age_heartbeats(out, seconds: float) -> None:
    """As if the run that wrote them ended `seconds` ago (no sleep: the file's clock is what counts)."""
    for path in (out / "heartbeat").glob("*.json"):
        beat = json.loads(path.read_text())
        for key in ("started", "time", "progress"):
            beat[key] -= seconds
        path.write_text(json.dumps(beat))


def test_three_panes_run_again_in_a_used_output_dir_whose_heartbeats_are_old(tmp_path, free_port):
    """A new run in a dir whose last run ended long ago (heartbeats older than any heartbeat timeout) used to
    die at once on the previous run's trainer heartbeat; a beat from before a service started is not its
    peer's, and the run completes. The trainer is started last, seconds after the orchestrator waits."""
    out = tmp_path / "out"
    url = f"http://127.0.0.1:{free_port}/v1"
    server = service("inference", "@", "configs/debug/infer.toml", "--output-dir", str(out),
                     "--server.port", str(free_port))  # fmt: skip
    try:
        for attempt in range(2):
            orchestrator = service("orchestrator", "@", "configs/debug/orch.toml", "--output-dir", str(out),
                                   "--client.base-url", url, "--heartbeat-timeout", "5")  # fmt: skip
            time.sleep(8)  # the orchestrator's waits for the trainer have begun when the trainer starts
            trainer = service("trainer", "@", "configs/debug/train.toml", "--output-dir", str(out))
            for proc, name in ((orchestrator, "orchestrator"), (trainer, "trainer")):
                _, stderr = proc.communicate(timeout=300)
                assert proc.returncode == 0, f"run {attempt}, {name}:\n{stderr}"
            assert [m["step"] for m in read_metrics(out, "trainer")] == list(range(5))
            age_heartbeats(out, 1000)
    finally:
        for proc in (server, orchestrator, trainer):
            if proc.poll() is None:
                proc.kill()
