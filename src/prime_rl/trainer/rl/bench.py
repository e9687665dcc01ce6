"""`trainer --bench`: the summary table of a benchmark run (median step time, tokens/s, TFLOP/s and MFU)."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Iterable

import torch
from rich.console import Console
from rich.table import Table

from prime_rl.configs.trainer import TrainerConfig
from prime_rl.trainer.parallel import Dist

logger = logging.getLogger("prime_rl")

# Dense bf16 peak of common training GPUs, for MFU when --bench-peak-tflops is not given.
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def flops_per_token(model: torch.nn.Module, mean_context: float) -> float:
    """Training FLOPs per token (forward + backward) of a dense decoder:
    6 · matmul parameters + 12 · layers · attention width · mean causal context.

    Matmul parameters are every weight matrix but the input embedding, a lookup (tied to the LM head it counts
    once, as the head); an MoE's inactive experts are counted too, so its MFU reads high. The attention width is
    heads · head_dim (2048 on Qwen3-0.6B, twice its hidden size); a token at position i of its sample attends
    to i tokens (`mean_causal_context`). Example, Qwen3-0.6B (28 layers, 596 M matmul parameters, width 2048) on
    16,384-token samples (mean context 8,192.5): 6 · 596e6 + 12 · 28 · 2048 · 8192.5 = 3.58e9 + 5.64e9 = 9.2e9,
    the figure behind upstream's 11.1 % MFU at 11.9k tokens/s on an H100 (989 TFLOP/s).
    """
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    skip = {id(embedding.weight)} if head is None or head.weight is not embedding.weight else set()
    params = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in skip)
    cfg = model.config
    width = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    return 6 * params + 12 * cfg.num_hidden_layers * width * mean_context


def mean_causal_context(lengths: Iterable[int]) -> float:
    """Tokens each token attends to, averaged over tokens: a sample of S tokens gives S · (S + 1) / 2 over S tokens.
    Example: samples of 1 and 3 tokens → (1 + 6) / 4 = 1.75."""
    lengths = list(lengths)
    return sum(n * (n + 1) / 2 for n in lengths) / max(1, sum(lengths))


def print_bench_table(history: list[dict], model: torch.nn.Module, config: TrainerConfig, dist: Dist) -> None:
    """Median step time, tokens/s and MFU over the steps after the first (warm-up) one, as a rich table."""
    measured = history[1:] or history
    step_time = statistics.median(m["time/train"] for m in measured)
    tokens = statistics.median(m["num_tokens"] for m in measured)
    # Fake samples' lengths are uniform in [min, max] (capped at the row); rollouts: assume 512-token samples.
    d = config.data
    lengths = range(d.fake_min_len, min(d.fake_max_len, d.fake_seq_len) + 1) if d.fake else [512]
    flops = flops_per_token(model, mean_causal_context(lengths)) * tokens / step_time
    peak = config.bench_peak_tflops
    if peak is None and dist.device.type == "cuda":
        name = torch.cuda.get_device_name(dist.device)
        peak = next((v for k, v in _PEAK_TFLOPS.items() if k in name), None)
    mfu = f"{100 * flops / (peak * 1e12 * dist.world_size):.1f}%" if peak else "n/a"
    table = Table(title=f"trainer benchmark: {config.model.name}, {dist.world_size} rank(s), {dist.device.type}")
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
