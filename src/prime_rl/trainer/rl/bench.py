"""`trainer --bench`: the summary table of a benchmark run (median step time, tokens/s, TFLOP/s and MFU).

Importing it loads no torch (the RL entrypoint imports it at start-up); printing the table does.
"""

from __future__ import annotations

import logging
import statistics
from typing import TYPE_CHECKING

from prime_rl.configs.trainer import TrainerConfig

if TYPE_CHECKING:
    import torch

    from prime_rl.trainer.parallel import Dist

logger = logging.getLogger("prime_rl")

# Dense bf16 peak of common training GPUs, for MFU when --bench-peak-tflops is not given.
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def flops_per_token(model: torch.nn.Module, num_layers: int, hidden: int, mean_context: float) -> float:
    """Training FLOPs per token: 6 · parameters (matmuls, forward + backward) + 6 · layers · hidden · context.

    The attention term is 12 · layers · hidden · (average causal context = half the sample length).
    Example: 1M parameters, 2 layers, hidden 64, samples of 256 tokens → 6e6 + 6·2·64·128 = 6.1e6.
    """
    params = sum(p.numel() for p in model.parameters())
    return 6 * params + 6 * num_layers * hidden * mean_context


def print_bench_table(history: list[dict], model: torch.nn.Module, config: TrainerConfig, dist: Dist) -> None:
    """Median step time, tokens/s and MFU over the steps after the first (warm-up) one, as a rich table."""
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
