"""A fleet that changes while the run goes on (docs/orchestrator.md, "Adding and removing servers"): a server added
to `run/servers.json` mid-run takes requests and the weight broadcasts; a server killed and restarted rejoins the
broadcast and serves the next steps; every step is trained once, each on the policy of its own step. Real
processes on loopback: built-in servers, a trainer and an orchestrator (not `rl`, which ends the run when a
service dies unless --restart), gloo as on every CPU machine, the broadcast's default 600 s timeout (a seat change
must never wait it out)."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from prime_rl.orchestrator.servers.prometheus import parse_metrics
from prime_rl.protocol import servers_file
from prime_rl.utils.metrics import read_metrics
from prime_rl.utils.net import free_port

pytestmark = pytest.mark.slow

STEPS = 8


def logs(out) -> str:
    return "\n".join(f"===== {p.name}\n{p.read_text()[-5000:]}" for p in sorted((out / "logs").glob("*.log")))


def generated(server) -> float:
    """Tokens a built-in server generated since it started (its /metrics)."""
    return parse_metrics(httpx.get(f"{server.url}/metrics", timeout=5).text).get("generated_tokens", 0.0)


def test_a_server_added_mid_run_and_one_restarted_both_serve_and_every_step_trains_once(
    inference_process, tiny_model, tmp_path
):
    out, port = tmp_path / "out", free_port()
    args = ("--weight-transfer", "broadcast")
    a, b = (inference_process("builtin", tiny_model, tmp_path / n, *args) for n in "ab")
    transfer = [*args, "--weight-transfer.port", str(port)]
    py = [sys.executable, "-m"]
    err = open(tmp_path / "err", "a")  # noqa: SIM115
    trainer = subprocess.Popen([*py, "prime_rl.entrypoints.trainer", "--model.name", str(tiny_model),
                                "--output-dir", str(out), "--max-steps", str(STEPS), "--optim.lr", "1e-3",
                                *transfer], stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
    procs, restarted = [trainer], None
    try:
        a.wait_ready()
        b.wait_ready()
        orchestrator = subprocess.Popen([*py, "prime_rl.entrypoints.orchestrator", "--model.name", str(tiny_model),
                                         "--output-dir", str(out), "--client.base-url", f"{a.url}/v1",
                                         "--max-steps", str(STEPS), "--async-level", "0", "--batch-size", "8",
                                         "--rollouts-per-example", "4", "--seq-len", "128",
                                         "--sampling.max-tokens", "8", *transfer],
                                        stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
        procs.append(orchestrator)

        def wait(what, done, seconds=240):
            deadline = time.monotonic() + seconds
            while not done():
                assert time.monotonic() < deadline, f"timed out waiting for {what}\n{logs(out)}"
                assert trainer.poll() is None and orchestrator.poll() is None, logs(out)
                time.sleep(0.2)

        # The orchestrator wrote its fleet at the start; after step 1 the operator adds b (a new file, renamed over).
        wait("orchestrator step 1", lambda: len(read_metrics(out, "orchestrator")) >= 2)
        fleet = json.loads(servers_file(out).read_text())
        assert fleet["base_url"] == [f"{a.url}/v1"]
        fleet["base_url"].append(f"{b.url}/v1")
        servers_file(out).with_suffix(".tmp").write_text(json.dumps(fleet))
        servers_file(out).with_suffix(".tmp").rename(servers_file(out))
        added = len(read_metrics(out, "orchestrator"))
        wait("b to generate", lambda: generated(b) > 0)

        # Then a dies (kill -9) and comes back on its port with its base weights. The orchestrator is held
        # (SIGSTOP) while a restarts, as if a came back within the step: a run of tiny steps would end first.
        os.kill(a.service.proc.pid, signal.SIGKILL)
        os.kill(orchestrator.pid, signal.SIGSTOP)
        a.service.proc.wait()
        killed = len(read_metrics(out, "orchestrator"))
        restarted = inference_process("builtin", tiny_model, tmp_path / "a2", *args, port=int(a.url.rsplit(":", 1)[1]))
        try:
            restarted.wait_ready()
        finally:
            os.kill(orchestrator.pid, signal.SIGCONT)
        back = time.monotonic()
        for proc in (trainer, orchestrator):
            proc.wait(timeout=240)
        took = time.monotonic() - back
        assert trainer.returncode == 0 and orchestrator.returncode == 0, logs(out)

        trainer_log, orchestrator_log = (
            (out / "logs" / "trainer.log").read_text(),
            (out / "logs" / "orchestrator.log").read_text(),
        )
        print(f"\nb added after step {added - 1}, a killed after step {killed - 1}; end {took:.1f}s after a is back")
        assert [m["step"] for m in read_metrics(out, "trainer")] == list(range(STEPS))
        assert [m["weight_step"] for m in read_metrics(out, "orchestrator")] == list(range(STEPS))  # on policy
        assert f"inference servers added: ['{b.url}/v1']" in orchestrator_log
        # A seat change is a new group, not a failed try (a broadcast that a's death hit is one, sent again at
        # once); the restarted a took the broadcasts and served.
        assert "seating them in group" in trainer_log and "times" not in trainer_log, trainer_log[-3000:]
        print("\n".join(line for line in trainer_log.splitlines() if "seating" in line or "failed" in line))
        health = {s.url: httpx.get(f"{s.url}/health", timeout=5).json() for s in (restarted, b)}
        assert {h["step"] for h in health.values()} == {STEPS - 1}, health
        assert len({h["weight_group"] for h in health.values()}) == 1, health
        assert generated(restarted) > 0
        assert took < 120  # no seat change waited out the broadcast's 600 s timeout
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for server in (a, b, restarted):
            if server is not None:
                server.stop()
