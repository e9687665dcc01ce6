"""Where the orchestrator's per-step numbers go besides metrics/orchestrator.jsonl: W&B and the terminal.

W&B is an optional extra (`uv sync --extra wandb`), imported only when `[wandb]` is configured; asking for
it without the package installed is a clear error at start, not a crash at the first step. The run is the
whole RL run's: with its own metrics the orchestrator forwards the trainer's (metrics/trainer.jsonl) and the
evals' (eval/summary.jsonl, metrics/eval.jsonl) as they appear, each series on its own step axis
(`trainer/step`, ...), so one process owns the W&B run and the trainer ranks never talk to W&B.
The progress line is a single self-overwriting terminal line (`step 3/20 | groups 12/32 | 41.2 groups/s`)
shown only on a terminal, so log files and CI output stay clean.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from prime_rl.configs.orchestrator import OrchestratorConfig
from prime_rl.protocol import atomic_write_json, wandb_run_file


class SinkError(RuntimeError):
    """A metrics sink was asked for but cannot work (e.g. wandb is not installed)."""


class NoSink:
    def log(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class WandbSink:
    def __init__(self, run: Any, output_dir: Path):
        self.run, self.output_dir = run, output_dir
        self.logged = {"trainer": -1, "eval": -1}  # newest step forwarded per series
        for series in ("orchestrator", "trainer", "eval"):
            run.define_metric(f"{series}/step")
            run.define_metric(f"{series}/*", step_metric=f"{series}/step")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log({"orchestrator/step": step, **{f"orchestrator/{k}": v for k, v in metrics.items()}})
        self.forward()

    def forward(self) -> None:
        """The trainer's and the evals' records newer than those already sent."""
        from prime_rl.utils.metrics import tail_metrics
        from prime_rl.utils.plot import eval_rewards

        for record in tail_metrics(self.output_dir, "trainer"):
            step = record.get("step")
            if isinstance(step, int) and step > self.logged["trainer"]:
                values = {f"trainer/{k}": v for k, v in record.items() if k not in ("step", "time")}
                self.run.log({"trainer/step": step, **values})
                self.logged["trainer"] = step
        for step, reward in eval_rewards(self.output_dir):
            if step > self.logged["eval"]:
                self.run.log({"eval/step": step, "eval/reward_mean": reward})
                self.logged["eval"] = step

    def close(self) -> None:
        self.forward()
        self.run.finish()


def build_wandb(config: OrchestratorConfig, resumed: bool = False) -> NoSink | WandbSink:
    """A fresh run starts a W&B run and records its id in run/wandb.json; a resumed one (a restart by
    `rl --restart`, a Slurm requeue, `--ckpt.resume-step`) continues that W&B run instead of starting another."""
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
    record = wandb_run_file(config.output_dir)
    try:
        run_id = json.loads(record.read_text())["id"] if resumed else None
    except (OSError, ValueError, KeyError, TypeError):
        run_id = None
    run_id = run_id or secrets.token_hex(6)
    run = wandb.init(
        project=w.project, name=w.name, entity=w.entity, mode="offline" if w.offline else "online",
        config=config.model_dump(mode="json"), dir=str(config.output_dir), id=run_id, resume="allow",
    )  # fmt: skip
    atomic_write_json(record, {"id": run_id})
    return WandbSink(run, config.output_dir)


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

    def note(self, done: int, total: int) -> None:
        """Continuous mode: groups taken into the step so far."""
        if self.enabled:
            self.draw(f"step {self.step}/{self.max_steps} | groups {done}/{total}")

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
