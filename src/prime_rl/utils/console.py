"""A live status line under scrolling log lines, for `rl` and `sft` alike, and the pieces their texts share.

On a terminal the line is redrawn in place below the log lines (which scroll above it); anywhere else (a file,
a pipe, CI) it is never drawn and the log lines are written as they are.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable


class LiveLine:
    """On a terminal, one live line (`text()`, bold) under the scrolling log lines; elsewhere nothing."""

    def __init__(self, text: Callable[[], str]):
        from rich.console import Console
        from rich.live import Live

        self.text = text
        self.console = Console()
        terminal = self.console.is_terminal
        self.live = Live(console=self.console, refresh_per_second=2, transient=True) if terminal else None
        self._moved: list[tuple[logging.StreamHandler, object]] = []

    def __enter__(self) -> LiveLine:
        if self.live is not None:
            stderr = sys.stderr
            self.live.start()  # sys.stderr is now rich's proxy, which prints above the live line
            # Our logger's console handler holds the real stderr: point it at the proxy too, or its lines would
            # be drawn over the live line.
            for handler in logging.getLogger("prime_rl").handlers:
                if type(handler) is logging.StreamHandler and handler.stream is stderr is not sys.stderr:
                    self._moved.append((handler, handler.setStream(sys.stderr)))
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            for handler, stream in self._moved:
                handler.setStream(stream)
            self._moved.clear()
            self.live.stop()

    def print(self, line: str) -> None:
        """A log line above the live line (as it is: no markup)."""
        if self.live is None:
            print(line, flush=True)
        else:
            self.live.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def update(self) -> None:
        if self.live is not None:
            from rich.text import Text

            self.live.update(Text(self.text(), style="bold"))


def this_run(records: list[dict], since: float | None) -> list[dict]:
    """The records written since `since` (unix seconds): a re-used output dir's file starts with an earlier
    run's records until this run's writer truncates it, and a resumed run keeps those of its earlier steps."""
    return records if since is None else [r for r in records if r.get("time", 0.0) >= since]


def duration(seconds: float) -> str:
    """'1m05s', '2h03m', '42s'."""
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def eta(records: list[dict], steps_left: int) -> str | None:
    """'ETA 1m05s' from the median `time/step` of the newest 10 records, None without any."""
    times = sorted(r["time/step"] for r in records[-10:] if "time/step" in r)
    if not times:
        return None
    left = times[len(times) // 2] * steps_left
    return f"ETA {int(left // 60)}m{int(left % 60):02d}s"
