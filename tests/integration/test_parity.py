"""The parity gate in a real `rl` run (docs/orchestrator.md): a server that serves other weights than the trainer
exported, or computes the trainer's weights otherwise, stops the run with one line naming it."""

import re
import shutil
import subprocess
import sys
import time

import httpx
import pytest

from prime_rl.protocol import weights_dir
from prime_rl.utils.metrics import read_metrics

pytestmark = pytest.mark.slow


def rl_args(model, out, port: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "prime_rl.entrypoints.rl", "--model.name", str(model), "--output-dir", str(out),
        "--inference.server.port", str(port), "--orchestrator.batch-size", "8",
        "--orchestrator.rollouts-per-example", "4", "--orchestrator.seq-len", "128",
        "--orchestrator.sampling.max-tokens", "8", *extra,
    ]  # fmt: skip


def orchestrator_error(out) -> str:
    log = (out / "logs" / "orchestrator.log").read_text()
    return next((line for line in log.splitlines() if " ERROR " in line), log[-3000:])


def test_a_server_given_other_weights_behind_the_runs_back_stops_it_within_a_step(tiny_model, tmp_path, free_port):
    """Right after the run updated the server to step n, it loads weights/step_{n-1}'s tensors from a dir named
    step_n (POST /update_weights straight to it, applied once the step's requests in flight are done): it says
    it serves step n, and its checksum says otherwise. Should the run's own next update replace the fault before
    the gate looked, the fault is given again at the new step: the run must end on one of them."""
    out = tmp_path / "out"
    extra = ["--max-steps", "500", "--async-level", "1", "--trainer.keep-weights", "50"]
    extra += ["--orchestrator.batch-size", "16", "--orchestrator.sampling.max-tokens", "32"]  # generation takes a while
    console = open(tmp_path / "rl.console", "w")  # noqa: SIM115 (closed below; a pipe nobody reads would block rl)
    proc = subprocess.Popen(rl_args(tiny_model, out, free_port, *extra), stdout=console, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{free_port}"

    def served_step() -> int | None:
        try:
            return httpx.get(f"{url}/health", timeout=5).json()["step"]
        except httpx.TransportError:
            return None

    faults = {}  # step -> the checksum the faulted server reported
    try:
        deadline = time.monotonic() + 300  # the start (three services) on a busy 2-core machine
        first = step = None
        while first is None or step == first:  # until the run has just given it a new step (from 3 on)
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "rl.console").read_text()[-3000:]
            time.sleep(0.02)
            step = served_step()
            first = step if first is None and step is not None and step >= 2 else first
        faulted = time.monotonic()
        while proc.poll() is None and time.monotonic() < faulted + 120:
            if step is not None and step not in faults:
                fault = tmp_path / "fault" / f"step_{step}"
                shutil.copytree(weights_dir(out, step - 1), fault)
                answer = httpx.post(f"{url}/update_weights", json={"weight_dir": str(fault)}, timeout=60)
                if answer.status_code == 200:
                    faults[step] = answer.json()["checksum"]
            time.sleep(0.1)
            step = served_step()
        seconds = time.monotonic() - faulted
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
        console.close()
    assert proc.returncode != 0, f"the run went on past the faults at steps {sorted(faults)}"
    line = orchestrator_error(out)
    print(f"\n{seconds:.1f} s from the fault to the end of the run ({len(faults)} given): {line}")
    struck = re.search(rf"checksum: server {url}/v1 at weight step (\d+): loaded ([0-9a-f]+), the trainer ", line)
    assert struck and faults.get(int(struck[1])) == struck[2], (line, faults)
    assert re.search(r"exported [0-9a-f]{16} \(.*checksum.json\)", line), line
    assert len(read_metrics(out, "orchestrator")) <= int(struck[1]) + 2  # the step it struck in, or the next


def test_a_server_computing_in_another_dtype_fails_the_canaries(tiny_model, tmp_path, free_port):
    """bfloat16 serving of float32 weights: checksums agree (the same weights arrive), the canaries' KL does not
    (7.2e-7 on this tiny model's near-uniform distributions, against ~5e-14 in float32: the bound is set between)."""
    out = tmp_path / "bf16"
    extra = ["--max-steps", "3", "--inference.engine.dtype", "bfloat16", "--parity.max-kl", "1e-7"]
    result = subprocess.run(rl_args(tiny_model, out, free_port, *extra), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and (out / "logs" / "orchestrator.log").is_file(), result.stderr[-3000:]
    line = orchestrator_error(out)
    print(f"\n{line}")
    assert re.search(
        rf"parity: server http://127.0.0.1:{free_port}/v1 at weight step 0: mismatch KL \S+ > 1e-07 ", line
    )
    assert "it does not compute the trainer's policy" in line


# A fault in the decode path only (a test fault injection, docs/orchestrator.md): the built-in engine's native
# decoder scales attention scores ×3 in decode steps while the trigger file exists; its prefill (the path the
# canaries and prompt scoring take) is untouched. Installed in the inference process alone, as a sitecustomize on
# its PYTHONPATH (`--inference.env-vars.PYTHONPATH`), so the server runs the shipped code with one method wrapped.
DECODE_FAULT = """
import os
from pathlib import Path

trigger = os.environ.get("RL_TEST_DECODE_FAULT")
if trigger:
    from prime_rl.inference.engine import native

    decode = native.NativeDecoder.decode

    def decode_with_fault(self, tokens):
        if not Path(trigger).exists():
            return decode(self, tokens)
        scaling = [layer.scaling for layer in self.layers]
        for layer in self.layers:
            layer.scaling *= 3
        try:
            return decode(self, tokens)
        finally:
            for layer, s in zip(self.layers, scaling):
                layer.scaling = s

    native.NativeDecoder.decode = decode_with_fault
"""


def decode_fault_args(tmp_path) -> tuple[list[str], object]:
    """rl flags that install DECODE_FAULT in the inference server; the trigger file (absent: no fault yet)."""
    fault = tmp_path / "fault"
    fault.mkdir()
    (fault / "sitecustomize.py").write_text(DECODE_FAULT)
    trigger = tmp_path / "fault_on"
    flags = ["--inference.env-vars.PYTHONPATH", str(fault), "--inference.env-vars.RL_TEST_DECODE_FAULT", str(trigger)]
    return flags, trigger


def test_a_server_whose_decode_path_samples_another_policy_is_stopped_within_a_gate_interval(
    tiny_model, tmp_path, free_port
):
    """The fault is switched on once the run serves weight step 3 (parity interval 2: gate steps 0, 2, 4, ...). The
    canaries still agree (prefill); the next gate step samples on-policy, the trainer's k3 of those tokens is the
    decode path's mismatch, and the run stops on it, naming the server, within one gate interval (+ the steps the
    trainer's report takes to arrive)."""
    out, interval = tmp_path / "out", 2
    flags, trigger = decode_fault_args(tmp_path)
    extra = ["--max-steps", "30", "--parity.interval", str(interval), "--parity.max-kl", "1e-3", *flags]
    console = open(tmp_path / "rl.console", "w")  # noqa: SIM115 (closed below; a pipe nobody reads would block rl)
    proc = subprocess.Popen(rl_args(tiny_model, out, free_port, *extra), stdout=console, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300  # the start (three services) on a busy 2-core machine
        onset = None
        while onset is None:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "rl.console").read_text()[-3000:]
            time.sleep(0.05)
            try:
                step = httpx.get(f"http://127.0.0.1:{free_port}/health", timeout=5).json()["step"]
            except httpx.TransportError:
                continue
            if step >= 3:
                trigger.touch()
                onset = step
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
        console.close()
    assert proc.returncode != 0, "the run went on past the decode fault"
    line = orchestrator_error(out)
    steps = read_metrics(out, "orchestrator")
    print(f"\nfault from weight step {onset}; {len(steps)} orchestrator steps recorded: {line}")
    struck = re.search(
        rf"parity: server http://127.0.0.1:{free_port}/v1 at weight step (\d+): sampled-token mismatch KL (\S+) > "
        r"0.001 .*it samples another policy than the trainer's",
        line,
    )
    assert struck, line
    gate = int(struck[1])
    assert onset <= gate <= onset + interval  # the first gate step after the fault
    assert len(steps) <= gate + 2  # stopped at the end of the gate step's next step, or the one after
    canary = [m for m in steps if "parity_kl/127.0.0.1:" + str(free_port) in m]
    assert canary and all(m[f"parity_kl/127.0.0.1:{free_port}"] < 1e-9 for m in canary)  # prefill: blind to it


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_clean_runs_pass_the_sampled_token_gate_at_every_step(tiny_model, tmp_path, free_port, seed):
    """Every step a gate step (interval 1: every step on-policy and judged) with the default `max_kl`: an honest
    server is never stopped; the sampled-token KL it measures is the fp32 engine-vs-trainer noise (~1e-13 here)."""
    out = tmp_path / "out"
    extra = ["--max-steps", "4", "--parity.interval", "1", "--orchestrator.seed", str(seed)]
    extra += ["--orchestrator.sampling.seed", str(seed)]
    result = subprocess.run(rl_args(tiny_model, out, free_port, *extra), capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, orchestrator_error(out) if (out / "logs").is_dir() else result.stderr[-3000:]
    log = (out / "logs" / "orchestrator.log").read_text()
    line = rf"parity of the sampled tokens of step (\d+): parity_sampled_kl/127.0.0.1:{free_port} (\S+),"
    found = re.findall(line, log)
    judged = {int(step): float(kl) for step, kl in found}
    print(f"\nseed {seed}: sampled-token KL per on-policy step {judged}")
    assert sorted(judged) == [0, 1, 2, 3] and max(judged.values()) < 1e-9
