"""Weights over a process group (`weight_transfer = "broadcast"`, DESIGN §4): trainer → every inference worker.

The group is its own torch.distributed world, apart from the trainer's: rank 0 is trainer rank 0, ranks
1..receivers are the inference workers (one per built-in server, one per vLLM worker). Its rendezvous is a
TCPStore that trainer rank 0 hosts at `weight_broadcast.host:port`; `group` (a fresh nonce per trainer
start) prefixes every key, so a restarted trainer forms a new group and servers of the old one rejoin.

One step n:
1. the trainer writes `broadcast/step_n.json` {"step", "group", "backend"} (the hand-off, like `STABLE`);
2. the orchestrator asks every server to receive it (POST /update_weights {"broadcast": {...}});
3. each receiver adds itself to the store's `ready/n` count, joins the group if it is not in this one, and
   waits for the header; the trainer's ranks wait for `ready/n` to reach `receivers`, then send:
   a header (JSON in a uint8 tensor, never pickle: the store is unauthenticated) naming every tensor with
   its dtype and shape, then each tensor in header order. Trainer ranks gather one full tensor at a time.
4. receivers check the header against the served model before keeping anything (a mismatch still drains
   the stream, so the sender is never stuck), and swap only once everything arrived.
Every collective has `timeout`; a peer that dies or never comes is an error naming it, and the receiver
leaves the group so that the next request forms a new one. nccl on CUDA, gloo on CPU.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from prime_rl.protocol.files import atomic_write_json
from prime_rl.protocol.paths import broadcast_root, step_of

MARKER_SUFFIX = ".json"


class BroadcastError(RuntimeError):
    """A weight broadcast failed; the message names the peer and the step."""


@dataclass(frozen=True)
class Rendezvous:
    """Where a group meets: what the orchestrator tells a server (plus the server's first rank)."""

    host: str
    port: int
    group: str
    world_size: int
    backend: str  # "gloo" | "nccl"
    timeout: float

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"


def marker_file(output_dir: Path, step: int) -> Path:
    return broadcast_root(output_dir) / f"step_{step}{MARKER_SUFFIX}"


def write_marker(output_dir: Path, step: int, rdv: Rendezvous) -> None:
    """Announce that step `step` is about to be sent in group `rdv` (the previous announcement goes)."""
    atomic_write_json(marker_file(output_dir, step), {"step": step, "group": rdv.group, "backend": rdv.backend})
    for old in _markers(output_dir):
        if step_of(old.with_suffix("")) != step:
            old.unlink(missing_ok=True)


def read_marker(output_dir: Path) -> dict | None:
    """{"step", "group", "backend"} of the newest announcement, if any."""
    best = None
    for path in _markers(output_dir):
        try:
            data = json.loads(path.read_text())
            marker = {"step": int(data["step"]), "group": str(data["group"]), "backend": str(data["backend"])}
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being replaced
        if best is None or marker["step"] > best["step"]:
            best = marker
    return best


def clear_markers(output_dir: Path) -> None:
    for old in _markers(output_dir):
        old.unlink(missing_ok=True)


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


def join_group(store, rdv: Rendezvous, rank: int):
    """This process's handle on group `rdv.group` (blocks until all `world_size` ranks joined, or timeout)."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"{rdv.group}/pg", store)
    timeout = timedelta(seconds=rdv.timeout)
    try:
        if rdv.backend == "nccl":  # GPU only: not exercised on the CPU machines the tests run on
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return dist.ProcessGroupNCCL(prefixed, rank, rdv.world_size, options)
        return dist.ProcessGroupGloo(prefixed, rank, rdv.world_size, timeout)
    except (RuntimeError, dist.DistError) as e:
        raise BroadcastError(f"could not form the weight broadcast group at {rdv.where} as rank {rank}: {e}") from None


def ready_key(rdv: Rendezvous, step: int) -> str:
    return f"{rdv.group}/ready/{step}"


# ---- the stream -----------------------------------------------------------------------------------


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def send_step(pg, step: int, specs: list[tuple[str, Any, tuple[int, ...]]], tensors: Iterable, device) -> None:
    """Root side: the header for `specs` [(name, dtype, shape)], then each tensor of `tensors` (same order).

    `tensors` may be a generator that gathers each one just in time; it runs on every trainer rank, and
    only rank 0 (pg is not None) sends."""
    import torch

    header = json.dumps({"step": step, "tensors": [[n, _dtype_name(d), list(s)] for n, d, s in specs]}).encode()
    if pg is not None:
        _broadcast(pg, torch.tensor([len(header)], dtype=torch.int64, device=device))
        _broadcast(pg, torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device))
    for (_, dtype, _), tensor in zip(specs, tensors, strict=True):
        if pg is not None:
            _broadcast(pg, tensor.to(device=device, dtype=dtype).contiguous())


def receive_step(pg, device, check: Callable[[int, dict[str, tuple[tuple[int, ...], Any]]], None]) -> Iterator:
    """Receiver side: yields (step, None) once the header is read and `check`ed, then (name, tensor) for
    every tensor. A header `check` refuses (by raising) is still drained to the end, then the error raised."""
    import torch

    size = torch.zeros(1, dtype=torch.int64, device=device)
    _broadcast(pg, size)
    raw = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    _broadcast(pg, raw)
    header = json.loads(bytes(raw.cpu().tolist()).decode())
    specs = {name: (tuple(shape), getattr(torch, dtype)) for name, dtype, shape in header["tensors"]}
    step = int(header["step"])
    refused = None
    try:
        check(step, specs)
    except Exception as e:  # noqa: BLE001 (re-raised after draining)
        refused = e
    if refused is None:
        yield step, None
    for name, (shape, dtype) in specs.items():
        tensor = torch.empty(shape, dtype=dtype, device=device)
        _broadcast(pg, tensor)
        if refused is None:
            yield name, tensor
    if refused is not None:
        raise refused


def _broadcast(pg, tensor) -> None:
    import torch.distributed as dist

    try:
        pg.broadcast(tensor, 0).wait()
    except (RuntimeError, dist.DistError) as e:
        raise BroadcastError(str(e).splitlines()[-1] if str(e) else type(e).__name__) from None
