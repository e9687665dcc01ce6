"""Building a started engine from a model name: the device and dtype choice, and loading the model and
tokenizer onto them."""

from __future__ import annotations

from typing import Any

import torch

from prime_rl.configs import LoraConfig
from prime_rl.configs.inference import EngineConfig, StartupError
from prime_rl.inference.engine.engine import Engine


def build_engine(
    model_name: str, config: EngineConfig | None = None, seed: int = 0, lora: LoraConfig | None = None, **settings
) -> Engine:
    """Load the model and tokenizer on `config.device` (auto = CUDA when present) and start the worker.

    `settings` override single fields of `config`, e.g. `build_engine(name, device="cpu", max_batch_size=4)`.
    """
    config = EngineConfig(**(config or EngineConfig()).model_dump() | settings)
    device, dtype = device_and_dtype(config.device, config.dtype)
    model, tokenizer = load_model(model_name, device, dtype)
    return Engine(model, tokenizer, torch.device(device), config, seed, lora).start()


def device_and_dtype(device: str, dtype: str) -> tuple[str, str]:
    """Resolve `auto`: CUDA when present, else CPU; bfloat16 on CUDA, float32 on CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise StartupError("engine.device is cuda, but no CUDA device is available")
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    return device, dtype


def load_model(model_name: str, device: str, dtype: str) -> tuple[torch.nn.Module, Any]:
    """The causal LM (in `dtype`, on `device`) and tokenizer of a local dir or hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_name)
        model = AutoModelForCausalLM.from_pretrained(model_name, dtype=getattr(torch, dtype)).to(device)
    except (OSError, ValueError) as e:  # missing path / not a model dir / hub id unreachable
        raise StartupError(f"cannot load model {model_name!r}: {e}") from None
    return model, tokenizer
