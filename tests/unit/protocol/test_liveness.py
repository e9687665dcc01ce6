"""A service no `rl` watches (panes, multi-node Slurm) ends itself when its work stops advancing."""

import subprocess
import sys
import textwrap
import time

from prime_rl.protocol.liveness import HUNG

SERVICE = """
import sys, time
from prime_rl.protocol.liveness import Heartbeat, doing, stamp

def stuck_in_a_collective():
    time.sleep(60)  # a deadlock: the side thread would go on beating, the work never stamps again

with Heartbeat(sys.argv[1], "trainer-rank0", interval=0.2, hang_timeout=1.0):
    for _ in range(10):  # working: a stamp every 0.1 s keeps it alive well past the bound
        stamp()
        time.sleep(0.1)
    with doing("writing checkpoint step 3", long=sys.argv[2] == "long"):
        stuck_in_a_collective()
"""


def run_service(tmp_path, phase: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SERVICE), str(tmp_path), phase],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return proc, time.monotonic() - start


def test_a_service_whose_work_stops_exits_hung_with_every_threads_stack(tmp_path):
    proc, took = run_service(tmp_path, "ordinary")
    assert proc.returncode == HUNG, proc.stderr
    assert "trainer-rank0 made no progress for 1s while writing checkpoint step 3 (> 1s, hang_timeout)" in proc.stderr
    assert "stuck_in_a_collective" in proc.stderr  # where the work was stuck: the stack says
    assert 2.0 < took < 8, took  # 1 s of working, then the 1 s bound (+ interpreter start)


def test_long_work_gets_three_times_the_bound(tmp_path):
    proc, took = run_service(tmp_path, "long")
    assert proc.returncode == HUNG, proc.stderr
    assert "(> 3s, hang_timeout)" in proc.stderr
    assert took > 4.0, took
