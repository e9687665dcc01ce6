"""A server that dies in the middle of a weight broadcast (docs/design.md §5): the trainer gives the group up and
sends the step again to the servers left, the orchestrator takes the dead one out, and the run goes on. Real
processes on loopback: two built-in servers, a trainer, an orchestrator (not `rl`, which ends the run when a
service dies), gloo as on every CPU machine (the nccl side of this is tests/unit/protocol/test_broadcast_*)."""

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import httpx
import pytest
import torch.distributed as dist

from prime_rl.utils.metrics import read_metrics
from prime_rl.utils.net import free_port

pytestmark = pytest.mark.slow


def _read(path) -> str:
    return path.read_text() if path.is_file() else ""


def logs(out) -> str:
    return "\n".join(f"===== {p.name}\n{p.read_text()[-4000:]}" for p in sorted((out / "logs").glob("*.log")))


def test_a_server_killed_mid_broadcast_is_dropped_and_the_trainer_and_the_other_server_go_on(
    inference_process, tiny_model, tmp_path
):
    out, port = tmp_path / "out", free_port()
    a, b = (inference_process("builtin", tiny_model, tmp_path / n, "--weight-transfer", "broadcast") for n in "ab")
    transfer = [
        "--weight-transfer",
        "broadcast",
        "--weight-transfer.port",
        str(port),
        "--weight-transfer.timeout",
        "20",
    ]
    py = [sys.executable, "-m"]
    trainer = subprocess.Popen([*py, "prime_rl.entrypoints.trainer", "--model.name", str(tiny_model),
                                "--output-dir", str(out), "--max-steps", "3", "--optim.lr", "1e-3", *transfer],
                               stdout=subprocess.DEVNULL, stderr=open(tmp_path / "err", "a"))  # fmt: skip  # noqa: SIM115
    procs = [trainer]
    try:
        a.wait_ready()
        b.wait_ready()
        orchestrator = subprocess.Popen([*py, "prime_rl.entrypoints.orchestrator", "--model.name", str(tiny_model),
                                         "--output-dir", str(out), "--client.base-url", f"{a.url}/v1,{b.url}/v1",
                                         "--max-steps", "3", "--async-level", "0", "--batch-size", "8",
                                         "--rollouts-per-example", "4", "--seq-len", "128",
                                         "--sampling.max-tokens", "8", *transfer],
                                        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "err", "a"))  # fmt: skip  # noqa: SIM115
        procs.append(orchestrator)
        # Step 1's transfer: once b (seat 2) is in the group's rendezvous, which the trainer joins only after both
        # servers asked, it is frozen while the group forms, with the trainer and a waiting on it; then killed -9.
        deadline = time.monotonic() + 240
        while "hosting the rendezvous" not in _read(out / "logs" / "trainer.log"):
            assert time.monotonic() < deadline and trainer.poll() is None, logs(out)
            time.sleep(0.1)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30))
        b_joining = store.get("group").decode() + ".0/pg/0/2"  # gloo's rendezvous key of rank 2 (b's seat)
        while not store.check([b_joining]):
            assert time.monotonic() < deadline and trainer.poll() is None and orchestrator.poll() is None, logs(out)
            time.sleep(0.0005)
        victim = b.service.proc.pid
        os.kill(victim, signal.SIGSTOP)
        time.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        for proc in (trainer, orchestrator):
            proc.wait(timeout=180)
        took = time.monotonic() - killed
        assert trainer.returncode == 0 and orchestrator.returncode == 0, logs(out)
        trainer_log = (out / "logs" / "trainer.log").read_text()
        orchestrator_log = (out / "logs" / "orchestrator.log").read_text()
        print(f"\nb killed mid-broadcast of step 1 -> run finished {took:.1f}s later")
        failed = next(line for line in trainer_log.splitlines() if "weight broadcast of step 1 failed" in line)
        print(failed)
        assert "sending it again in group" in failed
        assert f"inference server {b.url}/v1 is down, taking it out of the pool" in orchestrator_log
        assert [m["step"] for m in read_metrics(out, "trainer")] == [0, 1, 2]
        assert [m["weight_step"] for m in read_metrics(out, "orchestrator")] == [0, 1, 2]  # a served each step
        assert httpx.get(f"{a.url}/health", timeout=5).json()["step"] == 2
        # A peer lost after the mesh formed is noticed at once (3 s here); one lost while it forms costs the 20 s
        # timeout + 5 s (gloo's own connect retries ran to 104 s and past 180 s: protocol/broadcast.py bounds the
        # join on the host), then step 1 again and two more steps.
        assert took < 90
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        a.stop()
        b.stop()
