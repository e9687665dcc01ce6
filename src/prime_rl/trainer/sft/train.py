"""`sft`: supervised fine-tuning on the trainer core RL uses (model, parallelize, step, checkpoints, weight export).

Each step takes the next `batch_size` samples of the (seeded, per-epoch shuffled) data, gives rank r
every world_size-th of them, packs them into rows of `seq_len`, and minimises the mean negative
log-likelihood of the completion tokens of the whole step:

    loss = −Σ_t m_t log π(x_t | sample prefix) / N,    N = completion tokens of the step (all ranks)

With `[val]`, the same loss on held-out rows every `val.interval` steps (`val/loss`), and with
`val.stop_below` the run ends at the first evaluation below it: a quality target rather than a step count,
which is what a run that feeds RL wants (when a small model leaves a loss plateau depends on the machine's
arithmetic; where it ends up should not).

Writes `weights/step_n` (HF dirs, like RL) and `weights/final` (a link to the step the run ended on),
`checkpoints/step_n/trainer` (DCP), `metrics/sft.jsonl` and `logs/sft.log` under `output_dir`.

    sft @ configs/sft/debug.toml
    torchrun --nproc-per-node 2 src/prime_rl/entrypoints/sft.py @ configs/sft/debug.toml
"""

from __future__ import annotations

import logging
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from transformers import AutoTokenizer

from prime_rl.configs.sft import SFTConfig
from prime_rl.protocol import check_resume_before_end, checkpoint_due, link_final_weights, run_dir
from prime_rl.trainer import service, startup
from prime_rl.trainer.ckpt import Progress
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.logprobs import PolicyOutput
from prime_rl.trainer.micro_batch import MicroBatch
from prime_rl.trainer.parallel import Dist
from prime_rl.trainer.prefix import shares_prompts
from prime_rl.trainer.sft.data import Sample, batch_epoch, build_samples, next_batch, pack_rank_rows
from prime_rl.trainer.sft.val import build_val_rows, evaluate_if_due, target_reached
from prime_rl.trainer.step import step_metrics, train_step
from prime_rl.trainer.weights import prune_weights, save_weights
from prime_rl.utils.console import LiveLine, eta, this_run
from prime_rl.utils.metrics import MetricsWriter, tail_metrics
from prime_rl.utils.plot import plot_runs
from prime_rl.utils.summary import ThisRun, sft_summary
from prime_rl.utils.timer import timer
from prime_rl.utils.wandb import MirroredMetrics, WandbError, open_run

logger = logging.getLogger("prime_rl")


def run(config: SFTConfig) -> None:
    started = time.time()
    try:
        tokenizer = AutoTokenizer.from_pretrained(config.model.name)
    except (OSError, ValueError) as e:  # not a hub id, no such path, no network: one line, like the model's
        raise TrainerError(f"cannot load the tokenizer of {config.model.name!r}: {e}") from None
    samples, truncated = build_samples(config.data, tokenizer, config.seq_len)
    max_steps = config.max_steps or config.epochs * math.ceil(len(samples) / config.batch_size)
    resumed_from = service.resume_step(config)
    check_resume_before_end(resumed_from, max_steps, config.output_dir)  # before the model loads
    with service.training(config, max_steps) as state:
        dist = state.dist
        share = sharing(config, state)
        val_rows = build_val_rows(config.val.data, config.seq_len, tokenizer, dist, share) if config.val else None
        progress = resume(config, state, resumed_from)
        metrics = MetricsWriter(config.output_dir, "sft", progress.step, config.prometheus) if dist.is_main else None
        if dist.is_main and config.wandb is not None:  # each record to W&B too (a resumed run: the same W&B run)
            metrics = wandb_metrics(config, metrics, resumed=progress.step > 0)
        logger.info(
            f"sft of {config.model.name} on {len(samples)} samples ({truncated} truncated to {config.seq_len} "
            f"tokens), {max_steps} steps, {dist.world_size} rank(s), device {dist.device.type}"
        )
        # The progress line, on rank 0's terminal only, from this run's newest metrics records.
        live = LiveLine(lambda: status_text(config.output_dir, max_steps, started)) if dist.is_main else None
        with live or nullcontext():
            progress, stopped = train(config, state, samples, val_rows, progress, max_steps, metrics, live)
        service.finish_checkpoint(config, state, max_steps)  # the last one, written in the background
        if metrics is not None:
            metrics.close()
        if dist.is_main:
            link_final_weights(config.output_dir, progress.step)
        if dist.is_main:
            report(config.output_dir, max_steps, started, stopped, resumed_from)


def train(
    config: SFTConfig,
    state: service.Training,
    samples: list[Sample],
    val_rows: list[MicroBatch] | None,
    progress: Progress,
    max_steps: int,
    metrics: MetricsWriter | None,
    live: LiveLine | None,
) -> tuple[Progress, str | None]:
    """The steps from `progress` on: the progress they end at, and why they ended early (None: all done)."""
    dist, first_step, val = state.dist, progress.step, {}
    share = sharing(config, state)
    carried: dict[str, float] = {}  # the checkpoint written after the previous step: in this step's record
    for step in range(progress.step, max_steps):
        if service.stop_agreed(dist):
            service.stop_on_signal("sft", config, state, progress, max_steps)
        times, carried = carried, {}
        start = time.perf_counter()
        with timer(times, "data"):
            batch, epoch, position = step_batch(samples, progress, config, dist, share)
        with timer(times, "train"):
            stats = train_step(
                state.model, state.optimizer, batch, dist, nll_loss, config.optim.max_norm,
                share_prompts=share,
            )  # fmt: skip
            lr = state.scheduler.get_last_lr()[0]
            state.scheduler.step()
        progress = Progress(
            step + 1, progress.tokens + stats.num_tokens, progress.samples + stats.num_samples, epoch, position
        )
        val = evaluate_if_due(config.val, state.model, val_rows, dist, progress.step, max_steps, times, share)
        stop_early = target_reached(config.val, val)
        last_step = progress.step if stop_early else max_steps
        publish(config, last_step, state, progress, times)
        times["step"] = time.perf_counter() - start
        if dist.is_main:
            record = step_metrics(stats, times, lr, progress) | {"epoch": batch_epoch(epoch, position)} | val
            metrics.log(step, record)
            if step == first_step or (step + 1) % config.log.interval == 0 or step + 1 == last_step or val:
                log_step(step, record)
            live.update()
        # After the record: a kill between the two must not leave a checkpoint past a step whose record is lost.
        service.checkpoint_if_due(config, state, progress, last_step, carried)
        if stop_early:
            reached = f"held-out loss {val['val/loss']:.4g} < val.stop-below {config.val.stop_below:g}"
            logger.info(f"{reached}: stopping")
            return progress, f"stopped early: {reached}"
    if val and config.val.stop_below is not None:
        logger.warning(
            f"held-out loss {val['val/loss']:.4g} never went below val.stop-below "
            f"{config.val.stop_below:g} in {max_steps} steps: the weights are the last step's"
        )
    return progress, None


def report(output_dir: Path, max_steps: int, started: float, stopped: str | None, resumed_from: int | None) -> None:
    """The run's plots (OUTPUT_DIR/plots/run.png, .svg) and its summary, from its metrics files; of checkpoints/,
    those written since run/sft.toml (this run's record, written at its start; its time on the dir's clock)."""
    plots = plot_runs([output_dir], output_dir / "plots" / "run")
    this_run = ThisRun((run_dir(output_dir) / "sft.toml").stat().st_mtime, resumed_from)
    for line in sft_summary(output_dir, max_steps, time.time() - started, sys.argv[1:], plots, stopped, this_run):
        logger.info(line)


def status_text(output_dir: Path, max_steps: int, since: float | None = None) -> str:
    """'step 120/340 | loss 1.23 | val 0.45 | 2,100 tok/s | ETA 1m05s' from the newest metrics records written
    since `since` (a re-used output dir holds an earlier run's records until this run's first step)."""
    records = this_run(tail_metrics(output_dir, "sft"), since)
    if not records:
        return f"step 0/{max_steps} | starting"
    step = records[-1]["step"] + 1
    parts = [f"step {step}/{max_steps}", f"loss {records[-1]['loss']:.3g}"]
    if held_out := [r["val/loss"] for r in records if "val/loss" in r]:
        parts.append(f"val {held_out[-1]:.3g}")
    parts.append(f"{records[-1].get('tokens_per_s', 0.0):,.0f} tok/s")
    if left := eta(records, max_steps - step):
        parts.append(left)
    return " | ".join(parts)


def wandb_metrics(config: SFTConfig, metrics: MetricsWriter, resumed: bool):
    """`metrics`, whose records (`val/loss` too) also go to the W&B run of the output dir, series `sft`."""
    try:
        run = open_run(config.wandb, config.output_dir, config.model_dump(mode="json"), resumed, ("sft",))
    except WandbError as e:
        raise TrainerError(str(e)) from None
    return MirroredMetrics(metrics, run, "sft")


def resume(config: SFTConfig, state: service.Training, step: int | None) -> Progress:
    """The progress of checkpoint `step` (`--ckpt.resume-step`), restored into `state`; a fresh start's for None."""
    if step is None:
        return Progress()
    progress = service.load(config, state, step)
    logger.info(f"resumed from checkpoints/step_{step} (going on in epoch {progress.epoch + 1})")
    return progress


def sharing(config: SFTConfig, state: service.Training) -> bool:
    """Whether this run's trainer computes shared prompts once: its rows, training and held-out, are then packed
    counting a shared start once toward seq_len, as they are computed."""
    return config.share_prompts and shares_prompts(state.model, state.dist.device)


def step_batch(
    samples: list[Sample], progress: Progress, config: SFTConfig, dist: Dist, share_prompts: bool = False
) -> tuple[list[MicroBatch], int, int]:
    """This rank's packed rows of the next batch (every rank the same row count; `share_prompts`: a row's shared
    prompt counted once toward seq_len, as the trainer computes it), and the data position after it."""
    indices, epoch, position = next_batch(
        len(samples), config.batch_size, progress.epoch, progress.position, config.seed, config.data.shuffle
    )
    mine = [samples[i] for i in indices[dist.rank :: dist.world_size]]
    return pack_rank_rows(mine, config.seq_len, dist, share_prompts), epoch, position


def nll_loss(
    out: PolicyOutput, mb: MicroBatch, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The step's loss callback: the negative log-likelihood of the completion tokens."""
    nll = torch.where(mask, -out.logprobs, 0.0).sum()
    return nll * scale, {"loss": nll}


def publish(config: SFTConfig, last_step: int, state: service.Training, progress: Progress, times: dict) -> None:
    """Weights every `weights_interval` steps and at the run's last step (`last_step`: max_steps, or this step
    when the run stops early), and their pruning (checkpoints: after the step's metrics record)."""
    if checkpoint_due(progress.step, last_step, config.weights_interval):
        with timer(times, "save_weights"):
            save_weights(state.model, state.files, config.output_dir, progress.step)
        if state.dist.is_main and config.keep_weights:
            prune_weights(config.output_dir, config.keep_weights)


def log_step(step: int, m: dict) -> None:
    held_out = f" | val/loss {m['val/loss']:.4g}" if "val/loss" in m else ""
    logger.info(
        f"step {step} | loss {m['loss']:.4g}{held_out} | grad_norm {m['grad_norm']:.3g} | "
        f"epoch {m['epoch']} | {m['tokens_per_s']:,.0f} tok/s | {m['time/step']:.2f}s"
    )


if __name__ == "__main__":
    startup.run_as_script(__file__, "prime_rl.entrypoints.sft")
