"""A step's batch (docs/design.md §3, §6): which examples, sampled and scored into groups with their advantages,
turned into trainer samples, and the step's metrics.

The step's groups, batch_size / rollouts_per_example of them, come from the environments mixed by `ratio`
(`EnvMix`: a group is one example of one env, never split):
- barrier mode (default, `generate_batch`): the step's requests start after the weight update and the
  step waits for all of them; with advantage.skip_zero_advantage, groups whose rewards are all equal are
  replaced by fresh examples (up to advantage.max_rounds rounds);
- continuous mode (`max_inflight` set): stream.py's `RolloutStream`.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prime_rl.configs.orchestrator import AdvantageConfig, EnvConfig, OrchestratorConfig
from prime_rl.envs import EnvError, Environment, EpisodeFailed, Example
from prime_rl.orchestrator.advantage import apply_length_penalty, apply_truncation, group_advantages, is_zero
from prime_rl.orchestrator.ckpt import Progress
from prime_rl.orchestrator.distill import Teacher, teacher_kl
from prime_rl.orchestrator.packing import rollout_sample
from prime_rl.orchestrator.rollout import Group, Rollout, RolloutSource, derive_seed
from prime_rl.orchestrator.servers.client import InferenceClient
from prime_rl.orchestrator.sinks import ProgressLine
from prime_rl.orchestrator.sources import build_source
from prime_rl.protocol.records import Sample
from prime_rl.utils.memory import peak_rss_gib
from prime_rl.utils.round_robin import SmoothRoundRobin
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
    failing: int = 0  # its groups that failed since the last one that did not (EpisodeFailed)

    @property
    def name(self) -> str:
        return self.config.label

    @property
    def token_budget(self) -> int:
        """Most model tokens of one rollout: the length penalty's scale."""
        return self.source.token_budget


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
    groups: list[Group]  # scored, each rollout carrying its advantage
    skipped: int = 0  # zero-advantage groups replaced by fresh examples
    rounds: int = 1
    stale: int = 0  # continuous mode: groups dropped for a policy older than policy.oldest_policy(step)
    times: dict[str, float] = field(default_factory=dict)

    @property
    def rollouts(self):
        return [r for g in self.groups for r in g.rollouts]


def advantages_of(group: Group, adv: AdvantageConfig, token_budget: int) -> list[float]:
    """Per rollout its advantage within the group, computed over units (Rollout.unit: an episode's trace whose
    samples share one reward; truncated when any of them is, its length their model tokens)."""
    keys = [r.unit if r.unit >= 0 else -1 - i for i, r in enumerate(group.rollouts)]  # -1 - i: a unit of its own
    units: dict[int, list[Rollout]] = {}
    for key, r in zip(keys, group.rollouts, strict=True):
        units.setdefault(key, []).append(r)
    members = list(units.values())
    rewards = [rs[0].reward for rs in members]
    rewards = apply_truncation(rewards, [any(r.truncated for r in rs) for rs in members], adv.truncated)
    lengths = [sum(sum(r.completion_mask) for r in rs) for rs in members]
    rewards = apply_length_penalty(rewards, lengths, token_budget, adv.length_penalty)
    per_unit = dict(zip(units, group_advantages(rewards, adv.std_norm, adv.baseline), strict=True))
    return [per_unit[key] for key in keys]


def group_seed(config: OrchestratorConfig, rng) -> int | None:
    """A request seed mixing sampling.seed with a draw of the orchestrator's RNG (checkpointed, so a resumed
    run draws the same); None when sampling.seed is unset."""
    return None if config.sampling.seed is None else derive_seed(config.sampling.seed, rng.randrange(2**31))


async def sample_group(client: InferenceClient, config: OrchestratorConfig, slot: EnvSlot, example: Example,
                       seed: int | None, teacher: Teacher | None = None) -> Group:  # fmt: skip
    """One scored group, each rollout carrying its advantage (scored as soon as it arrives, while other groups
    generate); with a `teacher`, per-token advantages from its scores of the rollouts (distill.py). A group whose
    episodes failed in the env's own code (EpisodeFailed) is replaced by one of the env's next example."""
    failed = 0
    while True:
        try:
            group = await slot.source.group(client, example, config.rollouts_per_example, seed)
            await slot.source.score(group)
            break
        except EpisodeFailed as e:
            failed, slot.failing = failed + 1, slot.failing + 1
            if slot.failing >= config.max_env_errors:
                last = f"{slot.name}: {slot.failing} groups in a row failed (max_env_errors); the last: {e}"
                raise EnvError(last) from None
            logger.warning(f"{slot.name}: a group failed ({slot.failing} in a row), drawing another example: {e}")
            example = slot.data.next()
    slot.failing, group.failed = 0, failed
    advantages = advantages_of(group, config.advantage, slot.token_budget)
    if teacher is not None:
        advantages = await teacher.distil(group, advantages)
    for rollout, advantage in zip(group.rollouts, advantages, strict=True):
        rollout.advantage = advantage
    return group


async def generate_batch(
    client: InferenceClient,
    mix: EnvMix,
    config: OrchestratorConfig,
    rng,
    progress: ProgressLine,
    teacher: Teacher | None = None,
) -> Batch:
    """Barrier mode: exactly batch_size / rollouts_per_example scored groups with their advantages."""
    need = config.batch_size // config.rollouts_per_example
    adv = config.advantage
    kept: list[Group] = []
    zero: list[Group] = []
    batch = Batch([], rounds=0)
    while len(kept) < need and batch.rounds < adv.max_rounds:
        batch.rounds += 1
        picks = [mix.next() for _ in range(need - len(kept))]
        draws = [(slot, slot.data.next(), group_seed(config, rng)) for slot in picks]
        with timer(batch.times, "generate"):
            scored = await progress.track([sample_group(client, config, *draw, teacher) for draw in draws])
        for group in scored:
            (zero if adv.skip_zero_advantage and is_zero(group.advantages) else kept).append(group)
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
    batch.groups = kept
    return batch


def build_samples(batch: Batch, truncated: str, env_names: list[str] = ()) -> list[Sample]:
    """The batch's rollouts as trainer samples, each tagged with its environment's index in `env_names` (a truncated
    rollout under truncated = "mask" trains on no token, its reward still in its group's baseline)."""
    index = {name: i for i, name in enumerate(env_names)}
    return [
        rollout_sample(r, index.get(g.env, -1), trained=not (truncated == "mask" and r.truncated))
        for g in batch.groups
        for r in g.rollouts
    ]


def step_metrics(batch: Batch, times: dict[str, float], step: int) -> dict[str, Any]:
    """The step's line in metrics/orchestrator.jsonl: rewards, lengths, policy gaps, counts and timings."""
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
        "weight_step_max": max(r.weight_step_max for r in rollouts),  # the newest policy behind any token
        "off_policy_gap": max(gaps),
        "off_policy_gap_mean": statistics.fmean(gaps),
        "skipped_groups": batch.skipped,
        "stale_groups": batch.stale,
        "mixed_policy_fraction": statistics.fmean(r.weight_step_max != r.weight_step for r in rollouts),
        "peak_rss_gib": peak_rss_gib(),  # the orchestrator's own (rollouts, environments, tokenizers)
        "sample_rounds": batch.rounds,
        "samples": len(rollouts),
        "tokens": tokens,
        "tokens_per_s": tokens / max(times["step"], 1e-9),
        "overhead_fraction": max(0.0, times["step"] - generation) / max(times["step"], 1e-9),
        **{f"time/{key}": value for key, value in times.items() if key != "served_at"},
    }
    if "served_at" in times:  # wall clock when the servers answered with new weights (a timestamp, no duration)
        metrics["weights_served_at"] = times["served_at"]
    if (kl := teacher_kl(rollouts)) is not None:  # distillation: mean log μ − log p_teacher per model token
        metrics["teacher_kl"] = kl
    return metrics | token_lags(rollouts, step) | breakdowns(batch, gaps)


def token_lags(rollouts: list[Rollout], step: int) -> dict[str, Any]:
    """Per-token lag over the model tokens: step − the policy step that sampled each token.

    `token_lag/{k}` counts the tokens k steps old (the histogram), beside `token_lag_mean` and `token_lag_max`.
    Example at step 5, tokens sampled by steps [4, 4, 5] → token_lag/0 = 1, token_lag/1 = 2, mean 0.67, max 1."""
    lags = [step - s for r in rollouts for s in r.token_steps if s >= 0]
    if not lags:
        return {}
    counts = Counter(lags)
    return {
        "token_lag_mean": statistics.fmean(lags),
        "token_lag_max": max(lags),
        **{f"token_lag/{k}": counts[k] for k in sorted(counts)},
    }


def breakdowns(batch: Batch, gaps: list[int]) -> dict[str, Any]:
    """Rollouts per off-policy gap, the mean of each score metric, and the same per environment."""
    rollouts = batch.rollouts
    metrics: dict[str, Any] = {}
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
        metrics[f"turns/{env}"] = statistics.fmean(r.turns for r in mine)
        metrics[f"truncated_fraction/{env}"] = statistics.fmean(r.truncated for r in mine)
        episodes = sum(g.episodes or len(g.rollouts) for g in batch.groups if g.env == env)
        metrics[f"samples_per_episode/{env}"] = len(mine) / episodes
        metrics[f"untrained_traces/{env}"] = sum(g.untrained for g in batch.groups if g.env == env)
        metrics[f"env_errors/{env}"] = sum(g.failed for g in batch.groups if g.env == env)
        for name in sorted({k for r in mine for k in r.metrics}):
            metrics[f"reward/{env}/{name}"] = statistics.fmean(r.metrics[name] for r in mine if name in r.metrics)
    return metrics
