"""Writing `weights/step_n`: a complete HF model dir that inference loads with `from_pretrained`.

Every rank takes part in gathering the full state dict (an FSDP collective); rank 0 writes
config.json, generation_config.json, the tokenizer and safetensors shards whose parameter names are
exactly the base model's, fsyncs them, and only then marks the dir `STABLE`. A dir without `STABLE`
(e.g. left by a crash) is never read and is replaced on the next write.

The model's own parameter names are not always the checkpoint's: transformers 5 converts some
architectures at load (MoE models get their per-expert `mlp.experts.{i}.gate_proj/up_proj/down_proj`
fused into 3-D `mlp.experts.gate_up_proj`/`down_proj`; Mixtral's `block_sparse_moe` also becomes `mlp`).
The inference servers load by checkpoint names, so the export undoes that conversion exactly as
`save_pretrained` does, and `check_export_layout` refuses at start-up a model where that would not
give back its checkpoint's names and shapes.
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

from prime_rl.protocol import (
    atomic_write,
    atomic_write_text,
    checkpoint_steps,
    mark_stable,
    prune_steps,
    weights_dir,
    weights_root,
    writing,
)
from prime_rl.trainer.errors import TrainerError
from prime_rl.utils.hf_layout import checkpoint_files, checkpoint_state_dict, header_specs

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


def meta_model(config) -> torch.nn.Module:
    """The causal LM of `config` without memory (meta device): enough to revert its weight conversion."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def drop_tied_head(state_dict: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """With tied embeddings the head is the embedding matrix; HF checkpoints store it once."""
    return {k: v for k, v in state_dict.items() if not (tied and k == "lm_head.weight")}


def check_export_layout(model: torch.nn.Module, name: str) -> None:
    """Refuse a model whose exported weights would not carry the names and shapes of its checkpoint `name`.

    Checked at start-up (on meta copies, so nothing is allocated) rather than at the first weight save,
    hours in: inference could not load such weights. Checkpoint tensors the model never loads (e.g.
    multi-token-prediction layers) may be absent from the export; every exported one must match.
    """
    meta = {k: torch.empty_like(v, device="meta") for k, v in model.state_dict().items()}
    arch = type(model).__name__
    try:
        exported = checkpoint_state_dict(model, meta)
    except NotImplementedError:
        raise TrainerError(
            f"{arch}: transformers converts the weights of {name!r} at load and has no reverse conversion, "
            "so the trainer could not write them back in the checkpoint's layout that inference loads"
        ) from None
    files = checkpoint_files(name)
    if files is None:
        return  # no safetensors headers to compare with (e.g. a .bin checkpoint)
    stored = {k: shape for file in files for k, (shape, _) in header_specs(file).items()}
    exported = drop_tied_head(exported, bool(getattr(model.config, "tie_word_embeddings", False)))
    wrong = sorted(k for k, v in exported.items() if stored.get(k) != tuple(v.shape))
    if wrong:
        raise TrainerError(
            f"{arch}: transformers converts the weights of {name!r} at load and reverting that does not give "
            f"back the checkpoint's names and shapes ({len(wrong)} tensors differ, e.g. {wrong[:3]}), so "
            "inference could not load the weights the trainer writes"
        )


def save_weights(model: torch.nn.Module, files: ModelFiles | None, output_dir: Path, step: int) -> Path | None:
    """Write `weights/step_{step}` (rank 0) and return its path; other ranks only help gather and get None."""
    state_dict = gather_full_state_dict(model)
    if dist.get_rank() != 0:
        return None
    assert files is not None, "rank 0 needs the base model's files"
    path = weights_dir(output_dir, step)
    # Written beside, then renamed in: a server may be loading a complete `step_n` of an earlier attempt
    # (a resumed run redoes steps), which must never be seen half-deleted or half-written.
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # a leftover of an interrupted save
    try:
        with writing(path):
            partial.mkdir(parents=True)
            files.config.save_pretrained(partial)
            files.generation_config.save_pretrained(partial)
            files.tokenizer.save_pretrained(partial)
            state_dict = checkpoint_state_dict(model, state_dict)
            tied = bool(getattr(files.config, "tie_word_embeddings", False))
            write_safetensors(state_dict, partial, files.dtype, tied=tied)
            for f in partial.iterdir():
                _fsync(f)
            mark_stable(partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # give the space back
        raise
    replaced = path.with_name(path.name + ".replaced")
    shutil.rmtree(replaced, ignore_errors=True)
    if path.exists():
        os.rename(path, replaced)  # open files of a reader stay valid; new readers see the new dir
    os.rename(partial, path)
    _fsync(path.parent)
    shutil.rmtree(replaced, ignore_errors=True)
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

    state_dict = drop_tied_head(state_dict, tied)
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state_dict.items()}
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        shard = {name: tensors[name] for name in names}
        atomic_write(path / filename, lambda f, shard=shard: f.write(save(shard, metadata={"format": "pt"})))
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}}
        index["weight_map"] = split.tensor_to_filename
        atomic_write_text(path / "model.safetensors.index.json", json.dumps(index, indent=2))


def prune_weights(output_dir: Path, keep: int) -> list[int]:
    """All but the `keep` newest weight steps; those of trainer checkpoints stay (a resume at step N serves
    weights/step_N)."""
    return prune_steps(weights_root(output_dir), keep=keep, protect=checkpoint_steps(output_dir, ("trainer",)))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
