"""The stop flag: set by a stop signal's handler (`utils.process.catch_stop_signals`), read at safe points.

It lives with the protocol because the protocol's waits end on it (`StopRequested`), and the waits are
where a stopping service spends its time.
"""

from __future__ import annotations

import signal
import threading

_stop = threading.Event()
_stop_signal: list[str] = []


class StopRequested(Exception):
    """A stop signal arrived (raised where a service waits, so the wait ends at once)."""


def request_stop(signum: int, frame=None) -> None:
    """A signal handler: record the stop request (nothing else is safe in a handler)."""
    _stop_signal.append(signal.Signals(signum).name)
    _stop.set()


def stop_requested() -> str | None:
    """The name of the first stop signal received (e.g. "SIGUSR1"), None while none was."""
    return _stop_signal[0] if _stop.is_set() else None
