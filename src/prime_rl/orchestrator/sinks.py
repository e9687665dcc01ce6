"""Where the orchestrator's per-step numbers go besides metrics/orchestrator.jsonl: W&B and the terminal.

W&B is an optional extra (`uv sync --extra wandb`), imported only when `[wandb]` is configured; asking for
it without the package installed is a clear error at start, not a crash at the first step.
The progress line is a single self-overwriting terminal line (`step 3/20 | groups 12/32 | 41.2 groups/s`)
shown only on a terminal, so log files and CI output stay clean.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable
from typing import Any

from prime_rl.orchestrator.config import OrchestratorConfig


class SinkError(RuntimeError):
    """A metrics sink was asked for but cannot work (e.g. wandb is not installed)."""


class NoSink:
    def log(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class WandbSink:
    def __init__(self, run: Any):
        self.run = run

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log({f"orchestrator/{k}": v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


def build_wandb(config: OrchestratorConfig) -> NoSink | WandbSink:
    if config.wandb is None:
        return NoSink()
    try:
        import wandb
    except ImportError:
        raise SinkError(
            "wandb logging is on ([wandb] / --wandb) but the wandb package is not installed; "
            "run `uv sync --extra wandb` or drop the [wandb] section"
        ) from None
    w = config.wandb
    run = wandb.init(
        project=w.project, name=w.name, entity=w.entity, mode="offline" if w.offline else "online",
        config=config.model_dump(mode="json"), dir=str(config.output_dir),
    )  # fmt: skip
    return WandbSink(run)


class ProgressLine:
    """`await progress.track(coros)`: gathers the coroutines while redrawing one status line as they finish."""

    def __init__(self, enabled: bool | None, max_steps: int, stream=None):
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.max_steps = max_steps
        self.step = 0

    def draw(self, text: str) -> None:
        self._write(f"\r\033[K{text}")

    def clear(self) -> None:
        self._write("\r\033[K")

    def _write(self, text: str) -> None:
        if not self.enabled:
            return
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # the terminal went away (closed / broken pipe): a cosmetic line must
            self.enabled = False  # never fail a step, so it just stops

    async def track(self, coros: list[Awaitable]) -> list:
        if not self.enabled:
            return list(await asyncio.gather(*coros))
        total, done, start = len(coros), 0, time.perf_counter()

        async def one(coro: Awaitable):
            nonlocal done
            result = await coro
            done += 1
            rate = done / max(time.perf_counter() - start, 1e-9)
            self.draw(f"step {self.step}/{self.max_steps} | groups {done}/{total} | {rate:.1f} groups/s")
            return result

        return list(await asyncio.gather(*(one(c) for c in coros)))

    def close(self) -> None:
        self.clear()
