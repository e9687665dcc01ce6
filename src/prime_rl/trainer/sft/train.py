"""`sft`: supervised fine-tuning with the RL trainer's model, FSDP, checkpoint and weight-export code.

Each step takes the next `batch_size` samples of the (seeded, per-epoch shuffled) data, gives rank r
every world_size-th of them, packs them into rows of `seq_len`, and minimises the mean negative
log-likelihood of the completion tokens of the whole step:

    loss = −Σ_t m_t log π(x_t | sample prefix) / N,    N = completion tokens of the step (all ranks)

Writes `weights/step_n` (HF dirs, like RL), `checkpoints/step_n/trainer` (DCP), `metrics/sft.jsonl`
and `logs/sft.log` under `output_dir`.

    sft @ configs/sft/debug.toml
    torchrun --nproc-per-node 2 src/prime_rl/trainer/sft/train.py @ configs/sft/debug.toml
"""

from __future__ import annotations

import logging
import math
import os
import signal
import time
from dataclasses import dataclass

from prime_rl.protocol import DiskFull, RunLocked
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.parallel import run_lock
from prime_rl.trainer.sft.config import SFTConfig
from prime_rl.utils.config import parse_config, write_run_config
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.process import die_with_parent

logger = logging.getLogger("prime_rl")


def main() -> None:
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: never outlive the agent (it may be SIGKILLed)
        die_with_parent(signal.SIGKILL)
    config = parse_config(SFTConfig, prog="sft")
    rank = int(os.environ.get("RANK", 0))
    if rank == 0:
        setup_logging("sft", config.output_dir, config.log.level, config.log.file)
    else:
        setup_logging(f"sft-rank{rank}", None, "WARNING", to_file=False)
    try:
        with run_lock(config.output_dir, "sft", rank):
            if rank == 0:
                write_run_config(config, "sft", config.output_dir)
            run(config)
    except (TrainerError, RunLocked, DiskFull) as e:
        logger.error(str(e))
        raise SystemExit(1) from None


def run(config: SFTConfig) -> None:
    import torch
    from transformers import AutoTokenizer

    from prime_rl.trainer.ckpt import Progress, load_checkpoint
    from prime_rl.trainer.model import build_sharded
    from prime_rl.trainer.parallel import close_distributed, init_distributed, resolve_device
    from prime_rl.trainer.sft.data import build_samples
    from prime_rl.trainer.weights import build_model_files
    from prime_rl.utils.metrics import MetricsWriter
    from prime_rl.utils.timer import timer

    torch.manual_seed(config.seed)
    samples, truncated = build_samples(config.data, AutoTokenizer.from_pretrained(config.model.name), config.seq_len)
    max_steps = config.max_steps or config.epochs * math.ceil(len(samples) / config.batch_size)
    d = init_distributed(resolve_device(config.device))
    try:
        model, optimizer, scheduler = build_sharded(config, d, max_steps)
        files = build_model_files(config.model.name)  # every rank writes weight files in its dtype
        progress = Progress()
        resume_step = resolve_resume(config)
        if resume_step is not None:
            progress = load_checkpoint(config.output_dir, resume_step, model, optimizer, scheduler, d.rank)
            logger.info(f"resumed from checkpoints/step_{resume_step} (epoch {progress.epoch})")
        metrics = MetricsWriter(config.output_dir, "sft", progress.step) if d.is_main else None
        logger.info(
            f"sft of {config.model.name} on {len(samples)} samples ({truncated} truncated to {config.seq_len} "
            f"tokens), {max_steps} steps, {d.world_size} rank(s), device {d.device.type}"
        )
        for step in range(progress.step, max_steps):
            times: dict[str, float] = {}
            start = time.perf_counter()
            with timer(times, "data"):
                batch, epoch, position = step_batch(samples, progress, config, d)
            with timer(times, "train"):
                stats = sft_step(model, optimizer, batch, config, d)
                lr = scheduler.get_last_lr()[0]
                scheduler.step()
            progress = Progress(
                step + 1, progress.tokens + stats.num_tokens, progress.samples + stats.num_samples, epoch, position
            )
            publish(config, max_steps, model, optimizer, scheduler, progress, files, d, times)
            times["step"] = time.perf_counter() - start
            if d.is_main:
                record = step_metrics(stats, times, lr, progress)
                metrics.log(step, record)
                logger.info(
                    f"step {step} | loss {stats.loss:.4g} | grad_norm {stats.grad_norm:.3g} | epoch {epoch} | "
                    f"{record['tokens_per_s']:.0f} tok/s | {times['step']:.2f}s"
                )
        if metrics is not None:
            metrics.close()
        logger.info(f"done: {max_steps} steps, weights in {config.output_dir / 'weights'}")
    finally:
        close_distributed()


def resolve_resume(config: SFTConfig) -> int | None:
    from prime_rl.protocol import resolve_resume_step

    try:
        return resolve_resume_step(config.output_dir, config.ckpt and config.ckpt.resume_step, "trainer")
    except ValueError as e:
        raise TrainerError(str(e)) from None


def step_batch(samples: list, progress, config: SFTConfig, d):
    """This rank's packed rows of the next batch (every rank the same row count), and the data position after it."""
    from prime_rl.protocol.records import MicroBatch
    from prime_rl.trainer.parallel import all_reduce
    from prime_rl.trainer.sft.data import next_batch, pack_batch

    indices, epoch, position = next_batch(
        len(samples), config.batch_size, progress.epoch, progress.position, config.seed, config.data.shuffle
    )
    mine = [samples[i] for i in indices[d.rank :: d.world_size]]
    rows = pack_batch(mine, config.seq_len) if mine else []
    (most,) = all_reduce([len(rows)], d.device, op="max")
    rows += [MicroBatch.padding(8, 1.0) for _ in range(int(most) - len(rows))]  # FSDP collectives in lockstep
    return rows, epoch, position


@dataclass
class SFTStats:
    loss: float  # mean NLL per completion token
    grad_norm: float
    num_tokens: int  # all ranks, padding included
    num_loss_tokens: int
    num_samples: int
    peak_memory_gib: float


def sft_step(model, optimizer, micro_batches: list, config: SFTConfig, d) -> SFTStats:
    """Accumulate the NLL gradient over the micro batches, clip, and take one AdamW step."""
    import torch

    from prime_rl.trainer.model import forward_logprobs, sample_starts
    from prime_rl.trainer.parallel import all_reduce, set_micro_batch_sync
    from prime_rl.trainer.rl.train import _peak_memory_gib, _samples_with_loss

    masks = [(mb.loss_mask & ~sample_starts(mb)).to(d.device) for mb in micro_batches]
    local = [sum(mb.num_tokens for mb in micro_batches), sum(int(m.sum()) for m in masks)]
    local.append(sum(_samples_with_loss(mb.cu_seqlens, m) for mb, m in zip(micro_batches, masks, strict=True)))
    num_tokens, num_loss_tokens, num_samples = all_reduce(local, d.device)
    scale = d.world_size / max(num_loss_tokens, 1)  # × world_size undoes FSDP's gradient averaging

    if d.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(d.device)
    nll_sum = torch.zeros((), dtype=torch.float64, device=d.device)
    for i, (mb, mask) in enumerate(zip(micro_batches, masks, strict=True)):
        set_micro_batch_sync(model, d, last=i == len(micro_batches) - 1)
        logprobs = forward_logprobs(model, mb, d.device, where=mask).logprobs
        nll = torch.where(mask, -logprobs, 0.0).sum()
        (nll * scale).backward()
        nll_sum += nll.detach().double()

    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.max_norm)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if math.isfinite(grad_norm):
        optimizer.step()
    else:
        logger.warning(f"non-finite gradient norm ({grad_norm}); skipping this update")
    optimizer.zero_grad(set_to_none=True)
    (total_nll,) = all_reduce([nll_sum.item()], d.device)
    (peak,) = all_reduce([_peak_memory_gib(d.device)], d.device, op="max")
    return SFTStats(
        total_nll / max(num_loss_tokens, 1), grad_norm, int(num_tokens), int(num_loss_tokens), int(num_samples), peak
    )


def publish(config: SFTConfig, max_steps: int, model, optimizer, scheduler, progress, files, d, times) -> None:
    """Weights every `weights_interval` steps and at the end; checkpoints per `ckpt`; pruning of both."""
    from prime_rl.protocol import checkpoint_due, prune_checkpoints
    from prime_rl.trainer.ckpt import save_checkpoint
    from prime_rl.trainer.weights import prune_weights, save_weights
    from prime_rl.utils.timer import timer

    step, ckpt = progress.step, config.ckpt
    if checkpoint_due(step, max_steps, config.weights_interval):
        with timer(times, "save_weights"):
            save_weights(model, files, config.output_dir, step)
        if d.is_main and config.keep_weights:
            prune_weights(config.output_dir, config.keep_weights)
    if ckpt is not None and checkpoint_due(step, max_steps, ckpt.interval):
        with timer(times, "save_ckpt"):
            save_checkpoint(config.output_dir, step, model, optimizer, scheduler, progress, files, d.rank)
        if d.is_main:
            prune_checkpoints(config.output_dir, "trainer", ckpt.keep, max_steps, ckpt.interval)


def step_metrics(stats: SFTStats, times: dict[str, float], lr: float, progress) -> dict:
    from prime_rl.trainer.rl.train import shared_step_metrics

    return {"loss": stats.loss, "epoch": progress.epoch, **shared_step_metrics(stats, times, lr, progress)}


if __name__ == "__main__":
    main()
