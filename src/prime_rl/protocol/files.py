"""Crash- and NFS-safe writes: temp file in the same directory, fsync, rename; `STABLE` markers."""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from prime_rl.protocol.paths import STABLE, final_weights_dir, list_steps, rollouts_dir, weights_root


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


class DiskFull(OSError):
    """The filesystem under the output dir is full (or over quota); the message names what was being written."""


class UnsafeOutputDir(OSError):
    """The output dir holds what a run must not write over or delete: step dirs no prime-rl run wrote, or a
    symbolic link planted where a run writes. The message names the path."""


def refuse_links(*paths: Path) -> None:
    """UnsafeOutputDir naming the first of `paths` (where a run is about to write or delete a directory) that is
    a symbolic link: a run never makes one there, and following it would write into, or delete, its target."""
    for path in paths:
        if Path(path).is_symlink():
            raise UnsafeOutputDir(
                f"{path} is a symbolic link (to {os.readlink(path)}), where a run writes a directory of its own: "
                "remove the link"
            )


def _out_of_space(error: BaseException | None, depth: int = 0) -> bool:
    if error is None or depth > 8:
        return False
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # torch.distributed.checkpoint raises one exception holding each rank's (exception, traceback)
    failures = getattr(error, "failures", None)
    for failure in failures.values() if isinstance(failures, dict) else ():
        if _out_of_space(failure[0] if isinstance(failure, tuple) else failure, depth + 1):
            return True
    return _out_of_space(error.__cause__ or error.__context__, depth + 1)


# Below this much free space a failed write is taken for a full disk: torch's zip writer (torch.save, DCP's
# shards) reports ENOSPC as "[enforce fail at inline_container.cc:672] unexpected pos", the errno lost.
NEARLY_FULL = 1 << 20


def _no_space_left(path: Path) -> bool:
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        return shutil.disk_usage(existing).free < NEARLY_FULL
    except OSError:
        return False


def is_disk_full(error: BaseException, path: Path) -> bool:
    """Whether `error`, raised while writing `path`, means its filesystem is full (or over quota)."""
    failed = isinstance(error, Exception) or getattr(error, "failures", None) is not None  # not a signal or exit
    return failed and (_out_of_space(error) or _no_space_left(path))


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn running out of disk space while writing `path` (however deep the error, whatever torch made of it)
    into one DiskFull line."""
    try:
        yield
    except DiskFull:
        raise
    except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        if is_disk_full(e, path):
            raise DiskFull(f"no space left on the device of {path} while writing it; free space there") from None
        raise


def unreadable(path: Path, what: str, error: BaseException) -> str:
    """One line for a file of the output dir that cannot be read: which file, what it should be, and the first
    sentence of why (torch's own messages run to paragraphs; a truncated file can even be `[Errno 22]`)."""
    failures = getattr(error, "failures", None)  # torch.distributed.checkpoint: each rank's (exception, traceback)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        error = first[0] if isinstance(first, tuple) else first
    reason = f"{type(error).__name__}: {error}".splitlines()[0]
    reason = reason.split(". ")[0][:200]
    return f"{path}: not a readable {what} (cut short or overwritten?): {reason}"


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> Path:
    """Write `path` via `write(fileobj)` so readers see either nothing or the whole file."""
    path = Path(path)
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            os.fchmod(fd, 0o644)  # mkstemp makes 0600; other users on a shared filesystem must read our files
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    _fsync_dir(path.parent)
    return path


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, obj: object) -> Path:
    return atomic_write_text(path, json.dumps(obj))


def mark_stable(directory: Path) -> None:
    """Declare `directory` complete. Call only after every file in it was written atomically."""
    _fsync_dir(Path(directory))
    atomic_write_text(Path(directory) / STABLE, "")


def is_stable(directory: Path) -> bool:
    return (Path(directory) / STABLE).is_file()


def stable_steps(parent: Path) -> list[int]:
    """Sorted steps of the complete (`STABLE`) `step_n` directories under `parent`."""
    return [s for s in list_steps(parent) if is_stable(Path(parent) / f"step_{s}")]


def link_final_weights(output_dir: Path, step: int) -> Path:
    """Point `weights/final` at `step_n` (relative link, so the output dir can move), replacing it atomically."""
    link = final_weights_dir(output_dir)
    tmp = link.with_name(f".final.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(f"step_{step}", tmp, target_is_directory=True)
    os.replace(tmp, link)
    _fsync_dir(link.parent)
    return link


def prune_steps(parent: Path, keep: int, protect: Iterable[int] = ()) -> list[int]:
    """Delete all but the `keep` newest `step_n` entries under `parent` (never those in `protect`).

    Incomplete directories newer than the newest kept one are left alone: a writer may be busy there.
    """
    steps = list_steps(parent)
    kept = set(steps[-keep:]) if keep > 0 else set()
    protected = set(protect)
    removed = []
    for step in steps:
        if step in kept or step in protected or (kept and step > max(kept)):
            continue
        target = Path(parent) / f"step_{step}"
        if target.is_symlink():  # not ours (a run never makes one): never delete in its target
            continue
        # Drop the marker first so a concurrent reader never takes a half-deleted dir as complete.
        (target / STABLE).unlink(missing_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        removed.append(step)
    return removed


def clear_previous_run(output_dir: Path) -> str:
    """Delete the rollouts and weights an earlier run left in `output_dir` (checkpoints stay); say what went.

    A fresh run must never read them: a stale `weights/step_n` would be served as this run's policy, stale
    rollouts trained on, and the trainer's keep policy would prune its new weights in their favour.
    """
    removed = []
    for parent in (rollouts_dir(output_dir), weights_root(output_dir)):
        if steps := prune_steps(parent, keep=0):
            removed.append(f"{parent.name}/step_{steps[0]}..{steps[-1]}")
    return f"fresh start: removed {', '.join(removed)} left in {output_dir} by an earlier run" if removed else ""
