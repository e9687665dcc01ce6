"""The `orchestrator` entrypoint: environment → rollouts → advantages → packed rank files (DESIGN §3, §6).

For each step n:
1. `save_checkpoint`: the progress when about to produce step n (every step; see protocol.checkpoints).
2. `wait_for_policy`: every live server must sample from weights no older than n - async_level (waiting
   for the trainer's `weights/step_k/STABLE` and relaying it with POST /update_weights to every server
   before any of the step's requests start). So the orchestrator runs up to async_level steps ahead of
   the trainer; async_level 0 is on-policy. Each rollout records the weight step that sampled it.
3. `generate_batch`: batch_size / rollouts_per_example examples, each sampled rollouts_per_example times
   and scored; with advantage.skip_zero_advantage, groups whose rewards are all equal are replaced by
   fresh examples (up to advantage.max_rounds rounds), so the batch is always exactly batch_size rollouts.
4. `build_samples` + `pack_micro_batches` + `write_rank_files`: one atomic `rollouts/step_n/rank_r.pt`
   per trainer rank.
5. `step_metrics`: one line in metrics/orchestrator.jsonl (and W&B), one INFO line.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from prime_rl.orchestrator.advantage import apply_truncation, group_advantages, is_zero
from prime_rl.orchestrator.ckpt import CheckpointError, Progress, load_checkpoint, new_rng, save_checkpoint
from prime_rl.orchestrator.client import InferenceClient, InferenceError
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.envs import EnvError, Environment, Example, load_environment
from prime_rl.orchestrator.packing import SampleTooLong, make_sample, pack_micro_batches
from prime_rl.orchestrator.rollout import Group, RolloutSource, load_tokenizer
from prime_rl.orchestrator.sinks import ProgressLine, SinkError, build_wandb
from prime_rl.protocol import (
    DiskFull,
    Heartbeat,
    RunLock,
    RunLocked,
    WaitTimeout,
    WriterDead,
    clear_previous_run,
    is_stable,
    list_steps,
    rollout_step_dir,
    rollouts_dir,
    stable_steps,
    wait_for_weights,
    wait_until,
    weights_dir,
    weights_root,
)
from prime_rl.protocol.broadcast import marker_file, read_marker
from prime_rl.utils.config import parse_config, write_run_config
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.metrics import MetricsWriter
from prime_rl.utils.timer import timer

logger = logging.getLogger("prime_rl")


class DataStream:
    """The environment's example stream with a position, so a resumed run continues with unseen examples."""

    def __init__(self, env: Environment, seed: int, skip: int = 0):
        self._examples: Iterator[Example] = env.examples(seed)
        self.drawn = 0
        for _ in range(skip):
            self.next()

    def next(self) -> Example:
        try:
            example = next(self._examples)
        except StopIteration:
            raise EnvError(f"the environment's examples ran out after {self.drawn}; examples() must not end") from None
        self.drawn += 1
        return example

    def take(self, k: int) -> list[Example]:
        return [self.next() for _ in range(k)]


@dataclass
class Batch:
    groups: list[Group]
    advantages: list[list[float]]
    skipped: int = 0  # zero-advantage groups replaced by fresh examples
    rounds: int = 1
    times: dict[str, float] = field(default_factory=dict)

    @property
    def rollouts(self):
        return [r for g in self.groups for r in g.rollouts]


async def wait_for_policy(client: InferenceClient, config: OrchestratorConfig, step: int, times: dict) -> int:
    """Ensure every live server holds weights step >= step - async_level; return the oldest step held.

    `times` gets `wait_weights` (waiting for the trainer) and `update_weights` (the servers loading them)."""
    need = client.floor = max(0, step - config.async_level)
    current = await client.server_step()
    if config.weight_transfer == "broadcast":
        current = await relay_broadcasts(client, config, current, need, times)
    if current >= need:
        return current
    logger.info(f"step {step}: servers hold weights step {current}, need >= {need}; waiting for the trainer")
    # A plain blocking wait: nothing else is in flight between steps, and unlike a worker thread it stops
    # at once on Ctrl-C.
    with timer(times, "wait_weights"):
        wait_for_weights(config.output_dir, need, config.weights_timeout, config.heartbeat_timeout)
    # The trainer may have moved on while we waited: take the newest complete weights, never older than need,
    # and not newer than `step` where there is a choice (an orchestrator redoing a step after a restart
    # samples from the policy an uninterrupted run would have had).
    usable = [s for s in stable_steps(weights_root(config.output_dir)) if s >= need]
    newest = max([s for s in usable if s <= step] or usable)
    weight_dir = weights_dir(config.output_dir, newest)
    with timer(times, "update_weights"):
        loaded = await client.update_weights(str(weight_dir))
    times["served_at"] = time.time()  # a timestamp, for the weight plane's latency (benchmarks/rl.py)
    if loaded != newest:
        raise InferenceError(f"servers report weights step {loaded} after loading {weight_dir}")
    logger.info(f"step {step}: servers now serve weights step {loaded}")
    return loaded


async def relay_broadcasts(client: InferenceClient, config: OrchestratorConfig, current: int, need: int,
                           times: dict) -> int:  # fmt: skip
    """weight_transfer = broadcast: relay every step the trainer announces (it waits for all servers to
    ask), and wait for announcements until the servers hold `need` or its weights are on disk (a resumed
    run: checkpoint steps are written there). Returns the step the servers hold.

    An announcement is pending unless every server holds its step from its group: a restarted trainer
    forms a new group and may announce a step older than the servers hold (it resumed from a checkpoint)."""
    out = config.output_dir
    b = config.weight_broadcast

    def pending(marker: dict | None) -> bool:
        live = client.pool.live()
        return marker is not None and any(s.group != marker["group"] or s.step < marker["step"] for s in live)

    while True:
        announced = read_marker(out)
        if pending(announced):
            rendezvous = {"host": b.host, "port": b.port, "timeout": b.timeout}
            rendezvous |= {"group": announced["group"], "backend": announced["backend"]}
            with timer(times, "update_weights"):
                current = await client.broadcast_weights(announced["step"], rendezvous)
            times["served_at"] = time.time()
            logger.info(f"servers now serve weights step {current} (broadcast)")
            continue
        if current >= need or is_stable(weights_dir(out, need)):
            return current
        with timer(times, "wait_weights"):
            wait_until(
                lambda: pending(read_marker(out)) or is_stable(weights_dir(out, need)),
                f"the trainer's weight step {need} ({marker_file(out, need)} or {weights_dir(out, need)})",
                config.weights_timeout,
                watch=marker_file(out, need),
                output_dir=out,
                writer="trainer-rank0",
                heartbeat_timeout=config.heartbeat_timeout,
            )


async def generate_batch(
    client: InferenceClient,
    source: RolloutSource,
    data: DataStream,
    config: OrchestratorConfig,
    rng,
    progress: ProgressLine,
) -> Batch:
    """Exactly batch_size / rollouts_per_example scored groups with their advantages."""
    need = config.batch_size // config.rollouts_per_example
    adv = config.advantage
    kept: list[tuple[Group, list[float]]] = []
    zero: list[tuple[Group, list[float]]] = []
    batch = Batch([], [], rounds=0)
    while len(kept) < need and batch.rounds < adv.max_rounds:
        batch.rounds += 1
        examples = data.take(need - len(kept))
        seeds = [None if config.sampling.seed is None else rng.randrange(2**31) for _ in examples]

        async def sample_and_score(example: Example, seed: int | None) -> Group:
            # Each group is scored as soon as it arrives, while the server is still busy with the others.
            group = await source.group(client, example, config.rollouts_per_example, seed)
            with timer(batch.times, "score"):
                source.score([group])
            return group

        with timer(batch.times, "generate"):
            groups = await progress.track([sample_and_score(ex, s) for ex, s in zip(examples, seeds, strict=True)])
        with timer(batch.times, "advantage"):
            for group in groups:
                rewards = apply_truncation(
                    [r.reward for r in group.rollouts], [r.truncated for r in group.rollouts], adv.truncated
                )
                advantages = group_advantages(rewards, adv.std_norm)
                if adv.skip_zero_advantage and is_zero(advantages):
                    zero.append((group, advantages))
                else:
                    kept.append((group, advantages))
        if not adv.skip_zero_advantage:
            break
    fill = zero[: max(0, need - len(kept))]
    if fill:
        logger.warning(
            f"only {len(kept)} of {need} groups had a learning signal after {batch.rounds} round(s); "
            f"filling the batch with {len(fill)} zero-advantage group(s)"
        )
    kept += fill
    batch.skipped = len(zero) - len(fill)
    batch.groups = [g for g, _ in kept]
    batch.advantages = [a for _, a in kept]
    return batch


def build_samples(batch: Batch, truncated: str) -> list[dict]:
    samples = []
    for group, advantages in zip(batch.groups, batch.advantages, strict=True):
        for r, a in zip(group.rollouts, advantages, strict=True):
            mask = [False] * len(r.completion_mask) if truncated == "mask" and r.truncated else r.completion_mask
            samples.append(make_sample(r.prompt_ids, r.completion_ids, r.logprobs, a, mask))
    return samples


def write_rank_files(config: OrchestratorConfig, step: int, per_rank: list) -> None:
    from prime_rl.protocol.records import write_rank_file

    for rank, micro_batches in enumerate(per_rank):
        write_rank_file(config.output_dir, step, rank, micro_batches)


def step_metrics(batch: Batch, times: dict[str, float], step: int) -> dict[str, Any]:
    rollouts = batch.rollouts
    rewards = [r.reward for r in rollouts]
    group_rewards = [[r.reward for r in g.rollouts] for g in batch.groups]
    best = max(rewards)
    seq_lens = [r.num_tokens for r in rollouts]
    model_tokens = [sum(r.completion_mask) for r in rollouts]
    weight_steps = [r.weight_step for r in rollouts]
    gaps = [step - w for w in weight_steps]
    tokens = sum(seq_lens)
    # Scoring overlaps generation (see generate_batch), so time/score is not part of this sum.
    generation = sum(times.get(k, 0.0) for k in ("generate", "wait_weights", "update_weights"))
    metrics: dict[str, Any] = {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        # Share of groups that solved the task in every rollout / in none (reward at the max 1.0, or 0).
        "solve_all": statistics.fmean(all(x >= max(1.0, best) for x in g) for g in group_rewards),
        "solve_none": statistics.fmean(all(x <= 0.0 for x in g) for g in group_rewards),
        "seq_len_mean": statistics.fmean(seq_lens),
        "seq_len_max": max(seq_lens),
        "completion_len_mean": statistics.fmean(model_tokens),
        "completion_len_max": max(model_tokens),
        "turns_mean": statistics.fmean(r.turns for r in rollouts),
        "truncated_fraction": statistics.fmean(r.truncated for r in rollouts),
        "weight_step": min(weight_steps),
        "weight_step_max": max(weight_steps),
        "off_policy_gap": max(gaps),
        "off_policy_gap_mean": statistics.fmean(gaps),
        "skipped_groups": batch.skipped,
        "sample_rounds": batch.rounds,
        "samples": len(rollouts),
        "tokens": tokens,
        "tokens_per_s": tokens / max(times["step"], 1e-9),
        "overhead_fraction": max(0.0, times["step"] - generation) / max(times["step"], 1e-9),
        **{f"time/{key}": value for key, value in times.items() if key != "served_at"},
    }
    if "served_at" in times:  # wall clock when the servers answered with new weights (a timestamp, no duration)
        metrics["weights_served_at"] = times["served_at"]
    for name in sorted({k for r in rollouts for k in r.metrics}):
        values = [r.metrics[name] for r in rollouts if name in r.metrics]
        metrics[f"reward/{name}"] = statistics.fmean(values)
    return metrics


def checkpoint(config: OrchestratorConfig, state: Progress, step: int, data: DataStream, rng) -> None:
    """Record the progress when about to produce `step` (right after step - 1's rollouts are written)."""
    state.step, state.examples_drawn, state.rng_state = step, data.drawn, rng.getstate()
    if config.ckpt is not None:
        save_checkpoint(config.output_dir, state, config.ckpt, config.max_steps)


def drop_stale_rollouts(config: OrchestratorConfig, start: int) -> None:
    """On resume, rollouts of steps >= start from the interrupted run must not reach the trainer."""
    for step in list_steps(rollouts_dir(config.output_dir)):
        if step >= start:
            import shutil

            shutil.rmtree(rollout_step_dir(config.output_dir, step), ignore_errors=True)


async def orchestrate(config: OrchestratorConfig) -> None:
    env = load_environment(config.env.id, **config.env.args)
    resumed = load_checkpoint(config.output_dir, config.ckpt.resume_step if config.ckpt else None)
    state = resumed or Progress()
    if resumed is not None:
        drop_stale_rollouts(config, state.step)
    elif removed := clear_previous_run(config.output_dir):
        logger.warning(removed)
    data = DataStream(env, config.seed, skip=state.examples_drawn)
    rng = new_rng(config.seed, resumed)
    source = RolloutSource(env, config.env.id, config.sampling, config.seq_len, load_tokenizer(env, config.model.name),
                           config.max_turns)  # fmt: skip
    wandb = build_wandb(config)
    progress = ProgressLine(config.progress, config.max_steps)
    async with InferenceClient(config.client, config.model.name) as client:
        with (
            closing(MetricsWriter(config.output_dir, "orchestrator", state.step)) as metrics,
            closing(wandb),
            closing(progress),
        ):
            with Heartbeat(config.output_dir, "orchestrator") as heartbeat:
                await client.wait_for_servers(config.client.health_timeout)
                if resumed is None:
                    checkpoint(config, state, 0, data, rng)
                for step in range(state.step, config.max_steps):
                    heartbeat.step = progress.step = step
                    times: dict[str, float] = {}
                    start = time.perf_counter()

                    await wait_for_policy(client, config, step, times)
                    batch = await generate_batch(client, source, data, config, rng, progress)
                    times |= batch.times
                    with timer(times, "pack"):
                        per_rank = pack_micro_batches(
                            build_samples(batch, config.advantage.truncated),
                            config.seq_len,
                            config.num_train_workers,
                            config.sampling.temperature,
                        )
                    with timer(times, "write"):
                        write_rank_files(config, step, per_rank)
                    times["step"] = time.perf_counter() - start
                    m = step_metrics(batch, times, step)
                    state.total_samples += m["samples"]
                    state.total_tokens += m["tokens"]
                    # At once: a restart must not redo a step whose rollouts the trainer may have read.
                    checkpoint(config, state, step + 1, data, rng)
                    m |= {"total_samples": state.total_samples, "total_tokens": state.total_tokens}
                    metrics.log(step, m)
                    wandb.log(step, m)
                    progress.clear()
                    logger.info(
                        f"step {step} | reward {m['reward_mean']:.3f} | {m['tokens_per_s']:.0f} tok/s | "
                        f"weight_step {m['weight_step']} (gap {m['off_policy_gap']}) | "
                        f"gen {times['generate']:.2f}s wait {times.get('wait_weights', 0):.2f}s | {times['step']:.2f}s"
                    )
                    logger.debug(f"step {step} metrics: {m}")
                if config.weight_transfer == "broadcast":  # the trainer sends up to max_steps - 1: take them all
                    await relay_broadcasts(client, config, await client.server_step(), config.max_steps - 1, {})
    logger.info(f"done: wrote rollouts for {config.max_steps} steps to {config.output_dir}")


def run(config: OrchestratorConfig) -> None:
    # torch (for the rank-file records) loads here: after config parsing, and not inside step 0's timings.
    import prime_rl.protocol.records  # noqa: F401

    asyncio.run(orchestrate(config))


def main() -> None:
    config = parse_config(OrchestratorConfig, prog="orchestrator")
    setup_logging("orchestrator", config.output_dir, config.log.level, config.log.file)
    try:
        with RunLock(config.output_dir, "orchestrator"):
            write_run_config(config, "orchestrator", config.output_dir)
            run(config)
    except (
        WaitTimeout,
        WriterDead,
        InferenceError,
        EnvError,
        SampleTooLong,
        SinkError,
        CheckpointError,
        RunLocked,
        DiskFull,
    ) as e:
        logger.error(str(e))
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
