"""Writing `weights/step_n`: a complete HF model dir that inference loads with `from_pretrained`.

Every rank writes its own safetensors files, one full tensor at a time (the other ranks send it their
rows: trainer/gather.py); rank 0 writes config.json, generation_config.json, the tokenizer, the index and
checksum.json (the weight checksum of every tensor written, each rank's summed: protocol.parity), which the
orchestrator compares with what each server says it loaded. The parameter names are exactly the base
model's; once all files are fsynced rank 0 marks the dir `STABLE`. A dir without `STABLE` (e.g. left by a
crash) is never read and is replaced on the next write.

The model's own parameter names are not always the checkpoint's: transformers 5 converts some
architectures at load (MoE models get their per-expert `mlp.experts.{i}.gate_proj/up_proj/down_proj`
fused into 3-D `mlp.experts.gate_up_proj`/`down_proj`; Mixtral's `block_sparse_moe` also becomes `mlp`).
The inference servers load by checkpoint names, so the export undoes that conversion exactly as
`save_pretrained` does, one gathered tensor at a time (`checkpoint_parts`: a fused expert tensor becomes its
per-expert weights as it is written; no rank gathers the whole model), and `check_export_layout` refuses at
start-up a model where that would not give back its checkpoint's names and shapes.

With `[model.lora]` only the adapter is shipped: `weights/step_n` is then a peft adapter dir,
`adapter_config.json` + `adapter_model.safetensors` (float32, peft's names
`base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]) + `STABLE`, which vLLM's
LoRA loader and peft read as they are and the built-in engine merges into its base weights.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
import torch.distributed as dist
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save as safetensors_bytes
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PretrainedConfig

from prime_rl.configs import LoraConfig
from prime_rl.protocol import (
    atomic_write,
    atomic_write_text,
    checkpoint_steps,
    mark_stable,
    prune_steps,
    refuse_links,
    stamp,
    weights_dir,
    weights_root,
    writing,
)
from prime_rl.protocol.parity import Checksum, read_checksums, write_checksum
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.gather import full_tensor, gather_to, received_bytes, row_counts
from prime_rl.utils.hf_layout import checkpoint_files, checkpoint_state_dict, converted_at_load, header_specs
from prime_rl.utils.lora import ADAPTER, ADAPTER_WEIGHTS, PEFT_PREFIX
from prime_rl.utils.memory import PeakMemory

logger = logging.getLogger("prime_rl")

MAX_SHARD_SIZE = "5GB"
MAX_SHARD_BYTES = 5 * 10**9  # the same, as huggingface_hub reads "5GB"


@dataclass
class ModelFiles:
    """What rank 0 copies from the base model into every weights dir besides the tensors (and the dtype
    every rank writes its tensors in)."""

    config: object  # transformers.PretrainedConfig
    generation_config: object  # transformers.GenerationConfig
    tokenizer: object  # transformers.PreTrainedTokenizerBase
    dtype: torch.dtype  # dtype the weights are saved in (and config.json's): the trainer's compute dtype
    name: str = ""  # the base model (hub id or path), which an adapter names
    lora: LoraConfig | None = None  # set: only the adapter is exported


def build_model_files(name: str, lora: LoraConfig | None = None, dtype: torch.dtype | None = None) -> ModelFiles:
    """The base model's files; weights written in `dtype` (default: the base model's own). The trainer passes
    its compute dtype: a bf16 model trained in fp32 (CPU) and served from bf16-rounded weights would sample from
    another policy than the trainer scores (mismatch KL ~0.05 a step at 0.44 B), while on CUDA the bf16 export
    is exactly the bf16 copy the trainer's forward computes with."""
    config = AutoConfig.from_pretrained(name)
    if dtype is not None:
        config.dtype = dtype  # config.json of every weights dir says what its tensors are
    try:
        generation_config = GenerationConfig.from_pretrained(name)
    except OSError:  # not every model ships one; derive it from the model config like transformers does
        generation_config = GenerationConfig.from_model_config(config)
    tokenizer = AutoTokenizer.from_pretrained(name)
    return ModelFiles(config, generation_config, tokenizer, saved_dtype(config), name, lora)


def saved_dtype(config: PretrainedConfig) -> torch.dtype:
    """The dtype a model's weights are stored in (its config's `dtype`), float32 when unset."""
    dtype = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def meta_model(config: PretrainedConfig) -> torch.nn.Module:
    """The causal LM of `config` without memory (meta device): enough to revert its weight conversion."""
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
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    exported = drop_tied_head(exported, tied)
    wrong = sorted(k for k, v in exported.items() if stored.get(k) != tuple(v.shape))
    if wrong and exported.keys() == drop_tied_head(meta, tied).keys():
        raise TrainerError(  # nothing converted: the checkpoint itself lacks or misshapes them
            f"{arch}: the checkpoint {name!r} lacks {len(wrong)} of the model's tensors or holds them in another "
            f"shape, e.g. {wrong[:3]}"
        )
    if wrong:
        raise TrainerError(
            f"{arch}: transformers converts the weights of {name!r} at load and reverting that does not give "
            f"back the checkpoint's names and shapes ({len(wrong)} tensors differ, e.g. {wrong[:3]}), so "
            "inference could not load the weights the trainer writes"
        )


def save_weights(model: torch.nn.Module, files: ModelFiles, output_dir: Path, step: int) -> Path | None:
    """Write `weights/step_{step}` (every rank takes part) and return its path on rank 0, None elsewhere.

    Each rank writes its own safetensors files (`shard_plan`), streaming one gathered tensor at a time, so no
    process holds more than its FSDP shard plus one full tensor; rank 0 adds the config, tokenizer and index.
    Architectures transformers converts at load are reverted on a full state dict, on rank 0 (see module doc).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    path = weights_dir(output_dir, step)
    # Written beside, then renamed in: a server may be loading a complete `step_n` of an earlier attempt
    # (a resumed run redoes steps), which must never be seen half-deleted or half-written.
    partial = path.with_name(path.name + ".partial")
    replaced = path.with_name(path.name + ".replaced")
    refuse_links(partial, path, replaced)  # on every rank (the dir is shared): none waits for rank 0 alone
    peak = PeakMemory()
    try:
        with writing(path):
            if rank == 0:
                shutil.rmtree(partial, ignore_errors=True)  # a leftover of an interrupted save
                partial.mkdir(parents=True)
                if files.lora is None:
                    files.config.save_pretrained(partial)
                    files.generation_config.save_pretrained(partial)
                    files.tokenizer.save_pretrained(partial)
            dist.barrier()  # the dir exists before any rank writes into it
            checksum = Checksum()  # of the tensors this rank writes (docs/design.md §4)
            if files.lora is not None:
                write_adapter(model, files, partial, rank, checksum)
                written, received = [], 0
            else:
                written, received = write_own_shards(model, partial, files.dtype, rank, world, checksum)
            mib = round(received / 2**20, 1)
            report = [None] * world
            dist.all_gather_object(report, (written, peak.extra_mib(), mib, checksum.value, checksum.tensors))
            if rank == 0:
                if world > 1 or any(r[0] for r in report):
                    per_rank = json.dumps([r[:3] for r in report])
                    logger.debug(f"weights/step_{step}: per rank [files, peak extra MiB, MiB received]: {per_rank}")
                for *_, value, tensors in report[1:]:
                    checksum.merge(Checksum(value, tensors))
                write_checksum(partial, checksum, earlier=read_checksums(path))  # a redone step keeps the old
                for f in partial.iterdir():
                    _fsync(f)
                mark_stable(partial)
    except BaseException:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # give the space back
        raise
    if rank != 0:
        return None
    shutil.rmtree(replaced, ignore_errors=True)
    if path.exists():
        os.rename(path, replaced)  # open files of a reader stay valid; new readers see the new dir
    os.rename(partial, path)
    _fsync(path.parent)
    shutil.rmtree(replaced, ignore_errors=True)
    return path


def peft_name(name: str) -> str:
    """An adapter tensor's name in peft's files, from the model's own:
    `model.layers.0.mlp.up_proj.lora_A.default.weight` → `base_model.model.model.layers.0.mlp.up_proj.lora_A.weight`."""

    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA tensors of the model's state dict (possibly FSDP shards) under peft's file names."""

    return {
        peft_name(name): t
        for name, t in model.state_dict().items()
        if (".lora_A." in name or ".lora_B." in name) and f".{ADAPTER}." in name
    }


def adapter_config(files: ModelFiles):
    """peft's LoraConfig of the exported adapter (dropout 0: serving never drops)."""
    from peft import LoraConfig as PeftLoraConfig  # LoRA only (model.py `apply_lora`)

    lora = files.lora
    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=sorted(lora.target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=files.name,
    )


def write_adapter(
    model: torch.nn.Module, files: ModelFiles, path: Path, rank: int, checksum: Checksum | None = None
) -> None:
    """Collective: every rank takes part in gathering the (small) adapter tensors; rank 0 writes them (and
    adds them to `checksum`)."""
    tensors = {name: full_tensor(t).detach().float().cpu() for name, t in adapter_state(model).items()}
    if rank == 0:
        adapter_config(files).save_pretrained(path)
        write_safetensors(tensors, path, torch.float32, tied=False, filename=ADAPTER_WEIGHTS, checksum=checksum)


def shard_plan(sizes: list[tuple[str, int]], world: int, max_bytes: int) -> list[list[str]]:
    """Tensor names (in order) split into contiguous files of about equal bytes: at least one file per rank
    (file i is rank i % world's), none much above `max_bytes`."""
    total = sum(n for _, n in sizes)
    count = min(len(sizes), max(world, -(-total // max_bytes)))
    plan: list[list[str]] = [[]]
    done = 0
    for i, (name, n) in enumerate(sizes):
        left = len(sizes) - i
        # Start the next file once this one has its share, or when each later file needs a tensor of its own.
        if plan[-1] and len(plan) < count and (done >= total * len(plan) / count or left <= count - len(plan)):
            plan.append([])
        plan[-1].append(name)
        done += n
    return plan


def shard_name(i: int, count: int) -> str:
    return "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"


def export_specs(model: torch.nn.Module, dtype: torch.dtype) -> tuple[dict, dict]:
    """What leaves the trainer, by the file export and the broadcast alike: the state dict (possibly FSDP
    shards; a tied head stored once) and each tensor's (dtype, global shape) as exported, floating ones in
    `dtype`."""
    state = drop_tied_head(model.state_dict(), bool(getattr(model.config, "tie_word_embeddings", False)))
    specs = {n: (dtype if t.is_floating_point() else t.dtype, tuple(t.shape)) for n, t in state.items()}
    return state, specs


def checkpoint_parts(model: torch.nn.Module, exported: dict) -> dict[str, list[tuple[str, torch.dtype, tuple]]]:
    """Each exported tensor -> the checkpoint tensors it is written as, in order: itself, or, for an architecture
    transformers converts at load, what reverting that conversion makes of it alone (e.g. a fused
    `experts.gate_up_proj` [E, 2I, H] -> 2E per-expert `gate_proj`/`up_proj` weights; the same as reverting the
    whole state dict, tested), so that one tensor at a time is gathered and written."""
    if not converted_at_load(model):
        return {n: [(n, dtype, shape)] for n, (dtype, shape) in exported.items()}
    parts = {}
    for name, (dtype, shape) in exported.items():
        meta = {name: torch.empty(shape, dtype=dtype, device="meta")}
        parts[name] = [(k, v.dtype, tuple(v.shape)) for k, v in checkpoint_state_dict(model, meta).items()]
    return parts


def gathered(model: torch.nn.Module, state: dict, exported: dict, parts: dict, names: list[str], rank: int,
             held: dict):  # fmt: skip
    """Collective: (checkpoint name, tensor) for each of `names` in turn, in the export dtype, brought to this rank
    alone (`gather_to` with `held`, the `row_counts`: the other ranks call it at the same time) and, for a
    converted architecture, split into its checkpoint tensors (`checkpoint_parts`)."""
    for name in names:
        tensor = gather_to(state[name], exported[name][0], rank, held[name], rank)
        if len(parts[name]) == 1 and parts[name][0][0] == name:
            yield name, tensor
        else:
            yield from checkpoint_state_dict(model, {name: tensor}).items()


def write_own_shards(
    model: torch.nn.Module, path: Path, dtype: torch.dtype, rank: int, world: int, checksum: Checksum | None = None
) -> tuple[list[str], int]:
    """Collective: each tensor in turn goes to the rank that writes it (`gather_to`: its shard cast to `dtype`
    first; where the ranks hold runs of its rows, only that rank receives it); each rank writes the files
    `shard_plan` gives it, as the tensors arrive (its files' headers are known up front from the global shapes),
    in the checkpoint's layout (`checkpoint_parts`), adding each tensor it writes to `checksum` on the tensor's
    device. No rank holds more than its shards and one gathered tensor. Returns its files and the bytes of
    other ranks' rows it received."""
    checksum = Checksum() if checksum is None else checksum
    state, exported = export_specs(model, dtype)
    parts = checkpoint_parts(model, exported)
    held = row_counts(state, exported, world)
    nbytes = [(n, sum(math.prod(shape) * d.itemsize for _, d, shape in parts[n])) for n in exported]
    plan, sizes = shard_plan(nbytes, world, MAX_SHARD_BYTES), dict(nbytes)
    mine, received = [], 0
    for i, names in enumerate(plan):
        owner = i % world
        if owner != rank:
            for name in names:
                gather_to(state[name], exported[name][0], owner, held[name], rank)  # sends this rank's rows
                received += received_bytes(sizes[name], held[name], rank, owner)
                stamp()
            continue
        specs = [spec for n in names for spec in parts[n]]
        received += sum(received_bytes(sizes[n], held[n], rank, owner) for n in names)

        def stream(f: BinaryIO, names: list[str] = names, specs: list = specs) -> None:
            f.write(safetensors_header(specs))
            for key, tensor in gathered(model, state, exported, parts, names, rank, held):
                checksum.add(key, tensor)  # on the tensor's device: no host pass over the bytes
                f.write(tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
                stamp()  # a 70B export takes minutes: each tensor written is progress

        atomic_write(path / shard_name(i, len(plan)), stream)
        mine.append(shard_name(i, len(plan)))
    if rank == 0 and len(plan) > 1:
        weight_map = {
            key: shard_name(i, len(plan)) for i, names in enumerate(plan) for n in names for key, *_ in parts[n]
        }
        index = {"metadata": {"total_size": sum(n for _, n in nbytes)}, "weight_map": weight_map}
        atomic_write_text(path / "model.safetensors.index.json", json.dumps(index, indent=2))
    return mine, received


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def safetensors_header(specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """The length-prefixed JSON header of a safetensors file holding `specs` [(name, dtype, shape)], data
    in that order (so the tensors can be streamed after it)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in specs:
        end = offset + math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(
    state_dict: dict[str, torch.Tensor],
    path: Path,
    dtype: torch.dtype,
    tied: bool,
    max_shard_size: str = MAX_SHARD_SIZE,
    filename: str = "model.safetensors",
    checksum: Checksum | None = None,
) -> None:
    """Shards named like `save_pretrained`'s (`model.safetensors` or `model-0000i-of-0000n.safetensors` + index);
    the tensors as written are added to `checksum` when given."""
    state_dict = drop_tied_head(state_dict, tied)
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state_dict.items()}
    for name, tensor in tensors.items() if checksum is not None else ():
        checksum.add(name, tensor)
    pattern = filename.replace(".safetensors", "{suffix}.safetensors")
    split = split_torch_state_dict_into_shards(tensors, filename_pattern=pattern, max_shard_size=max_shard_size)
    for shard_file, names in split.filename_to_tensors.items():
        shard = {name: tensors[name] for name in names}
        atomic_write(
            path / shard_file, lambda f, shard=shard: f.write(safetensors_bytes(shard, metadata={"format": "pt"}))
        )
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}}
        index["weight_map"] = split.tensor_to_filename
        atomic_write_text(path / f"{filename}.index.json", json.dumps(index, indent=2))


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
