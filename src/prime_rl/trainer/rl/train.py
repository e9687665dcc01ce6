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
import time
from dataclasses import dataclass

from prime_rl.protocol import WaitTimeout, WriterDead
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.rl.config import TrainerConfig
from prime_rl.utils.config import parse_config, write_run_config
from prime_rl.utils.logging import setup_logging

logger = logging.getLogger("prime_rl")


def main() -> None:
    config = parse_config(TrainerConfig)
    rank = int(os.environ.get("RANK", 0))
    if rank == 0:
        setup_logging("trainer", config.output_dir, config.log.level, config.log.file)
        write_run_config(config, "trainer", config.output_dir)
    else:  # one log per service: other ranks only surface problems, on their stderr
        setup_logging(f"trainer-rank{rank}", None, "WARNING", to_file=False)
    try:
        run(config)
    except (WaitTimeout, WriterDead, TrainerError) as e:
        logger.error(str(e))
        raise SystemExit(1) from None


def run(config: TrainerConfig) -> None:
    import torch

    from prime_rl.protocol import Heartbeat
    from prime_rl.trainer.model import build_model
    from prime_rl.trainer.parallel import apply_fsdp, close_distributed, init_distributed, resolve_device
    from prime_rl.trainer.weights import build_model_files, save_weights
    from prime_rl.utils.metrics import MetricsWriter
    from prime_rl.utils.timer import timer

    torch.manual_seed(config.seed)
    d = init_distributed(resolve_device(config.device))
    try:
        with Heartbeat(config.output_dir, f"trainer-rank{d.rank}") as heartbeat:
            model = build_model(config.model.name, config.activation_checkpointing)
            apply_fsdp(model, d, compute_dtype(config.dtype, d.device))
            optimizer = build_optimizer(model, config)
            files = build_model_files(config.model.name) if d.is_main else None
            metrics = MetricsWriter(config.output_dir, "trainer") if d.is_main else None
            logger.info(f"training {config.model.name} on {d.world_size} rank(s), device {d.device.type}")

            for step in range(config.max_steps):
                heartbeat.step = step
                times: dict[str, float] = {}
                start = time.perf_counter()
                with timer(times, "wait"):
                    micro_batches = load_micro_batches(config, step, d)
                with timer(times, "train"):
                    stats = train_step(model, optimizer, micro_batches, config, d)
                with timer(times, "save_weights"):
                    save_weights(model, files, config.output_dir, step + 1)
                times["step"] = time.perf_counter() - start
                if d.is_main:
                    prune_old_steps(config, step)
                    record = step_metrics(stats, times, optimizer.param_groups[0]["lr"])
                    metrics.log(step, record)
                    log_step(step, record)
            if metrics is not None:
                metrics.close()
            logger.info(f"done: {config.max_steps} steps, weights in {config.output_dir / 'weights'}")
    finally:
        close_distributed()


def compute_dtype(choice: str, device):
    """Dtype of the weights in forward/backward; the master copy is always float32."""
    import torch

    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, choice)


def build_optimizer(model, config: TrainerConfig):
    import torch

    o = config.optim
    return torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)


def load_micro_batches(config: TrainerConfig, step: int, d) -> list:
    """This rank's micro batches of `step`; every rank must hold the same number (checked, not hung on)."""
    from prime_rl.protocol import rank_file, wait_for_rank_file
    from prime_rl.protocol.records import read_rank_file
    from prime_rl.trainer.parallel import all_reduce

    path = wait_for_rank_file(config.output_dir, step, d.rank, config.data.timeout, config.data.heartbeat_timeout)
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
    from prime_rl.trainer.parallel import all_reduce
    from prime_rl.trainer.rl.loss import aipo_loss

    # The first token of each sample has no prefix, so it never carries a logprob to train on.
    masks = [(mb.loss_mask & ~sample_starts(mb)).to(d.device) for mb in micro_batches]
    local_counts = [
        sum(mb.num_tokens for mb in micro_batches),
        sum(int(m.sum()) for m in masks),
        sum(_samples_with_loss(mb.cu_seqlens, m) for mb, m in zip(micro_batches, masks, strict=True)),
    ]
    num_tokens, num_loss_tokens, num_samples = all_reduce(local_counts, d.device)
    # Every loss token of the step weighs 1/N; × world_size undoes FSDP's gradient averaging over ranks.
    scale = d.world_size / max(num_loss_tokens, 1)

    if d.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(d.device)
    sums = torch.zeros(4, dtype=torch.float64, device=d.device)  # loss, entropy, mismatch kl, clipped
    for mb, mask in zip(micro_batches, masks, strict=True):
        out = forward_logprobs(model, mb, d.device)
        terms = aipo_loss(
            out.logprobs,
            mb.inference_logprobs.to(d.device),
            mb.advantages.to(d.device),
            mask,
            config.loss.max_ratio,
            scale,
        )
        terms.loss.backward()
        entropy_sum = torch.where(mask, out.entropy, 0.0).sum()
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
        loss=loss_sum / n,
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
    from prime_rl.protocol import list_steps, prune_steps, rollouts_dir
    from prime_rl.trainer.weights import prune_weights

    prune_weights(config.output_dir, keep=config.keep_weights or config.async_level + 1)
    # The orchestrator may already have written later steps; those are unread and must survive.
    unread = [s for s in list_steps(rollouts_dir(config.output_dir)) if s > step]
    prune_steps(rollouts_dir(config.output_dir), keep=config.data.keep_rollouts, protect=unread)


def step_metrics(stats: StepStats, times: dict[str, float], lr: float) -> dict:
    return {
        "loss": stats.loss,
        "entropy": stats.entropy,
        "mismatch_kl": stats.mismatch_kl,
        "clip_frac": stats.clip_frac,
        "grad_norm": stats.grad_norm,
        "lr": lr,
        "num_tokens": stats.num_tokens,
        "num_loss_tokens": stats.num_loss_tokens,
        "num_samples": stats.num_samples,
        "tokens_per_s": stats.num_tokens / max(times["train"], 1e-9),
        "peak_memory_gib": stats.peak_memory_gib,
        **{f"time/{k}": v for k, v in times.items()},
    }


def log_step(step: int, m: dict) -> None:
    logger.info(
        f"step {step} | loss {m['loss']:.4g} | entropy {m['entropy']:.3g} | mismatch_kl {m['mismatch_kl']:.2g} | "
        f"grad_norm {m['grad_norm']:.3g} | {m['tokens_per_s']:.0f} tok/s | {m['time/step']:.2f}s"
    )


if __name__ == "__main__":
    main()
