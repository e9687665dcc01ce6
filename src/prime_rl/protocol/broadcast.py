"""Weights over a process group (`weight_transfer = "broadcast"`, docs/design.md §4): trainer → every inference worker.

The group is its own torch.distributed world, apart from the trainer's: ranks 0 .. T-1 are the trainer's T
ranks (the senders), the other ranks the inference workers' seats (one per built-in server, one per vLLM
worker), counted by the orchestrator from its servers' /health and passed on by the receivers through the
rendezvous. Its rendezvous is a
TCPStore that trainer rank 0 hosts at `weight_transfer.host:port`; `group` (a fresh nonce per trainer
start) prefixes every key, so a restarted trainer forms a new group and servers of the old one rejoin.

One step n:
1. the trainer writes `broadcast/step_n.json` {"step", "group", "backend", "senders"} (the hand-off, like
   `STABLE`), and
   again with "checksum" (the step's weight checksum, protocol.parity) once the step was sent;
2. the orchestrator asks every server to receive it (POST /update_weights {"broadcast": {...}});
3. each receiver sets the store's `world_size`, adds itself to its `ready/n` count (`ask_for`), joins the
   group if it is not in this one, and waits for the header; the trainer's ranks wait until the count is
   complete, then send:
   a header (JSON in a uint8 tensor, never pickle: the store is unauthenticated) naming every tensor with
   its dtype, shape and the rows (dim 0) each trainer rank holds of it, then the tensors in header order,
   each trainer rank sending its own rows (its FSDP shard, cast to the export dtype): no rank gathers the
   model (a tensor that is not sharded by rows, e.g. one written as several checkpoint tensors, is gathered
   and sent by rank 0).
4. receivers check the header against the served model before receiving any tensor (a mismatch ends the
   transfer, which the sender sees at once), and swap only once everything arrived. Tensors travel in
   buckets of up to 64 MiB: fewer, larger transfers (protocol/weight_stream.py: the bytes of a step).
Every collective has `timeout`, waited for on the host (`wait_for_work`): a peer that dies or never comes is
a BroadcastError naming it, never a hang or a dead process. On nccl that takes two things torch does not do by
default: `work.wait()` only orders CUDA streams (the host goes on, and a later `.item()` blocks for good), and
the group's watchdog, at its timeout, takes the whole process down (TORCH_NCCL_ASYNC_ERROR_HANDLING=3, the
default). So every work is polled until done or `timeout`, then the communicator is aborted (hung kernels
return) and the error raised; and the weight group alone is created in mode 2 (CleanUpOnly: the watchdog aborts
the communicator and leaves the process). A receiver that fails reports why in the store (`report_failure`),
so the trainer forms a new group at once instead of waiting for asks that will not come; the trainer sends the
step again to the seats that ask (trainer/broadcast.py). nccl on CUDA, gloo on CPU.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

from prime_rl.protocol.files import atomic_write_json, atomic_write_text
from prime_rl.protocol.paths import broadcast_root, step_of

MARKER_SUFFIX = ".json"


class BroadcastError(RuntimeError):
    """A weight broadcast failed; the message names the peer and the step."""


class BroadcastTimeout(BroadcastError, TimeoutError):
    """A collective of the weight group did not complete within the transfer timeout (its communicator was
    aborted); the message names what was waited for."""


@dataclass(frozen=True)
class Rendezvous:
    """Where a group meets: what the orchestrator tells a server (plus the server's first rank)."""

    host: str
    port: int
    group: str
    world_size: int
    backend: str  # "gloo" | "nccl"
    timeout: float
    senders: int = 1  # the trainer's ranks in the group (ranks 0 .. senders - 1); the seats follow

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"


def marker_file(output_dir: Path, step: int) -> Path:
    return broadcast_root(output_dir) / f"step_{step}{MARKER_SUFFIX}"


def write_marker(output_dir: Path, step: int, rdv: Rendezvous, checksum: str | None = None) -> None:
    """Announce that step `step` is about to be sent in group `rdv` (the previous announcement goes); written
    again with the step's weight `checksum` (protocol.parity) once it was sent."""
    marker = {"step": step, "group": rdv.group, "backend": rdv.backend, "senders": rdv.senders}
    atomic_write_json(marker_file(output_dir, step), marker | ({"checksum": checksum} if checksum else {}))
    for old in _markers(output_dir):
        if step_of(old.with_suffix("")) != step:
            old.unlink(missing_ok=True)


def read_marker(output_dir: Path) -> dict | None:
    """{"step", "group", "backend", "senders", "checksum"} of the newest announcement, if any (checksum: None
    until sent)."""
    best = None
    for path in _markers(output_dir):
        try:
            data = json.loads(path.read_text())
            marker = {"step": int(data["step"]), "group": str(data["group"]), "backend": str(data["backend"])}
            marker["senders"] = int(data.get("senders", 1))
            marker["checksum"] = str(data["checksum"]) if data.get("checksum") else None
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being replaced
        if best is None or marker["step"] > best["step"]:
            best = marker
    return best


def clear_markers(output_dir: Path) -> None:
    root = broadcast_root(output_dir)
    for old in _markers(output_dir) + (list(root.glob("*.unreached")) if root.is_dir() else []):
        old.unlink(missing_ok=True)


def unreached_file(output_dir: Path, step: int, group: str) -> Path:
    """Written by the orchestrator when it could not reach a server to relay `step` in `group`: that seat will
    never ask, so the trainer gives the group up at once rather than wait for it (and the other seats with it)."""
    return broadcast_root(output_dir) / f"step_{step}.{group}.unreached"


def report_unreached(output_dir: Path, step: int, group: str, reason: str) -> None:
    atomic_write_text(unreached_file(output_dir, step, group), reason[:2000])


def unreached(output_dir: Path, step: int, group: str) -> str | None:
    """What the orchestrator reported of a server it could not reach for `step` in `group`, if anything."""
    try:
        return unreached_file(output_dir, step, group).read_text()
    except OSError:
        return None


def _markers(output_dir: Path) -> list[Path]:
    root = broadcast_root(output_dir)
    return list(root.glob(f"step_*{MARKER_SUFFIX}")) if root.is_dir() else []


def connect_store(rdv: Rendezvous, master: bool):
    import torch.distributed as dist

    try:
        return dist.TCPStore(rdv.host, rdv.port, None, master, timeout=timedelta(seconds=rdv.timeout),
                             wait_for_workers=False)  # fmt: skip
    except (RuntimeError, OSError) as e:
        what = "host" if master else "reach"
        raise BroadcastError(f"cannot {what} the weight broadcast rendezvous at {rdv.where}: {e}") from None


def join_group(store, rdv: Rendezvous, rank: int, given_up: GivenUp | None = None):
    """This process's handle on group `rdv.group` (blocks until all `world_size` ranks joined, or timeout, or
    `given_up` says the group's transfer was given up)."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"{rdv.group}/pg", store)
    timeout = timedelta(seconds=rdv.timeout)
    try:
        if rdv.backend == "nccl":
            return nccl_group(prefixed, rank, rdv.world_size, timeout)
        make = lambda: dist.ProcessGroupGloo(prefixed, rank, rdv.world_size, timeout)  # noqa: E731
        return _bounded(make, rdv.timeout + 5, given_up)
    except (RuntimeError, dist.DistError, TimeoutError) as e:
        raise BroadcastError(f"could not form the weight broadcast group at {rdv.where} as rank {rank}: {e}") from None


def _bounded(make, seconds: float, given_up: GivenUp | None = None):
    """`make()`, given up after `seconds` or once `given_up` says so. gloo's connect to a seat that died while the
    mesh formed retries past the group's timeout (104 s at 20 s, tests/integration/test_broadcast_failover.py);
    the constructor releases the GIL, so it runs in a daemon thread, left to fail on its own when abandoned (its
    group is never used)."""
    done, box = threading.Event(), {}

    def run():
        try:
            box["value"] = make()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
            box["error"] = e
        done.set()

    threading.Thread(target=run, name="weight-group-join", daemon=True).start()
    deadline = time.monotonic() + seconds
    while not done.wait(min(GIVEN_UP_POLL, max(0.0, deadline - time.monotonic()))):
        if given_up is not None and (why := given_up()) is not None:
            raise TimeoutError(f"the group was given up while it formed ({why})")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the group did not form within {seconds:.0f} s (a seat died while it formed?)")
    if "error" in box:
        raise box["error"]
    return box["value"]


GIVEN_UP_POLL = 0.5  # seconds between a waiting seat's looks at whether its group's transfer was given up
# The timeout of that look's own store client. A client that connects while the trainer dies retries for its whole
# timeout, twice (seen: a seat's update answered after > 60 s at a 30 s transfer timeout, instead of at once).
GIVEN_UP_STORE_TIMEOUT = 1.0


class GivenUp:
    """For a seat waiting on group `rdv` (while it forms, or for the trainer's first bytes): what the trainer or
    another seat reported when it gave the group's transfer of `step` up (the trainer does when the seats
    changed, or a seat failed), or None. One look per GIVEN_UP_POLL seconds, over a store client of its own
    (the group's may sit in a blocking wait) whose every wait is short: a look never holds up the caller's."""

    def __init__(self, rdv: Rendezvous, step: int):
        self.rdv, self.step = rdv, step
        self.store, self.last = None, -math.inf

    def __call__(self) -> str | None:
        if time.monotonic() - self.last < GIVEN_UP_POLL:
            return None
        self.last = time.monotonic()
        key = failed_key(self.rdv, self.step)
        try:
            self.store = self.store or connect_store(replace(self.rdv, timeout=GIVEN_UP_STORE_TIMEOUT), master=False)
            return self.store.get(key).decode(errors="replace") if self.store.check([key]) else None
        except (RuntimeError, OSError):  # the store went (BroadcastError is one): the group's own wait says so
            return None


# The watchdog's mode for the weight group (torch's ErrorHandlingMode): 2 = CleanUpOnly, abort the communicator
# on a timeout or error and leave the process alive (the default, 3 = SkipCleanUp, takes the process down).
NCCL_ERROR_HANDLING = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def nccl_group(store, rank: int, world_size: int, timeout: timedelta):
    """A ProcessGroupNCCL whose failures are errors of this process, not its end: the watchdog's timeout is
    `timeout` and its mode CleanUpOnly. torch reads the mode from the environment when it creates a group, so it
    is set for this group's creation alone: the trainer's own groups keep theirs."""
    import torch.distributed as dist

    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    with environment(NCCL_ERROR_HANDLING):
        return dist.ProcessGroupNCCL(store, rank, world_size, options)


@contextmanager
def environment(values: dict[str, str]):
    """`values` in os.environ (which C++ getenv sees) for the block only."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ready_key(rdv: Rendezvous, step: int) -> str:
    """How many seats asked for `step`; the one that completes the count sets `all_ready_key`."""
    return f"{rdv.group}/ready/{step}"


def all_ready_key(rdv: Rendezvous, step: int) -> str:
    return f"{rdv.group}/all_ready/{step}"


def ask_for(store, rdv: Rendezvous, step: int) -> None:
    """A receiver's request for `step`: tells the trainer the group's size, counts itself in."""
    store.set(size_key(rdv), str(rdv.world_size))
    if store.add(ready_key(rdv, step), 1) == rdv.world_size - rdv.senders:
        store.set(all_ready_key(rdv, step), "1")


def failed_key(rdv: Rendezvous, step: int) -> str:
    """Set by a receiver whose transfer of `step` in this group failed (its reason): the trainer gives up on
    the group at once instead of waiting for asks or peers that will not come."""
    return f"{rdv.group}/failed/{step}"


def report_failure(store, rdv: Rendezvous, step: int, reason: str) -> None:
    """A receiver's failure, for the trainer (best effort: the store may be what failed)."""
    try:
        store.set(failed_key(rdv, step), reason[:2000])
    except (RuntimeError, OSError):
        pass


def size_key(rdv: Rendezvous) -> str:
    """The group's world size, which each receiver sets (from the orchestrator's count of seats)."""
    return f"{rdv.group}/world_size"
