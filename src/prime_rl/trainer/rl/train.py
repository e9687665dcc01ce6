"""RL trainer entrypoint: read packed rollouts, take one FSDP2 optimizer step, publish HF weights.

Step n (DESIGN §3): every rank waits for `rollouts/step_n/rank_{r}.pt`, runs forward/backward over its
micro batches (gradient accumulation), the ranks clip and step AdamW together, and rank 0 writes
`weights/step_{n+1}` for inference. The loss is in `loss.py`, the packed forward in `model.py`.

    trainer @ trainer.toml                                               # one process
    torchrun --nproc-per-node 2 src/prime_rl/trainer/rl/train.py @ trainer.toml
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import time
from dataclasses import dataclass

from prime_rl.protocol import DiskFull, RunLocked, WaitTimeout, WriterDead
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.parallel import run_lock
from prime_rl.trainer.rl.config import TrainerConfig
from prime_rl.utils.config import parse_config, write_run_config
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.process import die_with_parent

logger = logging.getLogger("prime_rl")


def main() -> None:
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: never outlive the agent (it may be SIGKILLed)
        die_with_parent(signal.SIGKILL)
    config = parse_config(TrainerConfig)
    rank = int(os.environ.get("RANK", 0))
    if rank == 0:
        setup_logging("trainer", config.output_dir, config.log.level, config.log.file)
    else:  # one log per service: other ranks only surface problems, on their stderr
        setup_logging(f"trainer-rank{rank}", None, "WARNING", to_file=False)
    try:
        with run_lock(config.output_dir, "trainer", rank):
            if rank == 0:
                write_run_config(config, "trainer", config.output_dir)
            run(config)
    except (WaitTimeout, WriterDead, TrainerError, RunLocked, DiskFull) as e:
        logger.error(str(e))
        raise SystemExit(1) from None


def run(config: TrainerConfig) -> None:
    import torch

    from prime_rl.protocol import Heartbeat
    from prime_rl.trainer.broadcast import WeightSender
    from prime_rl.trainer.ckpt import Progress
    from prime_rl.trainer.model import build_sharded
    from prime_rl.trainer.parallel import close_distributed, init_distributed, resolve_device
    from prime_rl.trainer.weights import build_model_files
    from prime_rl.utils.metrics import MetricsWriter
    from prime_rl.utils.timer import timer

    torch.manual_seed(config.seed)
    d = init_distributed(resolve_device(config.device))
    try:
        with Heartbeat(config.output_dir, f"trainer-rank{d.rank}") as heartbeat:
            model, optimizer, scheduler = build_sharded(config, d, config.max_steps)
            files = build_model_files(config.model.name)  # every rank writes weight files in its dtype
            progress = resume(config, model, optimizer, scheduler, files, d) or Progress()
            sender = WeightSender(config, model, files, d) if config.weight_transfer == "broadcast" else None
            metrics = MetricsWriter(config.output_dir, "trainer", progress.step) if d.is_main else None
            logger.info(f"training {config.model.name} on {d.world_size} rank(s), device {d.device.type}")

            history = []
            for step in range(progress.step, config.max_steps):
                heartbeat.step = step
                times: dict[str, float] = {}
                start = time.perf_counter()
                micro_batches = load_micro_batches(config, step, d, times)
                with timer(times, "train"):
                    stats = train_step(model, optimizer, micro_batches, config, d)
                    lr = scheduler.get_last_lr()[0]
                    scheduler.step()
                optimized_at = time.time()  # when the new policy exists (the weight plane's clock starts)
                progress = Progress(step + 1, progress.tokens + stats.num_tokens, progress.samples + stats.num_samples)
                if not config.bench:
                    publish(config, model, optimizer, scheduler, progress, files, d, times, sender)
                times["step"] = time.perf_counter() - start
                record = step_metrics(stats, times, lr, progress) | {"optimized_at": optimized_at}
                history.append(record)
                if d.is_main:
                    metrics.log(step, record)
                    log_step(step, record)
            if metrics is not None:
                metrics.close()
            if config.bench and d.is_main:
                print_bench_table(history, model, config, d)
            written = "benchmark, no weights written" if config.bench else f"weights in {config.output_dir / 'weights'}"
            logger.info(f"done: {config.max_steps} steps, {written}")
    finally:
        close_distributed()


def resume(config: TrainerConfig, model, optimizer, scheduler, files, d):
    """Restore `--ckpt.resume-step` (None = fresh start); make sure `weights/step_N` exists for the orchestrator."""
    from prime_rl.protocol import is_stable, resolve_resume_step, weights_dir
    from prime_rl.trainer.ckpt import load_checkpoint
    from prime_rl.trainer.weights import save_weights

    try:
        step = resolve_resume_step(config.output_dir, config.ckpt and config.ckpt.resume_step, "trainer")
    except ValueError as e:
        raise TrainerError(str(e)) from None
    if step is None:
        return None
    progress = load_checkpoint(config.output_dir, step, model, optimizer, scheduler, d.rank)
    if progress.step != step:
        raise TrainerError(f"checkpoint step_{step} holds trainer progress of step {progress.step}")
    # An orchestrator resuming at step N waits for weights/step_N (pruning keeps it, but it may be gone).
    if step > 0 and not is_stable(weights_dir(config.output_dir, step)):
        save_weights(model, files, config.output_dir, step)
    logger.info(f"resumed from checkpoints/step_{step} ({progress.tokens} tokens, {progress.samples} samples so far)")
    return progress


def publish(config: TrainerConfig, model, optimizer, scheduler, progress, files, d, times: dict, sender) -> None:
    """After a step: weights for inference, a checkpoint when due, and pruning of what nobody needs any more.

    With a broadcast `sender` the weights go over the process group, and `weights/step_n` is written only
    with a checkpoint (a resumed orchestrator loads it) and at the last step (for eval; never broadcast)."""
    from prime_rl.protocol import checkpoint_due, prune_checkpoints
    from prime_rl.trainer.ckpt import save_checkpoint
    from prime_rl.trainer.weights import save_weights
    from prime_rl.utils.timer import timer

    ckpt = config.ckpt
    due = ckpt is not None and checkpoint_due(progress.step, config.max_steps, ckpt.interval)
    last = progress.step == config.max_steps  # no rollouts are sampled from the last weights: disk only
    if sender is not None and not last:
        with timer(times, "broadcast_weights"):
            sender.send(model, progress.step)
    if sender is None or due or last:
        with timer(times, "save_weights"):
            save_weights(model, files, config.output_dir, progress.step)
    if due:
        with timer(times, "save_ckpt"):
            save_checkpoint(config.output_dir, progress.step, model, optimizer, scheduler, progress, files, d.rank)
        if d.is_main:
            prune_checkpoints(config.output_dir, "trainer", ckpt.keep, config.max_steps, ckpt.interval)
    if d.is_main:
        prune_old_steps(config, progress.step - 1)


def load_micro_batches(config: TrainerConfig, step: int, d, times: dict) -> list:
    """This rank's micro batches of `step`; every rank must hold the same number (checked, not hung on).

    `times` gets `wait` (for the orchestrator's rank file) and `load_data` (reading and checking it)."""
    from prime_rl.protocol import wait_for_rank_file
    from prime_rl.utils.timer import timer

    if config.data.fake:
        return generated_micro_batches(config, step, d)
    with timer(times, "wait"):
        path = wait_for_rank_file(config.output_dir, step, d.rank, config.data.timeout, config.data.heartbeat_timeout)
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


@dataclass
class StepStats:
    loss: float
    entropy: float  # mean over loss tokens
    mismatch_kl: float  # mean k3 KL(μ‖π) over loss tokens
    clip_frac: float  # fraction of loss tokens whose ratio was truncated
    grad_norm: float  # before clipping
    num_tokens: int  # tokens processed (all ranks, padding included)
    num_loss_tokens: int
    num_samples: int  # packed samples with at least one loss token
    peak_memory_gib: float  # max over ranks


def train_step(model, optimizer, micro_batches: list, config: TrainerConfig, d) -> StepStats:
    """Accumulate gradients over the micro batches, clip, and take one AdamW step."""
    import torch

    from prime_rl.trainer.model import forward_logprobs, sample_starts
    from prime_rl.trainer.parallel import all_reduce, set_micro_batch_sync
    from prime_rl.trainer.rl.loss import policy_loss, sample_index

    # The first token of each sample has no prefix, so it never carries a logprob to train on.
    masks = [(mb.loss_mask & ~sample_starts(mb)).to(d.device) for mb in micro_batches]
    local_counts = [
        sum(mb.num_tokens for mb in micro_batches),
        sum(int(m.sum()) for m in masks),
        sum(_samples_with_loss(mb.cu_seqlens, m) for mb, m in zip(micro_batches, masks, strict=True)),
    ]
    num_tokens, num_loss_tokens, num_samples = all_reduce(local_counts, d.device)
    # Every loss token (or sample) of the step weighs 1/N; × world_size undoes FSDP's gradient averaging.
    denominator = max(num_loss_tokens if config.loss.norm == "token" else num_samples, 1)
    scale = d.world_size / denominator

    if d.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(d.device)
    sums = torch.zeros(4, dtype=torch.float64, device=d.device)  # loss, entropy, mismatch kl, clipped
    for i, (mb, mask) in enumerate(zip(micro_batches, masks, strict=True)):
        set_micro_batch_sync(model, d, last=i == len(micro_batches) - 1)
        out = forward_logprobs(model, mb, d.device, config.loss.entropy_coef > 0, where=mask)
        terms = policy_loss(
            out.logprobs,
            mb.inference_logprobs.to(d.device),
            mb.advantages.to(d.device),
            mask,
            sample_index(mb.cu_seqlens.to(d.device), mb.num_tokens),
            config.loss,
            scale,
            entropy=out.entropy,
        )
        terms.loss.backward()
        entropy_sum = torch.where(mask, out.entropy.detach(), 0.0).sum()
        sums += torch.stack([terms.loss_sum, entropy_sum, terms.mismatch_kl_sum, terms.clipped.float()]).double()

    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.optim.max_norm)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if torch.isfinite(torch.tensor(grad_norm)):
        optimizer.step()
    else:  # every rank sees the same (reduced) norm, so all skip together
        logger.warning(f"non-finite gradient norm ({grad_norm}); skipping this update")
    optimizer.zero_grad(set_to_none=True)

    loss_sum, entropy_sum, kl_sum, clipped = all_reduce(sums.tolist(), d.device)
    (peak,) = all_reduce([_peak_memory_gib(d.device)], d.device, op="max")
    n = max(num_loss_tokens, 1)
    return StepStats(
        loss=loss_sum / denominator,
        entropy=entropy_sum / n,
        mismatch_kl=kl_sum / n,
        clip_frac=clipped / n,
        grad_norm=grad_norm,
        num_tokens=int(num_tokens),
        num_loss_tokens=int(num_loss_tokens),
        num_samples=int(num_samples),
        peak_memory_gib=peak,
    )


def _samples_with_loss(cu_seqlens, mask) -> int:
    per_sample = [int(seg.any()) for seg in mask[0].cpu().split(cu_seqlens.diff().tolist())]
    return sum(per_sample)


def _peak_memory_gib(device) -> float:
    import resource

    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def prune_old_steps(config: TrainerConfig, step: int) -> None:
    """Drop weights no reader can still need, and rollouts every rank has read (all are past step `step`)."""
    from prime_rl.protocol import prune_rollouts
    from prime_rl.trainer.weights import prune_weights

    prune_weights(config.output_dir, keep=config.keep_weights or config.async_level + 1)
    prune_rollouts(config.output_dir, step, config.data.keep_rollouts, resumable=config.ckpt is not None)


def step_metrics(stats: StepStats, times: dict[str, float], lr: float, progress) -> dict:
    return {
        "loss": stats.loss,
        "entropy": stats.entropy,
        "mismatch_kl": stats.mismatch_kl,
        "clip_frac": stats.clip_frac,
        **shared_step_metrics(stats, times, lr, progress),
    }


def shared_step_metrics(stats, times: dict[str, float], lr: float, progress) -> dict:
    """What RL and SFT steps both report: gradient, lr, token counts, throughput, memory, progress, timers."""
    return {
        "grad_norm": stats.grad_norm,
        "lr": lr,
        "num_tokens": stats.num_tokens,
        "num_loss_tokens": stats.num_loss_tokens,
        "num_samples": stats.num_samples,
        "tokens_per_s": stats.num_tokens / max(times["train"], 1e-9),
        "peak_memory_gib": stats.peak_memory_gib,
        "progress/tokens": progress.tokens,
        "progress/samples": progress.samples,
        **{f"time/{k}": v for k, v in times.items()},
    }


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
