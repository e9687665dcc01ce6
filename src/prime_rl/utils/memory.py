"""Resident memory of this process: its peak since it started (every service's per-step metrics), and over a
stretch of code (Linux: /proc/self/status VmHWM)."""

from __future__ import annotations

import resource
from pathlib import Path

_STATUS = Path("/proc/self/status")


def _status_mib(key: str) -> float | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def peak_rss_gib() -> float:
    """This process's peak resident memory since it started, GiB (what a host's memory limit is checked against)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class PeakMemory:
    """Resets the kernel's peak-RSS mark at creation; `extra_mib()` = peak since then - RSS then (None
    where the platform does not tell)."""

    def __init__(self) -> None:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # "5": reset VmHWM to the current RSS
            self.start = _status_mib("VmRSS")
        except OSError:
            self.start = None

    def extra_mib(self) -> float | None:
        peak = _status_mib("VmHWM")
        return None if self.start is None or peak is None else round(max(0.0, peak - self.start), 1)
