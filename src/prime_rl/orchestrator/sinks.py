"""Where the orchestrator's per-step numbers go besides metrics/orchestrator.jsonl: W&B and the terminal.

W&B (utils.wandb owns the run: the extra's import check, the id kept for resumes, offline mode): the run is the
whole RL run's. With its own metrics the orchestrator logs the inference servers' (their /metrics, read in the
background by servers.metrics.ServerMetrics) and forwards the trainer's (metrics/trainer.jsonl) and the evals'
(eval/summary.jsonl, metrics/eval.jsonl) as they appear, each series on its own step axis (`trainer/step`, ...),
so one process owns the W&B run and neither the trainer ranks nor the servers talk to W&B. After its last step
the orchestrator waits for the trainer's last records (the trainer is up to async_level + 1 steps behind).
The progress line is a single self-overwriting terminal line (`step 3/20 | groups 12/32 | 41.2 groups/s`)
shown only on a terminal, so log files and CI output stay clean.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from prime_rl.configs.orchestrator import OrchestratorConfig
from prime_rl.orchestrator.servers.metrics import ServerMetrics
from prime_rl.utils.aio import gather_or_cancel
from prime_rl.utils.wandb import WandbError, WandbRun, open_run

logger = logging.getLogger("prime_rl")

SinkError = WandbError  # a metrics sink was asked for but cannot work (e.g. wandb is not installed)
SERIES = ("orchestrator", "trainer", "eval", "inference")


class NoSink:
    def log(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class WandbSink:
    def __init__(self, run: WandbRun, output_dir: Path):
        self.run, self.output_dir = run, output_dir
        self.servers: ServerMetrics | None = None  # set once the servers are up: their numbers as inference/*
        self.logged = {"trainer": -1, "eval": -1}  # newest step forwarded per series

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log("orchestrator", step, metrics)
        if self.servers is not None and (numbers := self.servers.take()):
            self.run.log("inference", step, numbers)
        self.forward()

    def forward(self) -> None:
        """The trainer's and the evals' records newer than those already sent."""
        from prime_rl.utils.metrics import tail_metrics
        from prime_rl.utils.plot import eval_rewards

        for record in tail_metrics(self.output_dir, "trainer"):
            step = record.get("step")
            if isinstance(step, int) and step > self.logged["trainer"]:
                self.run.log("trainer", step, {k: v for k, v in record.items() if k not in ("step", "time")})
                self.logged["trainer"] = step
        for step, reward in eval_rewards(self.output_dir):
            if step > self.logged["eval"]:
                self.run.log("eval", step, {"reward_mean": reward})
                self.logged["eval"] = step

    async def last_trainer_steps(self, config: OrchestratorConfig) -> None:
        """After our last step: the trainer's records of the steps it still trains (up to async_level + 1 of
        them come after ours), so that the W&B run ends with the trainer's last step. A trainer that died
        (its heartbeat) or never gets there costs a warning, not the run."""
        from prime_rl.protocol import WaitTimeout, WriterDead, wait_until_async

        last = config.max_steps - 1

        def forwarded() -> bool:
            self.forward()
            return self.logged["trainer"] >= last

        try:
            await wait_until_async(
                forwarded, f"the trainer's metrics of step {last} (for W&B)", config.weights_timeout,
                output_dir=self.output_dir, writer="trainer-rank0", heartbeat_timeout=config.heartbeat_timeout,
                poll=0.5,
            )  # fmt: skip
        except (WaitTimeout, WriterDead) as e:
            logger.warning(f"{e}; the W&B run has the trainer's steps up to {self.logged['trainer']} only")

    def close(self) -> None:
        self.forward()
        self.run.finish()


def build_wandb(config: OrchestratorConfig, resumed: bool = False) -> NoSink | WandbSink:
    """A fresh run starts a W&B run; a resumed one (a restart by `rl --restart`, a Slurm requeue,
    `--ckpt.resume-step`) continues that W&B run instead of starting another."""
    run = open_run(config.wandb, config.output_dir, config.model_dump(mode="json"), resumed, SERIES)
    return NoSink() if run is None else WandbSink(run, config.output_dir)


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
            return await gather_or_cancel(*coros)
        total, done, start = len(coros), 0, time.perf_counter()

        async def one(coro: Awaitable):
            nonlocal done
            result = await coro
            done += 1
            rate = done / max(time.perf_counter() - start, 1e-9)
            self.draw(f"step {self.step}/{self.max_steps} | groups {done}/{total} | {rate:.1f} groups/s")
            return result

        return await gather_or_cancel(*(one(c) for c in coros))

    def close(self) -> None:
        self.clear()
