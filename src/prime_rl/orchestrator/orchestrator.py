"""The `orchestrator` entrypoint: environment → rollouts → advantages → packed rank files (DESIGN §3, §6).

For each step n:
1. `wait_for_policy`: make sure the servers sample from weights no older than n - async_level (waiting
   for the trainer's `weights/step_k/STABLE` and relaying it with POST /update_weights).
2. `generate_rollouts`: batch_size / rollouts_per_example prompts, each sampled rollouts_per_example times.
3. `score` + `compute_advantages`: rewards, then reward minus the group mean per prompt.
4. `pack_micro_batches` + `write_rank_files`: one atomically written `rollouts/step_n/rank_r.pt` per rank.
5. one metrics line and one INFO line.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import statistics
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass

from prime_rl.orchestrator.advantage import compute_advantages
from prime_rl.orchestrator.client import Completion, InferenceClient, InferenceError
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.envs import EnvError, Environment, Example, load_environment
from prime_rl.orchestrator.packing import SampleTooLong, make_sample, pack_micro_batches
from prime_rl.protocol import (
    Heartbeat,
    WaitTimeout,
    WriterDead,
    stable_steps,
    wait_for_weights,
    weights_dir,
    weights_root,
)
from prime_rl.utils.config import parse_config, write_run_config
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.metrics import MetricsWriter
from prime_rl.utils.timer import timer

logger = logging.getLogger("prime_rl")


@dataclass
class Group:
    """The rollouts of one prompt: the unit over which advantages are computed."""

    example: Example
    completions: list[Completion]


@dataclass
class Rollouts:
    groups: list[Group]

    @property
    def completions(self) -> list[Completion]:
        return [c for g in self.groups for c in g.completions]


async def wait_for_policy(client: InferenceClient, config: OrchestratorConfig, step: int) -> int:
    """Ensure every server holds weights step >= step - async_level; return the step they hold."""
    need = max(0, step - config.async_level)
    current = await client.server_step()
    if current >= need:
        return current
    logger.info(f"step {step}: servers hold weights step {current}, need >= {need}; waiting for the trainer")
    # A plain blocking wait: nothing else is in flight between steps, and unlike a worker thread it stops
    # at once on Ctrl-C.
    wait_for_weights(config.output_dir, need, config.weights_timeout, config.heartbeat_timeout)
    # The trainer may have moved on while we waited: take the newest complete weights, never older than need.
    newest = max(s for s in stable_steps(weights_root(config.output_dir)) if s >= need)
    weight_dir = weights_dir(config.output_dir, newest)
    loaded = await client.update_weights(str(weight_dir))
    if loaded != newest:
        raise InferenceError(f"servers report weights step {loaded} after loading {weight_dir}")
    logger.info(f"step {step}: servers now serve weights step {loaded}")
    return loaded


async def generate_rollouts(
    client: InferenceClient, examples: Iterator[Example], config: OrchestratorConfig
) -> Rollouts:
    """Sample rollouts_per_example completions for each of the step's prompts, all requests in flight at once."""
    num_prompts = config.batch_size // config.rollouts_per_example
    batch = list(itertools.islice(examples, num_prompts))
    if len(batch) < num_prompts:
        raise EnvError(f"environment {config.env.id!r} ran out of examples ({len(batch)} of {num_prompts} needed)")
    results = await asyncio.gather(
        *(client.chat(example.prompt, config.rollouts_per_example, config.sampling) for example in batch)
    )
    return Rollouts([Group(example, completions) for example, completions in zip(batch, results, strict=True)])


def score(env: Environment, rollouts: Rollouts) -> list[list[float]]:
    return [[float(env.score(c.text, g.example)) for c in g.completions] for g in rollouts.groups]


def build_samples(rollouts: Rollouts, advantages: list[list[float]]) -> list[dict]:
    return [
        make_sample(c.prompt_ids, c.completion_ids, c.logprobs, a)
        for g, group_advantages in zip(rollouts.groups, advantages, strict=True)
        for c, a in zip(g.completions, group_advantages, strict=True)
    ]


def write_rank_files(config: OrchestratorConfig, step: int, per_rank: list) -> None:
    from prime_rl.protocol.records import write_rank_file

    for rank, micro_batches in enumerate(per_rank):
        write_rank_file(config.output_dir, step, rank, micro_batches)


def step_metrics(rollouts: Rollouts, rewards: list[list[float]], times: dict[str, float], step: int) -> dict:
    completions = rollouts.completions
    flat = [r for group in rewards for r in group]
    seq_lens = [len(c.prompt_ids) + len(c.completion_ids) for c in completions]
    weight_step = min(c.weight_step for c in completions)
    tokens = sum(seq_lens)
    return {
        "reward_mean": statistics.fmean(flat),
        "reward_std": statistics.pstdev(flat),
        "seq_len_mean": statistics.fmean(seq_lens),
        "completion_len_mean": statistics.fmean(len(c.completion_ids) for c in completions),
        "truncated_fraction": sum(c.finish_reason == "length" for c in completions) / len(completions),
        "weight_step": weight_step,
        "off_policy_gap": step - weight_step,
        "tokens": tokens,
        "tokens_per_s": tokens / max(times["step"], 1e-9),
        **{f"time_{key}": value for key, value in times.items()},
    }


async def orchestrate(config: OrchestratorConfig) -> None:
    env = load_environment(config.env.id, **config.env.args)
    examples = env.examples(config.seed)
    async with InferenceClient(config.client, config.model.name) as client:
        with closing(MetricsWriter(config.output_dir, "orchestrator")) as metrics:
            with Heartbeat(config.output_dir, "orchestrator") as heartbeat:
                await client.wait_for_servers(config.client.health_timeout)
                for step in range(config.max_steps):
                    heartbeat.step = step
                    times: dict[str, float] = {}
                    start = time.perf_counter()

                    with timer(times, "wait_weights"):
                        await wait_for_policy(client, config, step)
                    with timer(times, "generate"):
                        rollouts = await generate_rollouts(client, examples, config)
                    with timer(times, "score"):
                        rewards = score(env, rollouts)
                    advantages = compute_advantages(rewards, config.advantage.std_norm)
                    with timer(times, "pack"):
                        per_rank = pack_micro_batches(
                            build_samples(rollouts, advantages),
                            config.seq_len,
                            config.num_train_workers,
                            config.sampling.temperature,
                        )
                    with timer(times, "write"):
                        write_rank_files(config, step, per_rank)

                    times["step"] = time.perf_counter() - start
                    m = step_metrics(rollouts, rewards, times, step)
                    metrics.log(step, m)
                    logger.info(
                        f"step {step} | reward {m['reward_mean']:.3f} | {m['tokens_per_s']:.0f} tok/s | "
                        f"weight_step {m['weight_step']} | {times['step']:.2f}s"
                    )
                    logger.debug(f"step {step} metrics: {m}")
    logger.info(f"done: wrote rollouts for {config.max_steps} steps to {config.output_dir}")


def run(config: OrchestratorConfig) -> None:
    # torch (for the rank-file records) loads here: after config parsing, and not inside step 0's timings.
    import prime_rl.protocol.records  # noqa: F401

    asyncio.run(orchestrate(config))


def main() -> None:
    config = parse_config(OrchestratorConfig, prog="orchestrator")
    setup_logging("orchestrator", config.output_dir, config.log.level, config.log.file)
    write_run_config(config, "orchestrator", config.output_dir)
    try:
        run(config)
    except (WaitTimeout, WriterDead, InferenceError, EnvError, SampleTooLong) as e:
        logger.error(str(e))
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
