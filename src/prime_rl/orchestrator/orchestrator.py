"""The `orchestrator` entrypoint: environments → rollouts → advantages → packed rank files (docs/design.md §3, §6).

Before the first step (`open_loop`): environments, servers, teacher, sinks; a fresh run's servers that hold an
earlier run's weights reload their base weights (policy.py `start_from_the_base`).

For each step n (`run_step`):
1. The servers' /health: the weight step each holds.
2. `wait_for_policy` (policy.py): every live server samples from weights no older than n - async_level;
   each rollout records the weight step that sampled it, and the staleness rule (staleness.py) says which
   ones step n may use.
3. The step's groups with their advantages: `loop.batches.take(n)` (stream.py: `Barrier`, or `RolloutStream`
   in continuous mode, `max_inflight` set).
4. `build_samples` + `pack_micro_batches` + `write_rank_files`: one atomic `rollouts/step_n/rank_r.safetensors`
   per trainer rank.
5. `step_metrics`: one line in metrics/orchestrator.jsonl (and W&B, with the servers' numbers), one INFO line;
   then the checkpoint for step n + 1.
Beside the step, as observers (observer.py), hooked in between: the parity gate (parity.py), the evals
(`[[eval]]`, evaluation.Evals: at steps 0, interval, ... on the same servers, and on the trainer's final weights
at the end; metrics/eval.jsonl) and the batches' window metrics.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager, closing
from dataclasses import dataclass

from prime_rl.configs.orchestrator import OrchestratorConfig
from prime_rl.envs import EnvError
from prime_rl.orchestrator.batch import Batch, EnvMix, build_mix, build_samples, step_metrics
from prime_rl.orchestrator.ckpt import CheckpointError, Progress, load_checkpoint, new_rng, save_checkpoint
from prime_rl.orchestrator.distill import Teacher, TeacherMismatch, check_vocabulary
from prime_rl.orchestrator.evaluation import Evals
from prime_rl.orchestrator.observer import Observers
from prime_rl.orchestrator.packing import SampleTooLong, pack_micro_batches
from prime_rl.orchestrator.parity import ParityGate
from prime_rl.orchestrator.policy import relay_broadcasts, start_from_the_base, wait_for_policy
from prime_rl.orchestrator.servers.client import InferenceClient, InferenceError
from prime_rl.orchestrator.servers.fleet import FleetFile
from prime_rl.orchestrator.servers.metrics import ServerMetrics
from prime_rl.orchestrator.servers.weights import inflight_ask
from prime_rl.orchestrator.sinks import NoSink, ProgressLine, SinkError, WandbSink, build_wandb
from prime_rl.orchestrator.staleness import Staleness
from prime_rl.orchestrator.stream import Barrier, RolloutStream
from prime_rl.protocol import (
    DiskFull,
    Heartbeat,
    RunLocked,
    WaitTimeout,
    WriterDead,
    doing,
    orchestrator_checkpoint_file,
    prepare_output_dir,
    ticking,
)
from prime_rl.protocol.records import PackedRow, write_rank_file
from prime_rl.utils.metrics import MetricsWriter
from prime_rl.utils.process import StopRequested, catch_stop_signals, stop_requested
from prime_rl.utils.timer import timer

logger = logging.getLogger("prime_rl")


@dataclass(frozen=True)
class Loop:
    """What every step of a run uses: opened once by `open_loop`, closed when the run ends."""

    config: OrchestratorConfig
    state: Progress
    client: InferenceClient
    mix: EnvMix
    rng: random.Random  # checkpointed: per-request seeds
    batches: Barrier | RolloutStream  # the step's groups: `take(step)` (stream.py)
    observers: Observers  # beside the step: the parity gate, the evals, the batches' window metrics
    evals: Evals  # also run once more on the trainer's final weights (`finish`)
    staleness: Staleness
    progress: ProgressLine
    heartbeat: Heartbeat
    metrics: MetricsWriter
    wandb: NoSink | WandbSink


def write_rank_files(config: OrchestratorConfig, step: int, per_rank: list[list[PackedRow]]) -> None:
    for rank, micro_batches in enumerate(per_rank):
        write_rank_file(config.output_dir, step, rank, micro_batches)


def checkpoint(config: OrchestratorConfig, state: Progress, step: int, mix: EnvMix, rng) -> None:
    """Record the progress when about to produce `step` (right after step - 1's rollouts are written)."""
    state.step, state.rng_state, state.env_picks = step, rng.getstate(), mix.picks
    state.env_drawn = {slot.name: slot.data.drawn for slot in mix.slots}
    state.examples_drawn = sum(state.env_drawn.values())
    if config.ckpt is not None:
        save_checkpoint(config.output_dir, state, config.ckpt, config.max_steps)


# The failures that end the orchestrator with one log line and exit status 1 (the entry catches them).
ERRORS = (WaitTimeout, WriterDead, InferenceError, EnvError, SampleTooLong, SinkError, CheckpointError, RunLocked,
          DiskFull, TeacherMismatch)  # fmt: skip


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
    if said := prepare_output_dir(config.output_dir, resumed.step if resumed is not None else None):
        logger.warning(said)
    async with open_loop(config, state, resumed) as loop:
        for step in range(state.step, config.max_steps):
            await run_step(loop, step)
        await finish(loop)
    logger.info(f"done: wrote rollouts for {config.max_steps} steps to {config.output_dir}")


@asynccontextmanager
async def open_loop(config: OrchestratorConfig, state: Progress, resumed: Progress | None) -> AsyncIterator[Loop]:
    """The run's `Loop`, opened in order (environments, servers, teacher, sinks) and closed in reverse."""
    async with AsyncExitStack() as stack:
        # Beating from the start (an environment may take minutes to load); the event loop is the thread that
        # does the work, so a tick of it stamps progress: a blocked loop goes silent.
        heartbeat = stack.enter_context(Heartbeat(config.output_dir, "orchestrator", hang_timeout=config.hang_timeout))
        stack.enter_context(ticking())
        with doing("loading environments", long=True):
            mix = build_mix(config, state)
            evals = Evals(config, state.step)
            rng = new_rng(config.seed, resumed)
            wandb = build_wandb(config, resumed is not None)
        progress = ProgressLine(config.progress, config.max_steps)
        fleet = FleetFile(config.output_dir)  # the servers may change while the run goes on
        client = await stack.enter_async_context(
            InferenceClient(
                fleet.start(config.client, resumed is not None),
                config.model.name,
                adapter=config.model.adapter,
                inflight=inflight_ask(config),
                output_dir=config.output_dir,
                fleet=fleet,
            )
        )
        teacher = await open_teacher(config, stack)
        # Closed in reverse: the batches' requests in flight first, the sinks, the metrics file, the client last.
        metrics = stack.enter_context(
            closing(MetricsWriter(config.output_dir, "orchestrator", state.step, config.prometheus))
        )
        for sink in (wandb, progress, evals):
            stack.enter_context(closing(sink))
        held = await client.wait_for_servers(config.client.health_timeout)
        if resumed is None:
            await start_from_the_base(client, held)
        for source in [slot.source for slot in mix.slots] + [source for _, source, _ in evals.envs]:
            await stack.enter_async_context(source.serving(client))  # verifiers' episodes reach the pool by it
        if isinstance(wandb, WandbSink):  # the servers' own numbers (inference/*), read in the background
            wandb.servers = await stack.enter_async_context(ServerMetrics(client))
        if resumed is None:
            checkpoint(config, state, 0, mix, rng)
        source = Barrier if config.max_inflight is None else RolloutStream
        batches = source(client, mix, config, rng, teacher, progress)
        stack.push_async_callback(batches.close)
        observers = Observers(ParityGate(config, resumed is not None), evals, batches)
        yield Loop(config, state, client, mix, rng, batches, observers, evals, Staleness.of(config), progress,
                   heartbeat, metrics, wandb)  # fmt: skip


async def open_teacher(config: OrchestratorConfig, stack: AsyncExitStack) -> Teacher | None:
    """The teacher of on-policy distillation, its vocabulary checked against the student's and its servers
    healthy; None without [orchestrator.teacher]."""
    if config.teacher is None:
        return None
    with doing("checking the teacher's vocabulary", long=True):
        check_vocabulary(config.model.name, config.teacher.model)
    teacher = await stack.enter_async_context(Teacher(config.teacher, config.client, config.sampling))
    await teacher.wait()
    return teacher


async def run_step(loop: Loop, step: int) -> None:
    """Step n: the policy, the batch, its rank files, the metrics, the checkpoint for step n + 1."""
    config, state, client = loop.config, loop.state, loop.client
    loop.progress.step = step
    times: dict[str, float] = {}
    start = time.perf_counter()
    held = await client.server_step()  # the step's one /health round: the oldest weight step a server holds
    on_policy = await loop.observers.before_policy(client, step)  # a parity gate step samples from weights n
    await wait_for_policy(client, config, step, times, held, on_policy)
    await loop.observers.before_generate(client, step)
    batch = await loop.batches.take(step)
    times |= batch.times
    await loop.observers.after_batch(client, batch)
    write_batch(config, step, batch, times)
    times["step"] = time.perf_counter() - start
    m = step_metrics(batch, times, step) | await loop.observers.metrics(client, step, batch)
    m |= client.pool.take_inflight()  # per server: its in-flight limit and requests in flight, step means
    m["token_lag_bound"] = loop.staleness.lag  # what token_lag_max may reach
    state.total_samples += m["samples"]
    state.total_tokens += m["tokens"]
    m |= {"total_samples": state.total_samples, "total_tokens": state.total_tokens}
    # The record before the checkpoint: a kill between the two must not leave a checkpoint past a step whose
    # record is lost (the restart starts after it); then the checkpoint at once: a restart must not redo a step
    # whose rollouts the trainer may have read.
    loop.metrics.log(step, m)
    checkpoint(config, state, step + 1, loop.mix, loop.rng)
    log_step(loop, step, m, times)
    loop.heartbeat.finished(step)


def write_batch(config: OrchestratorConfig, step: int, batch: Batch, times: dict[str, float]) -> None:
    """The batch as trainer samples, packed into micro-batches, written as one rank file per trainer rank."""
    env_names = [e.label for e in config.env]
    with timer(times, "pack"):
        per_rank = pack_micro_batches(
            build_samples(batch, config.advantage.truncated, env_names),
            config.seq_len,
            config.num_train_workers,
            config.sampling.temperature,
            env_names=env_names,
            share_prompts=config.share_prompts,
        )
    with timer(times, "write"):
        write_rank_files(config, step, per_rank)


def log_step(loop: Loop, step: int, m: dict, times: dict[str, float]) -> None:
    loop.wandb.log(step, m)
    loop.progress.clear()
    logger.info(
        f"step {step} | reward {m['reward_mean']:.3f} | {m['tokens_per_s']:.0f} tok/s | "
        f"weight_step {m['weight_step']} (gap {m['off_policy_gap']}) | "
        f"token lag {m.get('token_lag_mean', 0):.1f}/{m.get('token_lag_max', 0)} (bound {m['token_lag_bound']}) | "
        f"gen {times['generate']:.2f}s wait {times.get('wait_weights', 0):.2f}s | "
        f"{times['step']:.2f}s"
    )
    logger.debug(f"step {step} metrics: {m}")


async def finish(loop: Loop) -> None:
    """After the last step: the batches' requests in flight cancelled, the trainer's remaining weight broadcasts,
    then the evaluation of its final weights, and the trainer's last records into the W&B run."""
    client, config = loop.client, loop.config
    await loop.batches.close()  # no step takes them: the servers are the final evaluation's
    if config.weight_transfer.type == "broadcast":  # the trainer sends up to max_steps - 1: take them all
        await relay_broadcasts(client, config, await client.server_step(), config.max_steps - 1, {})
    if config.eval:
        await loop.evals.final(client, config)
    if isinstance(loop.wandb, WandbSink):
        await loop.wandb.last_trainer_steps(config)


def run(config: OrchestratorConfig) -> None:
    asyncio.run(orchestrate(config))
