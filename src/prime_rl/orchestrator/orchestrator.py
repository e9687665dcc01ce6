"""The `orchestrator` entrypoint: environments → rollouts → advantages → packed rank files (DESIGN §3, §6).

For each step n:
1. `save_checkpoint`: the progress when about to produce step n (every step; see protocol.checkpoints).
2. `wait_for_policy`: every live server must sample from weights no older than n - async_level (waiting
   for the trainer's `weights/step_k/STABLE` and relaying it with POST /update_weights to every server).
   So the orchestrator runs up to async_level steps ahead of the trainer; async_level 0 is on-policy.
   Each rollout records the weight step that sampled it.
3. The step's groups, batch_size / rollouts_per_example of them, from the environments mixed by `ratio`
   (`EnvMix`: a group is one example of one env, never split):
   - barrier mode (default, `generate_batch`): the step's requests start after the update and the step
     waits for all of them; with advantage.skip_zero_advantage, groups whose rewards are all equal are
     replaced by fresh examples (up to advantage.max_rounds rounds);
   - continuous mode (`max_inflight` set, `RolloutStream`): up to max_inflight rollouts are generating or
     waiting to be taken at all times, across weight updates (a server swaps weights between requests,
     never inside one); the step takes the first complete groups, dropping those sampled by a policy
     older than n - max_off_policy_steps (counted in `stale_groups`), so one long rollout no longer holds
     the whole step.
4. `build_samples` + `pack_micro_batches` + `write_rank_files`: one atomic `rollouts/step_n/rank_r.pt`
   per trainer rank.
5. `step_metrics`: one line in metrics/orchestrator.jsonl (and W&B), one INFO line.
Evals (`[[eval]]`, `Evals`) run at steps 0, interval, ... beside training on the same servers, and on the
trainer's final weights at the end; results in metrics/eval.jsonl.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import statistics
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from prime_rl.configs import parse_config
from prime_rl.configs.orchestrator import EnvConfig, EvalEnvConfig, OrchestratorConfig
from prime_rl.envs import EnvError, Environment, Example, load_environment
from prime_rl.orchestrator.advantage import apply_length_penalty, apply_truncation, group_advantages, is_zero
from prime_rl.orchestrator.ckpt import CheckpointError, Progress, load_checkpoint, new_rng, save_checkpoint
from prime_rl.orchestrator.client import InferenceClient, InferenceError
from prime_rl.orchestrator.packing import SampleTooLong, make_sample, pack_micro_batches
from prime_rl.orchestrator.pool import SmoothRoundRobin
from prime_rl.orchestrator.rollout import Group, RolloutSource, derive_seed, load_tokenizer
from prime_rl.orchestrator.sinks import ProgressLine, SinkError, build_wandb
from prime_rl.protocol import (
    DiskFull,
    Heartbeat,
    RunLock,
    RunLocked,
    WaitTimeout,
    WriterDead,
    clear_previous_run,
    heartbeat_age,
    is_stable,
    list_steps,
    orchestrator_checkpoint_file,
    rollout_step_dir,
    rollouts_dir,
    stable_steps,
    wait_for_weights,
    wait_until_async,
    weights_dir,
    weights_root,
)
from prime_rl.protocol.broadcast import marker_file, read_marker
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.metrics import MetricsWriter
from prime_rl.utils.process import PREEMPTED, StopRequested, catch_stop_signals, ignore_usr1, stop_requested
from prime_rl.utils.run_record import write_run_config
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


@dataclass
class EnvSlot:
    """One training environment: its config, sampler and example stream."""

    config: EnvConfig
    source: RolloutSource
    data: DataStream

    @property
    def name(self) -> str:
        return self.config.label

    @property
    def token_budget(self) -> int:
        """Most model tokens of one rollout (max_tokens × model turns): the length penalty's scale."""
        game = self.source.game
        return self.source.sampling.max_tokens * (game.turns if game is not None else 1)


def build_source(cfg: EnvConfig, config: OrchestratorConfig, sampling=None) -> tuple[Environment, RolloutSource]:
    env = load_environment(cfg.id, **cfg.args)
    tokenizer = load_tokenizer(env, config.model.name)
    source = RolloutSource(env, cfg.label, sampling or config.sampling, config.seq_len, tokenizer, config.max_turns,
                           cfg.max_tokens)  # fmt: skip
    return env, source


class EnvMix:
    """Which environment the next group comes from: smooth weighted round-robin over the `ratio`s, so any
    run of groups holds each env's share to within one group (3:1 over 200 groups is exactly 150/50)."""

    def __init__(self, slots: list[EnvSlot], picks: int = 0):
        self.slots = slots
        self._rotation = SmoothRoundRobin([s.config.ratio for s in slots])
        self.picks = 0
        for _ in range(picks):
            self.next()

    def next(self) -> EnvSlot:
        self.picks += 1
        return self.slots[self._rotation.pick()]


def build_mix(config: OrchestratorConfig, state: Progress) -> EnvMix:
    slots = []
    for i, cfg in enumerate(config.env):
        env, source = build_source(cfg, config)
        drawn = state.env_drawn.get(cfg.label, state.examples_drawn if i == 0 and not state.env_drawn else 0)
        slots.append(EnvSlot(cfg, source, DataStream(env, config.seed, skip=drawn)))
    return EnvMix(slots, state.env_picks)


@dataclass
class Batch:
    groups: list[Group]
    advantages: list[list[float]]
    skipped: int = 0  # zero-advantage groups replaced by fresh examples
    rounds: int = 1
    stale: int = 0  # continuous mode: groups dropped for a policy older than step - max_off_policy_steps
    times: dict[str, float] = field(default_factory=dict)

    @property
    def rollouts(self):
        return [r for g in self.groups for r in g.rollouts]


def advantages_of(group: Group, config: OrchestratorConfig, token_budget: int) -> list[float]:
    adv = config.advantage
    rollouts = group.rollouts
    rewards = apply_truncation([r.reward for r in rollouts], [r.truncated for r in rollouts], adv.truncated)
    lengths = [sum(r.completion_mask) for r in rollouts]
    rewards = apply_length_penalty(rewards, lengths, token_budget, adv.length_penalty)
    return group_advantages(rewards, adv.std_norm, adv.baseline)


def group_seed(config: OrchestratorConfig, rng) -> int | None:
    """A request seed mixing sampling.seed with a draw of the orchestrator's RNG (checkpointed, so a resumed
    run draws the same); None when sampling.seed is unset."""
    return None if config.sampling.seed is None else derive_seed(config.sampling.seed, rng.randrange(2**31))


async def sample_group(client: InferenceClient, config: OrchestratorConfig, slot: EnvSlot, example: Example,
                       seed: int | None) -> tuple[Group, list[float]]:  # fmt: skip
    """One scored group with its advantages (scored as soon as it arrives, while other groups generate)."""
    group = await slot.source.group(client, example, config.rollouts_per_example, seed)
    await slot.source.score(group)
    return group, advantages_of(group, config, slot.token_budget)


async def wait_for_policy(client: InferenceClient, config: OrchestratorConfig, step: int, times: dict) -> int:
    """Ensure every live server holds weights step >= step - async_level; return the oldest step held.

    `times` gets `wait_weights` (waiting for the trainer) and `update_weights` (the servers loading them)."""
    need = max(0, step - config.async_level)
    # Completions from older policies are thrown away and redone; in continuous mode those of a request
    # that was running when the update came are still usable up to max_off_policy_steps.
    client.floor = need if config.max_inflight is None else max(0, step - config.max_off_policy_steps)
    current = await client.server_step()
    if config.weight_transfer == "broadcast":
        current = await relay_broadcasts(client, config, current, need, times)
    if current >= need:
        return current
    logger.info(f"step {step}: servers hold weights step {current}, need >= {need}; waiting for the trainer")
    with timer(times, "wait_weights"):
        await wait_for_weights(config.output_dir, need, config.weights_timeout, config.heartbeat_timeout)
    # The trainer may have moved on while we waited: take the newest complete weights, never older than need,
    # and not newer than `step` where there is a choice (an orchestrator redoing a step after a restart
    # samples from the policy an uninterrupted run would have had).
    usable = [s for s in stable_steps(weights_root(config.output_dir)) if s >= need]
    newest = max([s for s in usable if s <= step] or usable)
    return await load_weights(client, config, newest, times)


async def load_weights(client: InferenceClient, config: OrchestratorConfig, step: int, times: dict) -> int:
    weight_dir = weights_dir(config.output_dir, step)
    with timer(times, "update_weights"):
        loaded = await client.update_weights(str(weight_dir))
    times["served_at"] = time.time()  # a timestamp, for the weight plane's latency (benchmarks/rl.py)
    if loaded != step:
        raise InferenceError(f"servers report weights step {loaded} after loading {weight_dir}")
    logger.info(f"servers now serve weights step {loaded}")
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
            await wait_until_async(
                lambda: pending(read_marker(out)) or is_stable(weights_dir(out, need)),
                f"the trainer's weight step {need} ({marker_file(out, need)} or {weights_dir(out, need)})",
                config.weights_timeout,
                output_dir=out,
                writer="trainer-rank0",
                heartbeat_timeout=config.heartbeat_timeout,
            )


async def generate_batch(
    client: InferenceClient, mix: EnvMix, config: OrchestratorConfig, rng, progress: ProgressLine
) -> Batch:
    """Barrier mode: exactly batch_size / rollouts_per_example scored groups with their advantages."""
    need = config.batch_size // config.rollouts_per_example
    adv = config.advantage
    kept: list[tuple[Group, list[float]]] = []
    zero: list[tuple[Group, list[float]]] = []
    batch = Batch([], [], rounds=0)
    while len(kept) < need and batch.rounds < adv.max_rounds:
        batch.rounds += 1
        picks = [mix.next() for _ in range(need - len(kept))]
        draws = [(slot, slot.data.next(), group_seed(config, rng)) for slot in picks]
        with timer(batch.times, "generate"):
            scored = await progress.track([sample_group(client, config, *draw) for draw in draws])
        for group, advantages in scored:
            (zero if adv.skip_zero_advantage and is_zero(advantages) else kept).append((group, advantages))
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


class RolloutStream:
    """Continuous mode: groups keep generating across steps and weight updates.

    At most `max_inflight` rollouts are started and not yet taken into a batch (generating, or finished
    and waiting), so the stream runs ahead of the trainer by a bounded amount. `take` hands a step the
    first complete groups in completion order; groups from a policy older than step - max_off_policy_steps
    are dropped. Examples in flight when the run stops are not replayed on resume (their draws are kept).
    """

    def __init__(self, client: InferenceClient, mix: EnvMix, config: OrchestratorConfig, rng):
        self.client, self.mix, self.config, self.rng = client, mix, config, rng
        self.size = config.rollouts_per_example
        self.held = 0  # rollouts started and not yet taken
        self.done: asyncio.Queue = asyncio.Queue()
        self.tasks: set[asyncio.Task] = set()

    def fill(self) -> None:
        while self.held + self.size <= self.config.max_inflight:
            slot = self.mix.next()
            draw = (slot, slot.data.next(), group_seed(self.config, self.rng))
            task = asyncio.create_task(sample_group(self.client, self.config, *draw))
            task.add_done_callback(self._finished)
            self.tasks.add(task)
            self.held += self.size

    def _finished(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled():
            self.done.put_nowait(task)

    async def take(self, step: int, progress: ProgressLine) -> Batch:
        need = self.config.batch_size // self.config.rollouts_per_example
        adv, oldest = self.config.advantage, step - self.config.max_off_policy_steps
        batch = Batch([], [])
        zero: list[tuple[Group, list[float]]] = []
        with timer(batch.times, "generate"):
            while len(batch.groups) < need:
                self.fill()
                task = await self.done.get()
                self.held -= self.size
                group, advantages = task.result()  # a failed group (server gone, env error) stops the run here
                if group.weight_step < oldest:
                    batch.stale += 1
                elif adv.skip_zero_advantage and is_zero(advantages) and batch.skipped < need * (adv.max_rounds - 1):
                    batch.skipped += 1
                    zero.append((group, advantages))
                else:
                    batch.groups.append(group)
                    batch.advantages.append(advantages)
                progress.note(len(batch.groups), need)
        self.fill()  # the next step's groups start generating now
        return batch

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


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
        "stale_groups": batch.stale,
        "mixed_policy_fraction": statistics.fmean(r.weight_step_max != r.weight_step for r in rollouts),
        "sample_rounds": batch.rounds,
        "samples": len(rollouts),
        "tokens": tokens,
        "tokens_per_s": tokens / max(times["step"], 1e-9),
        "overhead_fraction": max(0.0, times["step"] - generation) / max(times["step"], 1e-9),
        **{f"time/{key}": value for key, value in times.items() if key != "served_at"},
    }
    if "served_at" in times:  # wall clock when the servers answered with new weights (a timestamp, no duration)
        metrics["weights_served_at"] = times["served_at"]
    for gap in sorted(set(gaps)):
        metrics[f"off_policy_gap/{gap}"] = gaps.count(gap)  # rollouts per gap: the distribution
    for name in sorted({k for r in rollouts for k in r.metrics}):
        values = [r.metrics[name] for r in rollouts if name in r.metrics]
        metrics[f"reward/{name}"] = statistics.fmean(values)
    for env in sorted({g.env for g in batch.groups}):  # per environment: reward/<env>, groups/<env>, ...
        mine = [r for g in batch.groups if g.env == env for r in g.rollouts]
        metrics[f"reward/{env}"] = statistics.fmean(r.reward for r in mine)
        metrics[f"groups/{env}"] = sum(g.env == env for g in batch.groups)
        metrics[f"seq_len/{env}"] = statistics.fmean(r.num_tokens for r in mine)
        for name in sorted({k for r in mine for k in r.metrics}):
            metrics[f"reward/{env}/{name}"] = statistics.fmean(r.metrics[name] for r in mine if name in r.metrics)
    return metrics


def checkpoint(config: OrchestratorConfig, state: Progress, step: int, mix: EnvMix, rng) -> None:
    """Record the progress when about to produce `step` (right after step - 1's rollouts are written)."""
    state.step, state.rng_state, state.env_picks = step, rng.getstate(), mix.picks
    state.env_drawn = {slot.name: slot.data.drawn for slot in mix.slots}
    state.examples_drawn = sum(state.env_drawn.values())
    if config.ckpt is not None:
        save_checkpoint(config.output_dir, state, config.ckpt, config.max_steps)


class Evals:
    """`[[eval]]` environments evaluated during training, beside it, on the same servers.

    At step s with s % interval == 0 an env's evaluation starts as a background task (its requests share
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

    def start(self, client: InferenceClient, step: int, final: bool = False) -> None:
        for cfg, source, examples in self.envs:
            if final or step % cfg.interval == 0:
                task = asyncio.create_task(self._run(client, step, cfg, source, examples))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    async def _run(self, client, step, cfg: EvalEnvConfig, source: RolloutSource, examples: list[Example]) -> None:
        from prime_rl.eval.eval import EnvResult, sample_and_score

        start = time.perf_counter()
        groups = await sample_and_score(client, source, examples, cfg.rollouts_per_example, self.config.sampling.seed)
        result = EnvResult(cfg.label, step, groups).summary()
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


def drop_stale_rollouts(config: OrchestratorConfig, start: int) -> None:
    """On resume, rollouts of steps >= start from the interrupted run must not reach the trainer."""
    for step in list_steps(rollouts_dir(config.output_dir)):
        if step >= start:
            import shutil

            shutil.rmtree(rollout_step_dir(config.output_dir, step), ignore_errors=True)


async def orchestrate(config: OrchestratorConfig) -> None:
    """The run; with checkpoints on, a stop signal cancels it wherever it waits and it ends with
    StopRequested: the progress of the step in flight was saved when it began (its rollouts are redone)."""
    resumed = load_checkpoint(config.output_dir, config.ckpt.resume_step if config.ckpt else None)
    state = resumed or Progress()
    if config.ckpt is not None:
        task, loop = asyncio.current_task(), asyncio.get_running_loop()

        def cancel() -> None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:
                pass  # the loop has closed: the run is over anyway

        catch_stop_signals(cancel)
    try:
        await _orchestrate(config, state, resumed)
    except (asyncio.CancelledError, StopRequested):
        if (signal_name := stop_requested()) is None:
            raise
        saved = orchestrator_checkpoint_file(config.output_dir, state.step)
        raise StopRequested(
            f"stopped on {signal_name} during step {state.step}: its progress is in {saved} (the step is "
            "redone on resume); resume with --ckpt.resume-step latest"
        ) from None


async def _orchestrate(config: OrchestratorConfig, state: Progress, resumed: Progress | None) -> None:
    if resumed is not None:
        drop_stale_rollouts(config, state.step)
    elif removed := clear_previous_run(config.output_dir):
        logger.warning(removed)
    mix = build_mix(config, state)
    evals = Evals(config, state.step)
    rng = new_rng(config.seed, resumed)
    wandb = build_wandb(config)
    progress = ProgressLine(config.progress, config.max_steps)
    async with InferenceClient(config.client, config.model.name, adapter=config.model.adapter) as client:
        stream = RolloutStream(client, mix, config, rng) if config.max_inflight is not None else None
        with (
            closing(MetricsWriter(config.output_dir, "orchestrator", state.step)) as metrics,
            closing(wandb),
            closing(progress),
            closing(evals),
        ):
            with Heartbeat(config.output_dir, "orchestrator") as heartbeat:
                await client.wait_for_servers(config.client.health_timeout)
                if resumed is None:
                    checkpoint(config, state, 0, mix, rng)
                try:
                    for step in range(state.step, config.max_steps):
                        heartbeat.step = progress.step = step
                        times: dict[str, float] = {}
                        start = time.perf_counter()

                        await wait_for_policy(client, config, step, times)
                        evals.start(client, step)
                        if stream is None:
                            batch = await generate_batch(client, mix, config, rng, progress)
                        else:
                            batch = await stream.take(step, progress)
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
                        checkpoint(config, state, step + 1, mix, rng)
                        m |= {"total_samples": state.total_samples, "total_tokens": state.total_tokens}
                        metrics.log(step, m)
                        wandb.log(step, m)
                        progress.clear()
                        logger.info(
                            f"step {step} | reward {m['reward_mean']:.3f} | {m['tokens_per_s']:.0f} tok/s | "
                            f"weight_step {m['weight_step']} (gap {m['off_policy_gap']}) | "
                            f"gen {times['generate']:.2f}s wait {times.get('wait_weights', 0):.2f}s | "
                            f"{times['step']:.2f}s"
                        )
                        logger.debug(f"step {step} metrics: {m}")
                finally:
                    if stream is not None:
                        await stream.close()
                if config.weight_transfer == "broadcast":  # the trainer sends up to max_steps - 1: take them all
                    await relay_broadcasts(client, config, await client.server_step(), config.max_steps - 1, {})
                if config.eval:
                    await evals.final(client, config)
    logger.info(f"done: wrote rollouts for {config.max_steps} steps to {config.output_dir}")


def run(config: OrchestratorConfig) -> None:
    # torch (for the rank-file records) loads here: after config parsing, and not inside step 0's timings.
    import prime_rl.protocol.records  # noqa: F401

    asyncio.run(orchestrate(config))


def main() -> None:
    config = parse_config(OrchestratorConfig, prog="orchestrator")
    setup_logging("orchestrator", config.output_dir, config.log.level, config.log.file)
    ignore_usr1()  # until orchestrate() catches the stop signals (with checkpoints on)
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
    except StopRequested as e:
        logger.warning(str(e))
        raise SystemExit(PREEMPTED) from None


if __name__ == "__main__":
    main()
