"""The policy model of both trainers: an HF causal LM loaded so that the trainer reproduces the served policy.

- float32 master weights (each rank reads only its shards: `loading.py`; loaded whole here where it cannot);
- our packed attention (`attention.py`), each sample attending only to itself;
- every dropout probability of the config set to 0: the trainer's logprobs must be the policy's, and with
  `attention_dropout = 0.1` two identical forwards differed by 0.09;
- with `[model.lora]`, peft's LoRA layers injected in place (module tree and base parameter names kept,
  the base frozen): only the adapters train, and `weights.py` ships only them.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from prime_rl.configs import LoraConfig
from prime_rl.trainer.attention import attention_implementation, check_supported
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.weights import check_export_layout
from prime_rl.utils.lora import ADAPTER

logger = logging.getLogger("prime_rl")


def build_model(name: str, device_type: str = "cpu", lora: LoraConfig | None = None) -> torch.nn.Module:
    """Load `name` (hub id or local dir) in float32 on CPU, dropout off, in train mode (+ LoRA adapters)."""
    try:
        config = AutoConfig.from_pretrained(name)
        disable_dropout(config)
        model = AutoModelForCausalLM.from_pretrained(
            name, config=config, dtype=torch.float32, attn_implementation=attention_implementation(device_type)
        )
    except (OSError, ValueError) as e:
        raise TrainerError(f"cannot load model {name!r}: {e}") from None
    prepare(model, name, lora)
    return model


def prepare(model: torch.nn.Module, name: str, lora: LoraConfig | None) -> None:
    """What every trainer model gets once built (loaded, or on the meta device): the packed-attention and
    export-layout checks, no KV cache, LoRA adapters, train mode."""
    check_supported(model)
    check_export_layout(model, name)
    model.config.use_cache = False
    if lora is not None:
        apply_lora(model, lora)
    model.train()  # from_pretrained returns eval mode, which would also switch activation checkpointing off


def disable_dropout(config: PretrainedConfig) -> list[str]:
    """Set every dropout probability of an HF config (and its sub-configs) to 0; returns what was > 0."""
    changed = []
    for key, value in vars(config).items():
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a nested PretrainedConfig
            changed += [f"{key}.{k}" for k in disable_dropout(value)]
        elif ("dropout" in key or key.endswith("_pdrop")) and isinstance(value, float) and value > 0:
            setattr(config, key, 0.0)
            changed.append(key)
    if changed:
        logger.info(f"dropout set to 0 (the trainer must compute the served policy's logprobs): {changed}")
    return changed


def apply_lora(model: torch.nn.Module, lora: LoraConfig) -> None:
    """Freeze the base and inject LoRA layers into the `target_modules` linears (B = 0: the policy is unchanged)."""
    # peft only with LoRA: its import is ~0.6 s of every trainer process's start (11 % of its imports)
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    model.requires_grad_(False)
    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
    )
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as e:  # no module matched, or a target that is not a layer peft can adapt
        raise TrainerError(f"LoRA on {type(model).__name__}: {e}") from None
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info(f"LoRA rank {lora.rank} on {lora.target_modules}: {trainable:,} of {total:,} parameters train")
