"""One run per output dir: a second holder is refused naming the first; stale locks are taken over."""

import json
import subprocess
import sys
import time

import pytest

from prime_rl.protocol import RunLock, RunLocked


def test_a_second_holder_is_refused_with_the_holders_name_until_it_releases(tmp_path):
    with RunLock(tmp_path, "orchestrator") as first:
        with pytest.raises(RunLocked, match=r"its orchestrator runs as pid \d+ on .* since .*stop that run or use"):
            RunLock(tmp_path, "orchestrator").acquire()
        with RunLock(tmp_path, "trainer"):  # another role of the same run
            pass
        assert RunLock(tmp_path, "orchestrator", token=first.token).acquire().joined  # a child of the holder
    with RunLock(tmp_path, "orchestrator"):  # released: free again
        pass
    assert not (tmp_path / "run" / "orchestrator.lock").exists()


def test_the_lock_of_a_dead_process_or_a_silent_host_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path = tmp_path / "run" / "trainer.lock"
    path.parent.mkdir(parents=True)
    import socket

    path.write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(), "time": time.time()}))
    with RunLock(tmp_path, "trainer"):  # its process is gone (killed -9, say)
        pass
    path.write_text(json.dumps({"pid": 1, "host": "another-node", "time": time.time() - 120}))
    with RunLock(tmp_path, "trainer", stale_after=60):  # a node that stopped refreshing 2 minutes ago
        pass
    path.write_text(json.dumps({"pid": 1, "host": "another-node", "time": time.time()}))
    with pytest.raises(RunLocked, match="runs as pid 1 on another-node"):
        RunLock(tmp_path, "trainer").acquire()


def test_the_holder_keeps_its_lock_fresh(tmp_path):
    with RunLock(tmp_path, "sft", interval=0.1):
        first = json.loads((tmp_path / "run" / "sft.lock").read_text())["time"]
        time.sleep(0.5)
        assert json.loads((tmp_path / "run" / "sft.lock").read_text())["time"] > first
