"""Waiting for a test's own subprocesses with a bound (`from tests.processes import finish`)."""

import select
import subprocess
import time

import pytest


def finish(proc: subprocess.Popen, what: str, timeout: float = 180) -> tuple[int, str]:
    """`proc`'s exit status and output (stdout, stderr merged); fails the test, showing the output's tail, where
    `what` has not finished within `timeout` seconds."""
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"{what} did not finish within {timeout}s:\n{output[-6000:]}")
    return proc.returncode, output


def first_line(proc: subprocess.Popen, timeout: float) -> str | None:
    """The first line `proc` prints (stdout, text mode), "" where it ended without one, None where it printed none
    within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if select.select([proc.stdout], [], [], min(left, 1.0))[0]:
            return proc.stdout.readline().strip()
    return None
