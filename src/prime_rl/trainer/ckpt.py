"""Trainer checkpoints: `checkpoints/step_n/trainer/` as torch.distributed.checkpoint (DCP) shards.

A checkpoint at step n is the trainer's state after n optimizer steps, shared by the RL trainer and SFT:

    .metadata, __<rank>_0.distcp   DCP: model + optimizer (sharded as trained), scheduler, progress
    rng_rank<r>.pt                  torch RNG state of rank r (restored when the world size matches)
    hf/                             config, generation config and tokenizer, so `convert-checkpoint`
                                    can write a standalone HF model from this directory alone; with
                                    LoRA also `adapter_config.json` (the shards then hold the adapter
                                    and its optimizer state only; the base is the one it names)
    STABLE                          written last by rank 0 after every rank finished: only then it counts

Written in the background by default (`AsyncCheckpointer`, `--ckpt.async-save`): the step waits only while
DCP copies the state into host memory (staging), a thread writes the copy, and rank 0 marks the dir STABLE
as soon as every rank's write is done. A kill before that leaves a dir without STABLE, which resume never
picks. At most one checkpoint is in flight.

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
import time
import warnings
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from prime_rl.protocol import (
    atomic_write,
    is_disk_full,
    is_stable,
    mark_stable,
    refuse_links,
    trainer_checkpoint_dir,
    unreadable,
    writing,
)
from prime_rl.protocol.paths import STABLE
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.weights import ModelFiles, adapter_config

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


def state_dict_options(model: nn.Module) -> StateDictOptions:
    """With LoRA the base is frozen and stays the base model's: a checkpoint holds the adapter (and its
    optimizer state) only, and loading one leaves the frozen base as loaded."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _app_state(model: nn.Module, optimizer: Optimizer, scheduler: LambdaLR, progress: Progress) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=state_dict_options(model))
    return {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "progress": asdict(progress)}


def save_checkpoint(
    output_dir: Path,
    step: int,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: LambdaLR,
    progress: Progress,
    files: ModelFiles,
    rank: int,
) -> Path:
    """Collective: every rank writes its shards; rank 0 adds hf/ (from `files`) and then STABLE."""
    path = _fresh_dir(output_dir, step, rank)
    try:
        with writing(path):
            dcp.save(_app_state(model, optimizer, scheduler, progress), checkpoint_id=path)
            _write_small_files(path, files, rank)
    except CheckpointException as e:  # a BaseException: it would pass every handler as a traceback
        _discard(path, rank)
        raise CheckpointError(f"writing checkpoint {path} failed: {_describe(e)}") from None
    except BaseException:
        _discard(path, rank)
        raise
    dist.barrier()
    if rank == 0:
        mark_stable(path)
    return path


def _discard(path: Path, rank: int) -> None:
    """A checkpoint whose write failed goes at once (rank 0): its space back, and no half-written dir beside
    the complete ones (resume would skip it, having no STABLE; a person listing checkpoints/ would not)."""
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        try:
            path.parent.rmdir()  # checkpoints/step_n too, unless the orchestrator's record is there
        except OSError:
            pass


def _fresh_dir(output_dir: Path, step: int, rank: int) -> Path:
    """Collective: the empty (or absent) dir of checkpoint `step`."""
    path = trainer_checkpoint_dir(output_dir, step)
    refuse_links(path.parent, path)
    if rank == 0 and path.exists():
        shutil.rmtree(path)  # an incomplete leftover (or an older run's): DCP must not mix its files in
    dist.barrier()
    return path


def _write_small_files(path: Path, files: ModelFiles, rank: int) -> None:
    """This rank's RNG state; on rank 0 also hf/ (config, generation config, tokenizer, adapter config)."""
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


@dataclass
class InFlight:
    """A checkpoint being written in the background."""

    path: Path
    step: int
    future: Future
    started: float = field(default_factory=time.perf_counter)
    written: float | None = None  # perf_counter when this rank's write ended

    @property
    def write_seconds(self) -> float | None:
        return None if self.written is None else self.written - self.started


class AsyncCheckpointer:
    """Trainer checkpoints written in the background, at most one at a time.

    `start` copies the state into host memory (DCP's staging: every tensor, CPU ones too, so the next
    optimizer step cannot change what is written) and returns; a thread writes the copy, and rank 0 marks it
    STABLE as soon as every rank's write ended. `finish` waits for it (and raises a failed write). Both are
    collective, called by every rank at the same point between steps."""

    def __init__(self, rank: int):
        self.rank = rank
        # Created once, collectively. DCP's background thread runs its collectives (plan and finish gathers)
        # on this gloo group: on the default group they would interleave with the training step's.
        self.group = dist.new_group(backend="gloo")
        # One stager for the run: it keeps each tensor's host copy and copies into it at the next save (the
        # parameters and AdamW moments change in place, so their storages stay). A fresh stager per save
        # allocates and faults in 12 B/param each time: at 0.44 B on CPU that took longer (11 s) than the
        # synchronous save it replaces (9 s); reused, a save waits for a plain copy.
        plain = StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                               use_non_blocking_copy=False)  # fmt: skip
        self.stager = DefaultStager(plain)  # host memory, staged in the calling thread
        self.in_flight: InFlight | None = None

    def start(
        self,
        output_dir: Path,
        step: int,
        model: nn.Module,
        optimizer: Optimizer,
        scheduler: LambdaLR,
        progress: Progress,
        files: ModelFiles,
    ) -> Path:
        """Collective: stage checkpoint `step` and write it in the background (RNG and hf/ files right now)."""
        if self.in_flight is not None:
            raise RuntimeError(f"checkpoint {self.in_flight.path} is still being written: finish() it first")
        path = _fresh_dir(output_dir, step, self.rank)
        try:
            with writing(path):
                # Before the shards: a rank takes part in DCP's first gather only after this, so a write that
                # ended on every rank (DCP's finish gather) also means every rank's small files are there.
                _write_small_files(path, files, self.rank)
                state = _app_state(model, optimizer, scheduler, progress)
                future = dcp.async_save(state, checkpoint_id=path, process_group=self.group, async_stager=self.stager)
        except BaseException:
            _discard(path, self.rank)
            raise
        in_flight = self.in_flight = InFlight(path, step, future)
        future.add_done_callback(lambda f: self._written(in_flight, f))
        return path

    def _written(self, in_flight: InFlight, future: Future) -> None:
        """In the writing thread, when this rank's write ended. Rank 0 marks the checkpoint STABLE at once (see
        `close` for why its own success is every rank's): waiting for the next save to do it would leave a
        crash between the two resuming from the checkpoint before, `ckpt.interval` steps back."""
        in_flight.written = time.perf_counter()
        if self.rank == 0 and future.exception() is None:
            try:
                mark_stable(in_flight.path)
            except OSError as e:  # `finish` tries again, and raises there
                logger.warning(f"checkpoint {in_flight.path} written but not yet marked {STABLE}: {e}")
            logger.info(
                f"checkpoint step {in_flight.step} written in {in_flight.write_seconds:.1f}s (in the background)"
            )

    def finish(self) -> InFlight | None:
        """Collective: wait for the checkpoint in flight (if any); once every rank's write ended, rank 0 marks it
        STABLE. A failed write (on any rank) raises here on every rank, naming the checkpoint."""
        in_flight = self.in_flight
        if in_flight is None:
            return None
        error = in_flight.future.exception()  # bounded by the write: its collectives have the group's timeout
        self.in_flight = None
        if in_flight.written is None:  # the done callback runs after waiters wake
            in_flight.written = time.perf_counter()
        # Every rank agrees before STABLE (and every rank raises if one failed, rather than one rank going on).
        failed = torch.tensor([float(error is not None)])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
        try:
            if error is not None:
                with writing(in_flight.path):  # a full disk is DiskFull, judged before the dir goes
                    raise CheckpointError(f"writing checkpoint {in_flight.path} failed: {_describe(error)}") from error
            if failed.item() > 0:
                raise CheckpointError(f"writing checkpoint {in_flight.path} failed on another rank")
        except BaseException:
            _discard(in_flight.path, self.rank)
            raise
        if self.rank == 0 and not is_stable(in_flight.path):
            mark_stable(in_flight.path)
        return in_flight

    def close(self) -> None:
        """Not collective, on the way out after an error (the other ranks may be anywhere): wait for this rank's
        write, so the process group is not torn down under it. Rank 0 marks the checkpoint STABLE if its own
        write succeeded: DCP reports success on rank 0 only after its finish gather saw every rank's write
        succeed, and each rank wrote its small files before it joined. Then the staging copies are let go."""
        in_flight, self.in_flight = self.in_flight, None
        try:
            error = in_flight and in_flight.future.exception()
            if error:
                why = "no space left on its device" if is_disk_full(error, in_flight.path) else _describe(error)
                logger.warning(f"checkpoint {in_flight.path} not written (removed): {why}")
                _discard(in_flight.path, self.rank)
            elif in_flight and self.rank == 0 and not is_stable(in_flight.path):  # the done callback's mark failed
                mark_stable(in_flight.path)
        except OSError as e:  # never hide the error this exit is about
            logger.warning(f"checkpoint {in_flight.path} written but not marked {STABLE}: {e}")
        finally:
            self.stager.close()


def _describe(error: BaseException) -> str:
    """One line for a failed write: DCP's exception holds each failed rank's exception (and a traceback)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = [(rank, f[0] if isinstance(f, tuple) else f) for rank, f in sorted(failures.items())]
        return "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, e in parts)
    return f"{type(error).__name__}: {error}"


def load_checkpoint(
    output_dir: Path, step: int, model: nn.Module, optimizer: Optimizer, scheduler: LambdaLR, rank: int
) -> Progress:
    """Collective: restore model, optimizer, scheduler, progress (and this rank's RNG) from step `step`."""
    path = trainer_checkpoint_dir(output_dir, step)
    base_lrs = list(scheduler.base_lrs)
    state = _app_state(model, optimizer, scheduler, Progress())
    reader = _safe_reader(path)
    try:
        dcp.load(state, storage_reader=reader)
    except (Exception, CheckpointException) as e:  # DCP's own is a BaseException holding each rank's error
        raise CheckpointError(unreadable(path, "trainer checkpoint", e)) from None
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
        try:
            rng = torch.load(rng_file, weights_only=True)
        except Exception as e:
            raise CheckpointError(unreadable(rng_file, "RNG state", e)) from None
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        logger.warning(f"{rng_file} missing (resuming on a different world size?): RNG state not restored")
    return Progress(**state["progress"])


def load_hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The full model weights of a trainer checkpoint dir, read without a process group (any world size)."""
    if not is_stable(path):
        raise FileNotFoundError(f"{path} is not a complete trainer checkpoint (no {STABLE} marker)")
    with warnings.catch_warnings():  # "no process group: loading in a single process" is exactly the intent
        warnings.simplefilter("ignore", UserWarning)
        state = _load_state_dict_from_keys(keys={"model"}, storage_reader=_safe_reader(path))
    return state["model"]
