"""Processes that never outlive the one that started them, and that stop cleanly when asked to.

`rl` starts each service in its own session (so it can signal a service's whole group), and torchrun starts
its workers in their own sessions too; a parent that dies by SIGKILL sends nothing to either, and its
children used to run on (a server serving forever, a trainer writing beside the next run's). The kernel's
parent-death signal closes that: it reaches the child whatever killed the parent.

Stop signals: Slurm asks a job to stop with USR1 (`#SBATCH --signal=USR1@N`, or `scancel --signal=USR1`)
and SIGTERM (time limit, preemption), sent to every process of every step. A service that can resume
(checkpointing on) catches both with `catch_stop_signals`: the handler only records the request; the service
stops at its next safe point (the trainer after its current step, writing a checkpoint; the orchestrator at
once, its progress is saved at every step), and waits on the protocol end with `StopRequested`. Processes with
nothing to save (inference, torchrun's agent) ignore USR1, so it never kills them by its default action.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from prime_rl.protocol.stop import StopRequested, request_stop, stop_requested

PR_SET_PDEATHSIG = 1
# Exit statuses a launcher acts on (`rl --restart`): FATAL (a bad config, a full disk, an environment that
# cannot work) is not retried; PEER_LOST means the peer this service waited on went silent: restart the peer.
FATAL = 2
PREEMPTED = 3  # exit status of `rl` and the orchestrator when they stopped on a stop signal, progress saved
PEER_LOST = 4
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

__all__ = ["StopRequested", "request_stop", "stop_requested"]  # the flag lives in protocol.stop


def exit_now(code: int | str | None) -> NoReturn:
    """Exit with `code` as `sys.exit(code)` would, minus the interpreter's teardown of every module and object:
    for a process that imported torch and transformers that teardown is ~0.9 s of CPU (a process holding the
    tiny model: 0.99 s from its last line to its exit, 0.09 s so), at the end of every command and of every
    service a launcher waits for. What matters of a normal exit still happens, in its order: non-daemon threads
    (and executors' workers) are joined, atexit handlers run (logging's flush, W&B's finish, finalizers), the
    standard streams are flushed. A file left open and unflushed would lose its buffer: ours are closed (or
    flushed every record, `MetricsWriter`) before this."""
    threading._shutdown()  # what Py_Finalize does first: join non-daemon threads, run threading's atexit hooks
    atexit._run_exitfuncs()
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to save
            pass
    os._exit(code or 0)


def catch_stop_signals(then: Callable[[], None] | None = None) -> None:
    """From now on USR1 and SIGTERM ask this process to stop at its next safe point instead of killing it;
    `then` also runs in the handler (e.g. to wake an event loop). For the process's whole life: asyncio's own
    signal handlers would fall back to the default action (death) when their loop closes."""

    def handler(signum: int, frame) -> None:
        request_stop(signum)
        if then is not None:
            then()

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    # Python's shutdown puts the default action (death) back in place of a handler; a stop signal then (e.g.
    # `rl` passing one on) would turn a clean exit into a kill. Ignored signals stay ignored.
    atexit.register(lambda: [signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS])


def ignore_usr1() -> None:
    """Nothing to save here: a USR1 meant for the job's other processes must not kill this one (the default
    action). Inherited by children, through exec too, until they install a handler."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def children(pid: int) -> list[int]:
    """The live processes whose parent is `pid` (Linux /proc; empty elsewhere): e.g. torchrun's workers, which
    run in sessions of their own where a signal to the agent's group does not reach them."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return found


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
