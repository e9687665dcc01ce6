"""Processes that never outlive the one that started them.

`rl` starts each service in its own session (so it can signal a service's whole group), and torchrun starts
its workers in their own sessions too; a parent that dies by SIGKILL sends nothing to either, and its
children used to run on (a server serving forever, a trainer writing beside the next run's). The kernel's
parent-death signal closes that: it reaches the child whatever killed the parent.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process when its parent dies (Linux; a no-op elsewhere).

    Safe as a `preexec_fn`. If the parent died before the request took effect, the signal is sent now.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
