"""RL trainer entrypoint: read packed rollouts, take one FSDP2 optimizer step, publish HF weights.

Step n (docs/design.md §3): every rank waits for `rollouts/step_n/rank_{r}.safetensors`, runs forward/backward over its
micro batches (gradient accumulation), the ranks clip and step AdamW together, and rank 0 writes
`weights/step_{n+1}` for inference. The loss is in `loss.py`, the packed forward in `model.py`.

    trainer @ trainer.toml                                               # one process
    torchrun --nproc-per-node 2 src/prime_rl/entrypoints/trainer.py @ trainer.toml
"""

from __future__ import annotations

import functools
import logging
import os
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn
from torch.optim import Optimizer
from transformers import AutoConfig

from prime_rl.configs.trainer import DataConfig, LossConfig, TrainerConfig
from prime_rl.protocol import (
    Heartbeat,
    checkpoint_due,
    doing,
    is_stable,
    prune_rollouts,
    rank_file,
    wait_for_rank_file,
    weights_dir,
)
from prime_rl.protocol.records import read_rank_file
from prime_rl.trainer import service, startup
from prime_rl.trainer.broadcast import WeightSender
from prime_rl.trainer.ckpt import Progress
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.fake_data import fake_micro_batches
from prime_rl.trainer.logprobs import PolicyOutput
from prime_rl.trainer.micro_batch import MicroBatch
from prime_rl.trainer.parallel import Dist, all_reduce
from prime_rl.trainer.rl.bench import print_bench_table
from prime_rl.trainer.rl.loss import MASK_RULES, load_custom_loss, policy_loss, sample_index, token_lag
from prime_rl.trainer.rl.parity import SampledMismatch, score_canaries
from prime_rl.trainer.step import LossFn, Peak, Reported, StepStats, step_metrics
from prime_rl.trainer.step import train_step as optimize
from prime_rl.trainer.weights import prune_weights, save_weights
from prime_rl.utils.metrics import MetricsWriter
from prime_rl.utils.process import StopRequested
from prime_rl.utils.timer import timer

logger = logging.getLogger("prime_rl")


def run(config: TrainerConfig, hb: Heartbeat) -> None:
    """The steps; `hb` beats from before the imports (the entrypoint): peers and the launcher tell a trainer
    loading a 70B model from a dead one."""
    rank = int(os.environ.get("RANK", 0))
    sampled = SampledMismatch(config, rank)  # the parity gate's sampled tokens, collected by the loss
    loss_fn = rl_loss(config.loss, sampled)  # a custom loss is imported here, once, from the config: before the model
    with ExitStack() as stack:
        with doing("loading the model", long=True):
            state = stack.enter_context(service.training(config, config.max_steps))
            dist = state.dist
            progress = resume(config, state) or Progress()
            sender = (
                WeightSender(config, state.model, state.files, dist)
                if config.weight_transfer.type == "broadcast"
                else None
            )
            if sender is not None:
                stack.callback(sender.close)  # before the trainer's own group goes
        metrics = (
            MetricsWriter(config.output_dir, "trainer", progress.step, config.prometheus) if dist.is_main else None
        )
        logger.info(f"training {config.model.name} on {dist.world_size} rank(s), device {dist.device.type}")

        history = []
        carried: dict[str, float] = {}  # the checkpoint written after the previous step: in this step's record
        for step in range(progress.step, config.max_steps):
            times, carried = carried, {}
            start = time.perf_counter()
            micro_batches = load_micro_batches(config, step, dist, times)
            if micro_batches is None:
                service.stop_on_signal("trainer", config, state, progress, config.max_steps)
            score_canaries(config, state.model, dist.device, step, dist.is_main)  # weights: step n (a gate step?)
            with timer(times, "train"):
                stats = train_step(state.model, state.optimizer, micro_batches, config, dist, loss_fn, step)
                lr = state.scheduler.get_last_lr()[0]
                state.scheduler.step()
            sampled.write(step)  # at a gate step: this rank's on-policy tokens, for the orchestrator's gate
            optimized_at = time.time()  # when the new policy exists (the weight plane's clock starts)
            progress = Progress(step + 1, progress.tokens + stats.num_tokens, progress.samples + stats.num_samples)
            if not config.bench:
                publish(config, state, progress, times, sender)
            times["step"] = time.perf_counter() - start
            record = step_metrics(stats, times, lr, progress) | {"optimized_at": optimized_at}
            history.append(record)
            hb.finished(step)
            if dist.is_main:
                metrics.log(step, record)
                log_step(step, record)
            if not config.bench:  # after the record: see `checkpoint`
                checkpoint(config, state, progress, carried)
        service.finish_checkpoint(config, state, config.max_steps)  # the last one, written in the background
        if metrics is not None:
            metrics.close()
        if config.bench and dist.is_main:
            print_bench_table(history, state.model, config, dist)
        written = "benchmark, no weights written" if config.bench else f"weights in {config.output_dir / 'weights'}"
        logger.info(f"done: {config.max_steps} steps, {written}")


def resume(config: TrainerConfig, state: service.Training) -> Progress | None:
    """Restore `--ckpt.resume-step` (None = fresh start); make sure `weights/step_N` exists for the orchestrator."""
    step = service.resume_step(config)
    if step is None:
        return None
    progress = service.load(config, state, step)
    # An orchestrator resuming at step N waits for weights/step_N (pruning keeps it, but it may be gone).
    if step > 0 and not is_stable(weights_dir(config.output_dir, step)):
        save_weights(state.model, state.files, config.output_dir, step)
    logger.info(f"resumed from checkpoints/step_{step} ({progress.tokens} tokens, {progress.samples} samples so far)")
    return progress


def publish(
    config: TrainerConfig, state: service.Training, progress: Progress, times: dict, sender: WeightSender | None
) -> None:
    """After a step: weights for inference.

    With a broadcast `sender` the weights go over the process group, and `weights/step_n` is written only
    with a checkpoint (a resumed orchestrator loads it) and at the last step (for eval; never broadcast)."""
    ckpt = config.ckpt
    due = ckpt is not None and checkpoint_due(progress.step, config.max_steps, ckpt.interval)
    last = progress.step == config.max_steps  # no rollouts are sampled from the last weights: disk only
    if sender is not None and not last:
        with timer(times, "broadcast_weights"):
            sender.send(state.model, progress.step)
    if sender is None or due or last:
        with timer(times, "save_weights"):
            save_weights(state.model, state.files, config.output_dir, progress.step)


def checkpoint(config: TrainerConfig, state: service.Training, progress: Progress, times: dict) -> None:
    """After the step's metrics record: a checkpoint when due, and pruning of what nobody needs any more. Never
    before the record: a kill between the two would leave a checkpoint past a step whose record is lost (the
    restart starts after it). Its time (`time/save_ckpt`) is in the next step's record."""
    service.checkpoint_if_due(config, state, progress, config.max_steps, times)
    if state.dist.is_main:
        prune_old_steps(config, progress.step - 1)


def load_micro_batches(config: TrainerConfig, step: int, dist: Dist, times: dict) -> list[MicroBatch] | None:
    """This rank's micro batches of `step`, or None when the run stops before it (a stop signal: every rank
    agrees, also one that had its data); every rank must hold the same number (checked, not hung on).

    `times` gets `wait` (for the orchestrator's rank file) and `load_data` (reading and checking it)."""
    path = None
    if not config.data.fake:
        with timer(times, "wait"):
            try:
                path = wait_for_rank_file(
                    config.output_dir, step, dist.rank, config.data.timeout, config.data.heartbeat_timeout
                )
            except StopRequested:
                pass
    if service.stop_agreed(dist):
        return None
    if config.data.fake:
        return generated_micro_batches(config.data, config.model.name, config.seed, step, dist)
    with timer(times, "load_data"):
        return _read_micro_batches(config, step, dist, path)


def _read_micro_batches(config: TrainerConfig, step: int, dist: Dist, path: Path) -> list[MicroBatch]:
    try:
        micro_batches = [MicroBatch.from_row(row) for row in read_rank_file(path, step, dist.rank)]
    except ValueError as e:  # its message names the file
        raise TrainerError(str(e)) from None
    if dist.is_main and rank_file(config.output_dir, step, dist.world_size).exists():
        raise TrainerError(
            f"rollouts of step {step} are split over more than {dist.world_size} ranks: the orchestrator's "
            f"num_train_workers must equal the trainer world size ({dist.world_size})"
        )
    most, neg_fewest = all_reduce([len(micro_batches), -len(micro_batches)], dist.device, op="max")
    if most != -neg_fewest:
        raise TrainerError(
            f"step {step}: ranks hold between {-neg_fewest:.0f} and {most:.0f} micro batches; the orchestrator "
            "must pad every rank to the same count (FSDP collectives run once per micro batch)"
        )
    if most == 0:
        raise TrainerError(f"step {step}: the rank files hold no micro batches")
    return micro_batches


def generated_micro_batches(f: DataConfig, model: str, seed: int, step: int, dist: Dist) -> list[MicroBatch]:
    """`data.fake`: this rank's generated micro batches of `step`, over `model`'s vocabulary."""
    vocab = AutoConfig.from_pretrained(model).vocab_size
    rows = fake_micro_batches(
        step, dist.rank, f.fake_micro_batches, f.fake_seq_len, f.fake_min_len, f.fake_max_len, vocab, seed
    )
    return [MicroBatch.from_row(row) for row in rows]


def train_step(
    model: nn.Module,
    optimizer: Optimizer,
    micro_batches: list[MicroBatch],
    config: TrainerConfig,
    dist: Dist,
    loss_fn: LossFn | None = None,
    step: int | None = None,
) -> StepStats:
    """One optimizer step of the RL loss (`loss.py`) over this rank's micro batches (`step.train_step`);
    `loss_fn` = `rl_loss(config.loss)`, built once per run (built here when not given). `step` is the trained
    step n (the micro batches are rollouts/step_n): the token lags (n − each token's policy step) are measured
    and max_token_lag applied against it; None: no lag is measured or masked."""
    c = config.loss
    loss_fn = functools.partial(loss_fn or rl_loss(c), step=step)
    entropy_grad, share = c.entropy_coef > 0, config.share_prompts
    return optimize(model, optimizer, micro_batches, dist, loss_fn, config.optim.max_norm, c.norm, entropy_grad, share)


def rl_loss(c: LossConfig, sampled: SampledMismatch | None = None) -> LossFn:
    """The step's loss callback: `policy_loss` on the policy's logprobs, reporting per loss token the entropy,
    mismatch KL, fraction clipped and fraction masked (any rule, and each enabled rule: `is_masked/<rule>`),
    per environment of the micro batch (`mb.env_names`) the same means over that environment's loss tokens
    (`mismatch_kl/<env>`, `is_masked/<env>`, `entropy/<env>`), and, given the trained `step`, the lag of the loss
    tokens whose policy step is known (`token_lag_mean`, `token_lag_max`). A custom loss is imported here
    (TrainerError when it does not import). `sampled` gets each gate step's on-policy tokens (trainer/rl/parity.py)."""
    custom = load_custom_loss(c.import_path) if c.type == "custom" else None

    def loss(
        out: PolicyOutput, mb: MicroBatch, mask: torch.Tensor, scale: float, step: int | None = None
    ) -> tuple[torch.Tensor, dict[str, Reported]]:
        device = mask.device
        samples = sample_index(mb.cu_seqlens.to(device), mb.num_tokens)
        inference_logprobs, advantages = mb.inference_logprobs.to(device), mb.advantages.to(device)
        lag = token_lag(mb.policy_steps.to(device), step) if step is not None and mb.policy_steps.numel() else None
        terms = policy_loss(
            out.logprobs, inference_logprobs, advantages, mask, samples, c, scale, out.entropy, custom, lag
        )
        if sampled is not None and sampled.active(step):
            log_ratio = torch.where(mask, out.logprobs.detach() - inference_logprobs, 0.0)
            sampled.add(mb, log_ratio, mask, samples, step)
        entropy = torch.where(mask, out.entropy.detach(), 0.0)
        reported = {
            "loss": terms.loss_sum,
            "entropy": entropy.sum(),
            "mismatch_kl": terms.mismatch_kl_sum,
            "clip_frac": terms.clipped.float(),
            "is_masked": terms.masked.sum().float(),
            **{f"is_masked/{rule}": m.sum().float() for rule, m in terms.rule_masks.items()},
        }
        if step is not None:  # every rank reports them, with or without policy steps
            reported |= lag_metrics(lag, mask)
        per_token = {"mismatch_kl": terms.mismatch_kl, "is_masked": terms.masked.float(), "entropy": entropy}
        return terms.loss, reported | per_env(mb, samples, mask, per_token)

    return loss


def lag_metrics(lag: torch.Tensor | None, mask: torch.Tensor) -> dict[str, Reported]:
    """`token_lag_mean` (a sum over, and the count of, the loss tokens whose policy step is known) and
    `token_lag_max` (a Peak; −inf when none): a micro batch without policy steps (`lag` None) has none."""
    if lag is None:
        lag = torch.full_like(mask, -1, dtype=torch.long)
    known = mask & (lag >= 0)
    values = torch.where(known, lag, 0).float()
    peak = torch.where(known, lag.float(), float("-inf")).max()
    return {"token_lag_mean": (values.sum(), known.sum().float()), "token_lag_max": Peak(peak)}


def per_env(
    mb: MicroBatch, samples: torch.Tensor, mask: torch.Tensor, per_token: dict[str, torch.Tensor]
) -> dict[str, Reported]:
    """(sum, loss tokens) per metric and environment of `mb.env_names` (every env, so every rank has the same
    keys; the step leaves out an env without loss tokens). An env named like a mask rule gets `env:` before it."""
    if not mb.env_names or not mb.sample_env.numel():
        return {}
    token_env = mb.sample_env.to(mask.device).long()[samples]
    out = {}
    for i, name in enumerate(mb.env_names):
        where = mask & (token_env == i)
        count = where.sum().float()
        label = f"env:{name}" if name in MASK_RULES else name
        for key, values in per_token.items():
            out[f"{key}/{label}"] = (torch.where(where, values, 0.0).sum(), count)
    return out


def prune_old_steps(config: TrainerConfig, step: int) -> None:
    """Drop weights no reader can still need, and rollouts every rank has read (all are past step `step`)."""
    prune_weights(config.output_dir, keep=config.keep_weights or config.async_level + 1)
    prune_rollouts(config.output_dir, step, config.data.keep_rollouts, resumable=config.ckpt is not None)


def log_step(step: int, m: dict) -> None:
    logger.info(
        f"step {step} | loss {m['loss']:.4g} | entropy {m['entropy']:.3g} | mismatch_kl {m['mismatch_kl']:.2g} | "
        f"grad_norm {m['grad_norm']:.3g} | {m['tokens_per_s']:.0f} tok/s | {m['time/step']:.2f}s"
    )


if __name__ == "__main__":
    startup.run_as_script(__file__, "prime_rl.entrypoints.trainer")
