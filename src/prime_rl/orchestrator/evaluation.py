"""Evaluation (docs/design.md §6): sampling and scoring examples of an environment, and their summary with
pass@k; the `[[eval]]` environments evaluated during training (`Evals`). The `eval` CLI
(the `eval` command, prime_rl.eval.eval) runs the same core over weight steps.

pass@k (unbiased, Chen et al. 2021) is reported when rewards are 0/1: with n samples of which c are
correct, pass@k = 1 - C(n-c, k) / C(n, k). Worked example, n=4, c=1: pass@1 = 0.25, pass@2 = 1 - 3/6 = 0.5.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import statistics
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from prime_rl.configs.orchestrator import EvalEnvConfig, OrchestratorConfig
from prime_rl.envs import EnvError, EpisodeFailed, Example
from prime_rl.orchestrator.observer import StepObserver
from prime_rl.orchestrator.policy import load_weights
from prime_rl.orchestrator.rollout import Group, RolloutSource
from prime_rl.orchestrator.servers.client import InferenceClient
from prime_rl.orchestrator.sources import build_source
from prime_rl.protocol import heartbeat_age, wait_for_weights
from prime_rl.utils.aio import gather_or_cancel
from prime_rl.utils.metrics import MetricsWriter

logger = logging.getLogger("prime_rl")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples (from n with c correct) is correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class EnvResult:
    """One environment's groups at one weight step: its summary line and its per-sample lines. `failed`: why
    each group that failed in the env's own code did (left out of the figures, counted as `failed_groups`)."""

    env_id: str
    step: int
    groups: list[Group]
    failed: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        rewards = [r.reward for g in self.groups for r in g.rollouts]
        out = {
            "step": self.step,
            "env": self.env_id,
            "samples": len(rewards),
            **({"failed_groups": len(self.failed)} if self.failed else {}),
            "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.pstdev(rewards),
            "truncated_fraction": statistics.fmean(r.truncated for g in self.groups for r in g.rollouts),
        }
        n = len(self.groups[0].rollouts)
        if all(r in (0.0, 1.0) for r in rewards):
            for k in (2**i for i in range(n.bit_length())):
                per_example = [pass_at_k(n, sum(r.reward == 1.0 for r in g.rollouts), k) for g in self.groups]
                out[f"pass@{k}"] = statistics.fmean(per_example)
        return out

    def sample_lines(self) -> str:
        lines = []
        for i, group in enumerate(self.groups):
            for j, r in enumerate(group.rollouts):
                record = {
                    "example": i, "sample": j, "prompt": group.example.prompt, "answer": group.example.answer,
                    "completion": r.completion, "reward": r.reward, "metrics": r.metrics, "turns": r.turns,
                    "finish_reason": r.finish_reason, "completion_tokens": sum(r.completion_mask),
                    "weight_step": r.weight_step,
                }  # fmt: skip
                lines.append(json.dumps(record, default=str))
        return "\n".join(lines) + "\n"


async def sample_and_score(client: InferenceClient, source: RolloutSource, examples: list, n: int,
                           seed: int | None) -> tuple[list[Group], list[str]]:  # fmt: skip
    """Every example sampled `n` times at once, then scored: one evaluation's groups (also `[[eval]]`'s), and why
    each group whose episodes failed in the env's own code (EpisodeFailed: a harness or sandbox error) did. Those
    are left out and counted, as training does; an evaluation where every group failed is an EnvError."""

    async def kept(work: Awaitable) -> Any:
        try:
            return await work
        except EpisodeFailed as e:
            return e

    sampled = await gather_or_cancel(*(kept(source.group(client, ex, n, seed)) for ex in examples))
    groups = [g for g in sampled if isinstance(g, Group)]
    scored = await gather_or_cancel(*(kept(source.score(g)) for g in groups))
    failed = [str(e) for e in (*sampled, *scored) if isinstance(e, EpisodeFailed)]
    groups = [g for g, s in zip(groups, scored, strict=True) if not isinstance(s, EpisodeFailed)]
    if not groups:
        raise EnvError(f"{source.name}: every group of the evaluation failed ({len(failed)}); the last: {failed[-1]}")
    if failed:
        logger.warning(f"{source.name}: {len(failed)} of {len(examples)} eval groups failed, left out; the first: "
                       f"{failed[0]}")  # fmt: skip
    return groups, failed


class Evals(StepObserver):
    """`[[eval]]` environments evaluated during training, beside it, on the same servers.

    At step s with s % interval == 0 an env's evaluation starts as a background task once the step's weights
    are in place (`before_generate`, observer.py; its requests share
    the servers with training's, so training slows by about their share of the requests); at the end
    each env is evaluated once more on the trainer's final weights. Every evaluation draws the same
    `num_examples` examples (the env's `seed`) and writes one line to metrics/eval.jsonl: step, env,
    reward_mean/std, pass@k (0/1 rewards), and the weight steps that sampled it (`weight_step` .. `_max`:
    an update may land while it runs)."""

    def __init__(self, config: OrchestratorConfig, first_step: int):
        self.config = config
        self.envs: list[tuple[EvalEnvConfig, RolloutSource, list[Example]]] = []
        for cfg in config.eval:
            temperature = cfg.temperature or config.sampling.temperature
            sampling = config.sampling.model_copy(update={"temperature": temperature})
            env, source = build_source(cfg, config, sampling)
            self.envs.append((cfg, source, list(itertools.islice(env.examples(cfg.seed), cfg.num_examples))))
        self.writer = MetricsWriter(config.output_dir, "eval", first_step) if self.envs else None
        self.tasks: set[asyncio.Task] = set()

    async def before_generate(self, client: InferenceClient, step: int) -> None:
        self.start(client, step)

    def start(self, client: InferenceClient, step: int, final: bool = False) -> None:
        for cfg, source, examples in self.envs:
            if final or step % cfg.interval == 0:
                task = asyncio.create_task(self._run(client, step, cfg, source, examples))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def _run(self, client, step, cfg: EvalEnvConfig, source: RolloutSource, examples: list[Example]) -> None:
        start = time.perf_counter()
        groups, failed = await sample_and_score(client, source, examples, cfg.rollouts_per_example,
                                                self.config.sampling.seed)  # fmt: skip
        result = EnvResult(cfg.label, step, groups, failed).summary()
        steps = [r.weight_step for g in groups for r in g.rollouts]
        result |= {"weight_step": min(steps), "weight_step_max": max(steps), "seconds": time.perf_counter() - start}
        result.pop("step")
        self.writer.log(step, result)
        passes = " ".join(f"{k} {v:.3f}" for k, v in result.items() if k.startswith("pass@"))
        logger.info(f"eval step {step} | {cfg.label} | reward {result['reward_mean']:.3f} {passes}".rstrip())

    async def wait(self) -> None:
        """Wait for the running evaluations; the first one that failed raises here."""
        for task in list(self.tasks):
            await task

    async def final(self, client: InferenceClient, config: OrchestratorConfig) -> None:
        """Evaluate the trainer's final weights (weights/step_max_steps), when a trainer runs."""
        await self.wait()
        if heartbeat_age(config.output_dir, "trainer-rank0") is None:
            logger.warning("no trainer heartbeat in this output dir: skipping the evaluation of the final weights")
            return
        step = config.max_steps
        logger.info(f"waiting for the trainer's final weights (step {step}) to evaluate them")
        await wait_for_weights(config.output_dir, step, config.weights_timeout, config.heartbeat_timeout)
        await load_weights(client, config, step, {})
        self.start(client, step, final=True)
        await self.wait()

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.writer is not None:
            self.writer.close()
