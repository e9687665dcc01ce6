"""`rl`'s start-up look at host memory: a run whose services clearly cannot fit on this node is said before they
start (the kernel would otherwise kill one of them minutes later, with nothing in its log).

Only where the services run on the CPU (no GPU on the node): there the model's size sets the memory. Per
parameter, fp32 training holds weights, gradients and AdamW's two moments (16 bytes; a LoRA run only the frozen
weights, 4), an asynchronous checkpoint stages a copy of weights and moments while it writes (12 bytes), and each
inference server its own weights (4 bytes in fp32, 2 in bf16). Activations, vLLM's KV cache and the processes'
own overhead come on top, so the estimate is a floor: a run above the memory available will not fit.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from prime_rl.configs.rl import RLConfig
from prime_rl.utils.hf_layout import checkpoint_files, header_specs

logger = logging.getLogger("prime_rl")

TRAIN_BYTES, LORA_BYTES, STAGING_BYTES = 16, 4, 12


def available_gib() -> float | None:
    """MemAvailable of /proc/meminfo (GiB), None where the platform does not tell."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    return None


def parameter_count(model_name: str) -> int | None:
    """The model's parameters, from its checkpoint's safetensors headers (a local dir or the hub cache: no
    torch, ~10 ms) or else its config alone (transformers and torch on the meta device, ~10 s on 2 cores); no
    weights read. None where neither can be had."""
    try:
        if files := checkpoint_files(model_name):
            return sum(math.prod(shape) for file in files for shape, _ in header_specs(file).values())
        from transformers import AutoConfig

        from prime_rl.utils.tiny_model import meta_model

        config = AutoConfig.from_pretrained(model_name)
        return sum(p.numel() for p in meta_model(config).parameters())
    except Exception as e:  # an unusual model: the services' own checks speak for it
        logger.debug(f"memory check skipped: {model_name}'s size unknown ({e})")
        return None


def memory_warning(config: RLConfig, gpus: int) -> str | None:
    """A warning naming what to change when the services clearly exceed this node's memory, else None."""
    if gpus > 0:
        return None
    params, free = parameter_count(config.inference.model.name), available_gib()
    if params is None or free is None:
        return None
    trainer = config.trainer
    lora = trainer.model.lora is not None
    parts = {"trainer": params * (LORA_BYTES if lora else TRAIN_BYTES)}
    if trainer.ckpt is not None and trainer.ckpt.async_save and not lora:  # LoRA stages only the adapter
        parts["checkpoint staging"] = params * STAGING_BYTES
    parts["inference"] = params * (2 if config.inference.engine.dtype in ("bfloat16", "float16") else 4)
    need = sum(parts.values()) / 2**30
    if need <= free:
        return None
    split = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in parts.items())
    fixes = ["a smaller model", "LoRA (--model.lora.rank N)" if not lora else None,
             "--ckpt.async-save false" if "checkpoint staging" in parts else None,
             "the services on separate nodes (docs/usage.md: RL across nodes)"]  # fmt: skip
    return (
        f"this run needs at least {need:.1f} GiB of host memory ({params / 1e9:.2f} B parameters: {split} GiB) and "
        f"this node has {free:.1f} GiB available: a service will likely be killed for memory. Try "
        + ", ".join(f for f in fixes if f)
    )
