"""On a CUDA device: a weight-group collective that never completes (its NCCL kernel waits behind a 30 s spin on
the stream, as it would behind a dead peer) is a BroadcastTimeout on the host soon after the transfer timeout, and
the process outlives the group's NCCL watchdog; with torch's defaults (the code before) `work.wait()` returns at
once and the watchdog ends the process. NCCL refuses two ranks on one GPU, so the group has one rank: the stall is
made on the stream rather than by a peer. Its abort cannot end the spin kernel and waits for it (seen on an H200,
torch 2.11 + NCCL 2.28.9: the abort took 27 s, so the error came when the spin ended, 10.1 s for a 10 s spin, 30.3 s
for 30 s); `abandon` waits for an abort at most ABORT_GRACE seconds. torch's defaults: exit 134, SIGABRT from the
watchdog.)

Also a script, for a GPU machine without this repo's environment: `PYTHONPATH=src python3 <this file>`."""

import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.gpu

PROBE = """
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from prime_rl.protocol.broadcast import BroadcastTimeout, Rendezvous, join_group
from prime_rl.protocol.weight_stream import wait_for_work
mode, port = sys.argv[1], int(sys.argv[2])
torch.cuda.set_device(0)
store = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
if mode == "ours":
    pg = join_group(store, Rendezvous("127.0.0.1", port, "g", 1, "nccl", 3.0), 0)
else:  # the group as it was made before: torch's default error handling
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=3)
    pg = dist.ProcessGroupNCCL(dist.PrefixStore("g/pg", store), 0, 1, options)
tensor = torch.ones(4, device="cuda")
pg.broadcast(tensor, 0).wait()  # the communicator works
torch.cuda.synchronize()
print("formed", flush=True)
torch.cuda._sleep(6 * 10**10)  # ~30 s of cycles at 2 GHz
start = time.monotonic()
work = pg.broadcast(tensor, 0)
if mode == "ours":
    try:
        wait_for_work(work, pg, 3.0, "the probe's broadcast")
        print("not raised", flush=True)
    except BroadcastTimeout as e:
        print(f"raised after {time.monotonic() - start:.1f}s: {e}", flush=True)
else:
    work.wait()
    print(f"wait returned after {time.monotonic() - start:.2f}s", flush=True)
time.sleep(30)  # past the spin, the watchdog's 3 s timeout and its dump pause (TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC x 4)
print("alive", flush=True)
os._exit(0)
"""


def probe(mode: str, port: int) -> tuple[int, str, float]:
    env = os.environ | {"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000"}
    env.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", PROBE, mode, str(port)], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip
    return done.returncode, done.stdout + done.stderr[-3000:], time.monotonic() - start


def test_a_stuck_nccl_weight_collective_times_out_on_the_host_and_the_process_survives():
    from prime_rl.protocol.weight_stream import ABORT_GRACE
    from prime_rl.utils.net import free_port

    rc, output, _ = probe("ours", free_port())
    assert rc == 0 and "formed" in output and "alive" in output, output
    assert "the probe's broadcast did not complete within 3s" in output, output
    raised = float(output.split("raised after ")[1].split("s:")[0])
    assert 3 <= raised < 3 + ABORT_GRACE + 2, output  # the timeout and the abort's grace, not the 30 s spin


def test_with_torchs_defaults_the_wait_returns_at_once_and_the_watchdog_ends_the_process():
    from prime_rl.utils.net import free_port

    rc, output, _ = probe("default", free_port())
    assert "wait returned after 0." in output, output
    assert rc != 0 and "alive" not in output, output


if __name__ == "__main__":
    import socket

    for mode in ("ours", "default"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        rc, output, seconds = probe(mode, port)
        print(f"===== {mode}: exit {rc} after {seconds:.1f}s\n{output}", flush=True)
