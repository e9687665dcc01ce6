"""Writing `weights/step_n`: a complete HF model dir that inference loads with `from_pretrained`.

Every rank takes part in gathering the full state dict (an FSDP collective); rank 0 writes
config.json, generation_config.json, the tokenizer and safetensors shards whose parameter names are
exactly the base model's, fsyncs them, and only then marks the dir `STABLE`. A dir without `STABLE`
(e.g. left by a crash) is never read and is replaced on the next write.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from prime_rl.protocol import atomic_write, atomic_write_text, mark_stable, prune_steps, weights_dir, weights_root

logger = logging.getLogger("prime_rl")

MAX_SHARD_SIZE = "5GB"


@dataclass
class ModelFiles:
    """What rank 0 copies from the base model into every weights dir besides the tensors."""

    config: object  # transformers.PretrainedConfig
    generation_config: object  # transformers.GenerationConfig
    tokenizer: object  # transformers.PreTrainedTokenizerBase
    dtype: torch.dtype  # dtype the weights are saved in: the base model's own


def build_model_files(name: str) -> ModelFiles:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(name)
    try:
        generation_config = GenerationConfig.from_pretrained(name)
    except OSError:  # not every model ships one; derive it from the model config like transformers does
        generation_config = GenerationConfig.from_model_config(config)
    return ModelFiles(config, generation_config, AutoTokenizer.from_pretrained(name), saved_dtype(config))


def saved_dtype(config) -> torch.dtype:
    """The dtype a model's weights are stored in (its config's `dtype`), float32 when unset."""
    dtype = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def gather_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective: rank 0 gets every parameter unsharded on CPU; other ranks get an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_weights(model: torch.nn.Module, files: ModelFiles | None, output_dir: Path, step: int) -> Path | None:
    """Write `weights/step_{step}` (rank 0) and return its path; other ranks only help gather and get None."""
    state_dict = gather_full_state_dict(model)
    if dist.get_rank() != 0:
        return None
    assert files is not None, "rank 0 needs the base model's files"
    path = weights_dir(output_dir, step)
    if path.exists():
        shutil.rmtree(path)  # a leftover without STABLE from an interrupted run
    path.mkdir(parents=True)
    files.config.save_pretrained(path)
    files.generation_config.save_pretrained(path)
    files.tokenizer.save_pretrained(path)
    write_safetensors(state_dict, path, files.dtype, tied=bool(getattr(files.config, "tie_word_embeddings", False)))
    for f in path.iterdir():
        _fsync(f)
    mark_stable(path)
    return path


def write_safetensors(
    state_dict: dict[str, torch.Tensor],
    path: Path,
    dtype: torch.dtype,
    tied: bool,
    max_shard_size: str = MAX_SHARD_SIZE,
) -> None:
    """Shards named like `save_pretrained`'s (`model.safetensors` or `model-0000i-of-0000n.safetensors` + index)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save

    if tied:
        # With tied embeddings the head is the embedding matrix; HF checkpoints store it once.
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state_dict.items()}
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        shard = {name: tensors[name] for name in names}
        atomic_write(path / filename, lambda f, shard=shard: f.write(save(shard, metadata={"format": "pt"})))
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}}
        index["weight_map"] = split.tensor_to_filename
        atomic_write_text(path / "model.safetensors.index.json", json.dumps(index, indent=2))


def prune_weights(output_dir: Path, keep: int, protect: list[int] = ()) -> list[int]:
    return prune_steps(weights_root(output_dir), keep=keep, protect=protect)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
