"""Trainer checkpoints: `checkpoints/step_n/trainer/` as torch.distributed.checkpoint (DCP) shards.

A checkpoint at step n is the trainer's state after n optimizer steps, shared by the RL trainer and SFT:

    .metadata, __<rank>_0.distcp   DCP: model + optimizer (sharded as trained), scheduler, progress
    rng_rank<r>.pt                  torch RNG state of rank r (restored when the world size matches)
    hf/                             config, generation config and tokenizer, so `convert-checkpoint`
                                    can write a standalone HF model from this directory alone; with
                                    LoRA also `adapter_config.json` (the shards then hold the adapter
                                    and its optimizer state only; the base is the one it names)
    STABLE                          written last by rank 0 after every rank finished: only then it counts

DCP reshards on load, so a checkpoint resumes on any world size. `load_hf_state_dict` reads the model
weights back without a process group (for conversion on any machine).

Checkpoints live on a shared filesystem, so nothing read from one may run code: DCP's `.metadata` is a
pickle, which torch's own reader unpickles as is. `SafeReader` unpickles it with only the metadata classes
DCP writes (like `torch.load(weights_only=True)` for tensors); anything else, or a truncated file, is a
`CheckpointError` naming the checkpoint.
"""

from __future__ import annotations

import logging
import pickle
import shutil
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from prime_rl.protocol import atomic_write, is_stable, mark_stable, trainer_checkpoint_dir, writing
from prime_rl.protocol.paths import STABLE
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.weights import adapter_config

logger = logging.getLogger("prime_rl")

HF_FILES_DIR = "hf"


class CheckpointError(TrainerError):
    """A checkpoint that cannot be loaded safely; the message names it and says why."""


# The globals a DCP `.metadata` pickle refers to (torch 2.11): its dataclasses, sizes, dtypes, layouts, paths.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _METADATA_CLASSES.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} (not part of a checkpoint's metadata)")


def _safe_reader(path: Path):
    """A DCP reader of `path` whose index was read once already: a bad one is one clear CheckpointError here
    (inside dcp.load it would be wrapped per rank)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata_path = Path(self._get_metadata_path(kwargs.get("rank")))
            try:
                with open(metadata_path, "rb") as f:
                    metadata = _MetadataUnpickler(f).load()
            except (OSError, EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{metadata_path}: not a readable checkpoint index: {e}") from None
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    reader = SafeReader(path)
    reader.read_metadata()
    return reader


@dataclass
class Progress:
    """Counters carried across resumes."""

    step: int = 0  # optimizer steps taken
    tokens: int = 0  # tokens trained on (all ranks, padding included)
    samples: int = 0  # samples trained on
    epoch: int = 0  # SFT: passes over the dataset completed
    position: int = 0  # SFT: samples of the current epoch already used


def state_dict_options(model):
    """With LoRA the base is frozen and stays the base model's: a checkpoint holds the adapter (and its
    optimizer state) only, and loading one leaves the frozen base as loaded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _app_state(model, optimizer, scheduler, progress: Progress) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=state_dict_options(model))
    return {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "progress": asdict(progress)}


def save_checkpoint(
    output_dir: Path, step: int, model, optimizer, scheduler, progress: Progress, files, rank: int
) -> Path:
    """Collective: every rank writes its shards; rank 0 adds hf/ (from `files`) and then STABLE."""
    import torch.distributed.checkpoint as dcp

    path = trainer_checkpoint_dir(output_dir, step)
    if rank == 0 and path.exists():
        shutil.rmtree(path)  # an incomplete leftover (or an older run's): DCP must not mix its files in
    dist.barrier()
    with writing(path):
        dcp.save(_app_state(model, optimizer, scheduler, progress), checkpoint_id=path)
        rng = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        atomic_write(path / f"rng_rank{rank}.pt", lambda f: torch.save(rng, f))
        if rank == 0:
            hf = path / HF_FILES_DIR
            files.config.save_pretrained(hf)
            files.generation_config.save_pretrained(hf)
            files.tokenizer.save_pretrained(hf)
            if files.lora is not None:  # the shards hold the adapter only; this names its base
                adapter_config(files).save_pretrained(hf)
    dist.barrier()
    if rank == 0:
        mark_stable(path)
    return path


def load_checkpoint(output_dir: Path, step: int, model, optimizer, scheduler, rank: int) -> Progress:
    """Collective: restore model, optimizer, scheduler, progress (and this rank's RNG) from step `step`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = trainer_checkpoint_dir(output_dir, step)
    base_lrs = list(scheduler.base_lrs)
    state = _app_state(model, optimizer, scheduler, Progress())
    dcp.load(state, storage_reader=_safe_reader(path))
    options = state_dict_options(model)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)
    scheduler.load_state_dict(state["scheduler"])
    # The schedule follows this run's config (lr, warmup, max_steps may have changed, e.g. a longer run):
    # keep the step count from the checkpoint but recompute the current learning rate from it.
    scheduler.base_lrs = base_lrs
    for group, factor, base in zip(optimizer.param_groups, scheduler.lr_lambdas, base_lrs, strict=True):
        group["initial_lr"], group["lr"] = base, base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    rng_file = path / f"rng_rank{rank}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        logger.warning(f"{rng_file} missing (resuming on a different world size?): RNG state not restored")
    return Progress(**state["progress"])


def load_hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The full model weights of a trainer checkpoint dir, read without a process group (any world size)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    if not is_stable(path):
        raise FileNotFoundError(f"{path} is not a complete trainer checkpoint (no {STABLE} marker)")
    with warnings.catch_warnings():  # "no process group: loading in a single process" is exactly the intent
        warnings.simplefilter("ignore", UserWarning)
        state = _load_state_dict_from_keys(keys={"model"}, storage_reader=_safe_reader(path))
    return state["model"]
