"""RL trainer entrypoint: read packed rollouts, take one FSDP2 optimizer step, publish HF weights.

Step n (DESIGN §3): every rank waits for `rollouts/step_n/rank_{r}.pt`, runs forward/backward over its
micro batches (gradient accumulation), the ranks clip and step AdamW together, and rank 0 writes
`weights/step_{n+1}` for inference. The loss is in `loss.py`, the packed forward in `model.py`.

    trainer @ trainer.toml                                               # one process
    torchrun --nproc-per-node 2 src/prime_rl/trainer/rl/train.py @ trainer.toml
"""

from __future__ import annotations

import logging
import pickle
import time

from prime_rl.configs.trainer import TrainerConfig
from prime_rl.trainer import service
from prime_rl.trainer.errors import TrainerError

logger = logging.getLogger("prime_rl")


def main() -> None:
    service.main(TrainerConfig, "trainer", run)


def run(config: TrainerConfig) -> None:
    from prime_rl.protocol import Heartbeat
    from prime_rl.trainer.broadcast import WeightSender
    from prime_rl.trainer.ckpt import Progress
    from prime_rl.trainer.step import step_metrics
    from prime_rl.utils.metrics import MetricsWriter
    from prime_rl.utils.timer import timer

    with service.training(config, config.max_steps) as t, Heartbeat(config.output_dir, f"trainer-rank{t.d.rank}") as hb:
        d = t.d
        progress = resume(config, t) or Progress()
        sender = WeightSender(config, t.model, t.files, d) if config.weight_transfer == "broadcast" else None
        metrics = MetricsWriter(config.output_dir, "trainer", progress.step) if d.is_main else None
        logger.info(f"training {config.model.name} on {d.world_size} rank(s), device {d.device.type}")

        history = []
        for step in range(progress.step, config.max_steps):
            hb.step = step
            times: dict[str, float] = {}
            start = time.perf_counter()
            micro_batches = load_micro_batches(config, step, d, times)
            if micro_batches is None:
                service.stop_on_signal("trainer", config, t, progress, config.max_steps)
            with timer(times, "train"):
                stats = train_step(t.model, t.optimizer, micro_batches, config, d)
                lr = t.scheduler.get_last_lr()[0]
                t.scheduler.step()
            optimized_at = time.time()  # when the new policy exists (the weight plane's clock starts)
            progress = Progress(step + 1, progress.tokens + stats.num_tokens, progress.samples + stats.num_samples)
            if not config.bench:
                publish(config, t, progress, times, sender)
            times["step"] = time.perf_counter() - start
            record = step_metrics(stats, times, lr, progress) | {"optimized_at": optimized_at}
            history.append(record)
            if d.is_main:
                metrics.log(step, record)
                log_step(step, record)
        if metrics is not None:
            metrics.close()
        if config.bench and d.is_main:
            print_bench_table(history, t.model, config, d)
        written = "benchmark, no weights written" if config.bench else f"weights in {config.output_dir / 'weights'}"
        logger.info(f"done: {config.max_steps} steps, {written}")


def resume(config: TrainerConfig, t):
    """Restore `--ckpt.resume-step` (None = fresh start); make sure `weights/step_N` exists for the orchestrator."""
    from prime_rl.protocol import is_stable, weights_dir
    from prime_rl.trainer.weights import save_weights

    step = service.resume_step(config)
    if step is None:
        return None
    progress = service.load(config, t, step)
    # An orchestrator resuming at step N waits for weights/step_N (pruning keeps it, but it may be gone).
    if step > 0 and not is_stable(weights_dir(config.output_dir, step)):
        save_weights(t.model, t.files, config.output_dir, step)
    logger.info(f"resumed from checkpoints/step_{step} ({progress.tokens} tokens, {progress.samples} samples so far)")
    return progress


def publish(config: TrainerConfig, t, progress, times: dict, sender) -> None:
    """After a step: weights for inference, a checkpoint when due, and pruning of what nobody needs any more.

    With a broadcast `sender` the weights go over the process group, and `weights/step_n` is written only
    with a checkpoint (a resumed orchestrator loads it) and at the last step (for eval; never broadcast)."""
    from prime_rl.protocol import checkpoint_due
    from prime_rl.trainer.weights import save_weights
    from prime_rl.utils.timer import timer

    ckpt = config.ckpt
    due = ckpt is not None and checkpoint_due(progress.step, config.max_steps, ckpt.interval)
    last = progress.step == config.max_steps  # no rollouts are sampled from the last weights: disk only
    if sender is not None and not last:
        with timer(times, "broadcast_weights"):
            sender.send(t.model, progress.step)
    if sender is None or due or last:
        with timer(times, "save_weights"):
            save_weights(t.model, t.files, config.output_dir, progress.step)
    service.checkpoint_if_due(config, t, progress, config.max_steps, times)
    if t.d.is_main:
        prune_old_steps(config, progress.step - 1)


def load_micro_batches(config: TrainerConfig, step: int, d, times: dict) -> list | None:
    """This rank's micro batches of `step`, or None when the run stops before it (a stop signal: every rank
    agrees, also one that had its data); every rank must hold the same number (checked, not hung on).

    `times` gets `wait` (for the orchestrator's rank file) and `load_data` (reading and checking it)."""
    from prime_rl.protocol import wait_for_rank_file
    from prime_rl.utils.process import StopRequested
    from prime_rl.utils.timer import timer

    path = None
    if not config.data.fake:
        with timer(times, "wait"):
            try:
                path = wait_for_rank_file(
                    config.output_dir, step, d.rank, config.data.timeout, config.data.heartbeat_timeout
                )
            except StopRequested:
                pass
    if service.stop_agreed(d):
        return None
    if config.data.fake:
        return generated_micro_batches(config, step, d)
    with timer(times, "load_data"):
        return _read_micro_batches(config, step, d, path)


def _read_micro_batches(config: TrainerConfig, step: int, d, path) -> list:
    from prime_rl.protocol import rank_file
    from prime_rl.protocol.records import read_rank_file
    from prime_rl.trainer.parallel import all_reduce

    try:
        micro_batches = read_rank_file(path, step, d.rank)
    except (ValueError, KeyError, TypeError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise TrainerError(f"unreadable rank file {path}: {e}") from None
    if d.is_main and rank_file(config.output_dir, step, d.world_size).exists():
        raise TrainerError(
            f"rollouts of step {step} are split over more than {d.world_size} ranks: the orchestrator's "
            f"num_train_workers must equal the trainer world size ({d.world_size})"
        )
    most, neg_fewest = all_reduce([len(micro_batches), -len(micro_batches)], d.device, op="max")
    if most != -neg_fewest:
        raise TrainerError(
            f"step {step}: ranks hold between {-neg_fewest:.0f} and {most:.0f} micro batches; the orchestrator "
            "must pad every rank to the same count (FSDP collectives run once per micro batch)"
        )
    if most == 0:
        raise TrainerError(f"step {step}: the rank files hold no micro batches")
    return micro_batches


def generated_micro_batches(config: TrainerConfig, step: int, d) -> list:
    from transformers import AutoConfig

    from prime_rl.trainer.fake_data import fake_micro_batches

    f = config.data
    vocab = AutoConfig.from_pretrained(config.model.name).vocab_size
    return fake_micro_batches(
        step, d.rank, f.fake_micro_batches, f.fake_seq_len, f.fake_min_len, f.fake_max_len, vocab, config.seed
    )


def train_step(model, optimizer, micro_batches: list, config: TrainerConfig, d):
    """One optimizer step of the RL loss (`loss.py`) over this rank's micro batches (`step.train_step`)."""
    from prime_rl.trainer.step import train_step as step

    c = config.loss
    return step(model, optimizer, micro_batches, d, rl_loss(c), config.optim.max_norm, c.norm, c.entropy_coef > 0)


def rl_loss(c):
    """The step's loss callback: `policy_loss` on the policy's logprobs, with entropy, mismatch KL and the
    fraction of clipped tokens reported per loss token."""
    import torch

    from prime_rl.trainer.rl.loss import policy_loss, sample_index

    def loss(out, mb, mask, scale):
        device = mask.device
        samples = sample_index(mb.cu_seqlens.to(device), mb.num_tokens)
        inference_logprobs, advantages = mb.inference_logprobs.to(device), mb.advantages.to(device)
        terms = policy_loss(out.logprobs, inference_logprobs, advantages, mask, samples, c, scale, entropy=out.entropy)
        reported = {
            "loss": terms.loss_sum,
            "entropy": torch.where(mask, out.entropy.detach(), 0.0).sum(),
            "mismatch_kl": terms.mismatch_kl_sum,
            "clip_frac": terms.clipped.float(),
        }
        return terms.loss, reported

    return loss


def prune_old_steps(config: TrainerConfig, step: int) -> None:
    """Drop weights no reader can still need, and rollouts every rank has read (all are past step `step`)."""
    from prime_rl.protocol import prune_rollouts
    from prime_rl.trainer.weights import prune_weights

    prune_weights(config.output_dir, keep=config.keep_weights or config.async_level + 1)
    prune_rollouts(config.output_dir, step, config.data.keep_rollouts, resumable=config.ckpt is not None)


# Dense bf16 peak of common training GPUs, for MFU when --bench-peak-tflops is not given.
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def flops_per_token(model, num_layers: int, hidden: int, mean_context: float) -> float:
    """Training FLOPs per token: 6 · parameters (matmuls, forward + backward) + 6 · layers · hidden · context.

    The attention term is 12 · layers · hidden · (average causal context = half the sample length).
    Example: 1M parameters, 2 layers, hidden 64, samples of 256 tokens → 6e6 + 6·2·64·128 = 6.1e6.
    """
    params = sum(p.numel() for p in model.parameters())
    return 6 * params + 6 * num_layers * hidden * mean_context


def print_bench_table(history: list[dict], model, config: TrainerConfig, d) -> None:
    """Median step time, tokens/s and MFU over the steps after the first (warm-up) one, as a rich table."""
    import statistics

    import torch
    from rich.console import Console
    from rich.table import Table

    measured = history[1:] or history
    step_time = statistics.median(m["time/train"] for m in measured)
    tokens = statistics.median(m["num_tokens"] for m in measured)
    cfg = model.config
    mean_context = (config.data.fake_min_len + config.data.fake_max_len) / 4 if config.data.fake else 256
    flops = flops_per_token(model, cfg.num_hidden_layers, cfg.hidden_size, mean_context) * tokens / step_time
    peak = config.bench_peak_tflops
    if peak is None and d.device.type == "cuda":
        name = torch.cuda.get_device_name(d.device)
        peak = next((v for k, v in _PEAK_TFLOPS.items() if k in name), None)
    mfu = f"{100 * flops / (peak * 1e12 * d.world_size):.1f}%" if peak else "n/a"
    table = Table(title=f"trainer benchmark: {config.model.name}, {d.world_size} rank(s), {d.device.type}")
    for column in ("steps", "step time (s)", "tokens/step", "tokens/s", "TFLOP/s", "MFU", "peak mem (GiB)"):
        table.add_column(column, justify="right")
    table.add_row(
        str(len(measured)),
        f"{step_time:.3f}",
        f"{tokens:.0f}",
        f"{tokens / step_time:,.0f}",
        f"{flops / 1e12:.3f}",
        mfu,
        f"{max(m['peak_memory_gib'] for m in measured):.2f}",
    )
    Console(width=120).print(table)
    if not peak:
        logger.info("MFU needs the device's peak: pass --bench-peak-tflops")


def log_step(step: int, m: dict) -> None:
    logger.info(
        f"step {step} | loss {m['loss']:.4g} | entropy {m['entropy']:.3g} | mismatch_kl {m['mismatch_kl']:.2g} | "
        f"grad_norm {m['grad_norm']:.3g} | {m['tokens_per_s']:.0f} tok/s | {m['time/step']:.2f}s"
    )


if __name__ == "__main__":
    main()
