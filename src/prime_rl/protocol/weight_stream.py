"""The bytes of one weight step over the broadcast group (protocol/broadcast.py sets the group up): a header
(JSON in a uint8 tensor, never pickle: the store is unauthenticated) naming every tensor with its dtype and
shape, then the tensors in header order, in buckets of up to 64 MiB (fewer, larger transfers), one bucket on the
wire while the next is gathered (sender) or loaded (receivers), and an acknowledgement. Every collective is
waited for on the host with a bound (`wait_for_work`); a group that timed out or was given up is aborted
(`abandon`) so nothing stays hung on it."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prime_rl.protocol.broadcast import BroadcastError, BroadcastTimeout, GivenUp
from prime_rl.protocol.liveness import stamp

BUCKET_BYTES = 64 * 2**20  # tensors travel in buckets: one transfer each (per-tensor transfers cost 2.5x on gloo)
DTYPES = ("float32", "bfloat16", "float16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")


def buckets(specs: list[tuple[str, Any, tuple[int, ...]]], limit: int | None = None) -> list[list[int]]:
    """Indices of `specs` in consecutive runs of one dtype and at most `limit` bytes (a larger tensor alone).
    Both sides compute it from the header, so only the tensors' bytes travel. `limit`: BUCKET_BYTES."""
    limit = BUCKET_BYTES if limit is None else limit
    runs: list[list[int]] = []
    size = 0
    for i, (_, dtype, shape) in enumerate(specs):
        n = math.prod(shape) * dtype.itemsize
        if not runs or specs[runs[-1][0]][1] != dtype or size + n > limit:
            runs.append([])
            size = 0
        runs[-1].append(i)
        size += n
    return runs


def send_step(pg, step: int, specs: list[tuple[str, Any, tuple[int, ...]]], tensors: Iterable, device,
              timeout: float) -> None:  # fmt: skip
    """Root side: the header for `specs` [(name, dtype, shape)], then the tensors of `tensors` (same order) in
    `buckets`, each collective waited for at most `timeout` seconds. `tensors` may be a generator that gathers
    each one just in time; it runs on every trainer rank, and only rank 0 (pg is not None) sends: one bucket
    is on the wire while the next is gathered (at most two held). A failed send still walks `tensors` to its
    end (every trainer rank gathers in lockstep), then raises its BroadcastError."""
    import torch

    failed: BroadcastError | None = None
    on_wire: tuple | None = None  # (work, bucket, what): kept until its collective completed

    def settle() -> None:
        nonlocal failed, on_wire
        if on_wire is not None:
            work, _, what = on_wire
            on_wire = None
            try:
                _settle(pg, work, timeout, what)
            except BroadcastError as e:
                failed = failed or e

    def send(tensor, what: str) -> None:
        nonlocal failed, on_wire
        settle()
        if failed is None:
            try:
                on_wire = (_start(lambda: pg.broadcast(tensor, 0)), tensor, what)
            except BroadcastError as e:
                failed = e

    header = json.dumps({"step": step, "tensors": [[n, str(d).removeprefix("torch."), list(s)] for n, d, s in specs]})
    if pg is not None:
        raw = header.encode()
        send(torch.tensor([len(raw)], dtype=torch.int64, device=device), f"the header size of step {step}")
        send(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device), f"the header of step {step}")
    tensors = iter(tensors)
    for b, run in enumerate(buckets(specs)):
        stamp()  # sending 70B takes a while: each bucket is progress
        if pg is None or failed is not None:  # a rank that only gathers, or a send that already failed
            for _ in run:
                next(tensors)
            continue
        parts = [next(tensors).to(device=device, dtype=specs[i][1]).reshape(-1) for i in run]
        send(parts[0] if len(parts) == 1 else torch.cat(parts), f"bucket {b} of step {step}")
    if pg is not None:
        settle()
        if failed is None:
            try:
                _acknowledge(pg, device, timeout, f"the receivers' acknowledgement of step {step}")
            except BroadcastError as e:
                failed = e
    if failed is not None:
        try:
            raise failed
        finally:  # no cycle frame -> failed -> traceback -> frame: the caller's drop of `pg` must close it now
            failed = None


def receive_step(pg, device, check: Callable[[int, dict[str, tuple[tuple[int, ...], Any]]], None],
                 timeout: float, given_up: GivenUp | None = None) -> Iterator:  # fmt: skip
    """Receiver side: yields (step, None) once the header is read and `check`ed, then (name, tensor) for
    every tensor (views into the received buckets, the next bucket arriving while the caller takes one), each
    collective waited for at most `timeout` seconds (the first also until `given_up` says the transfer was
    given up). A header `check` refuses (by raising) ends the transfer: the receiver leaves, which the sender
    sees at once as a peer gone."""
    import torch

    size = torch.zeros(1, dtype=torch.int64, device=device)
    _broadcast(pg, size, timeout, "the trainer's weight header size", given_up)
    if not 0 < int(size.item()) <= 256 * 2**20:
        raise BroadcastError(f"a weight header of {int(size.item())} bytes")
    raw = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    _broadcast(pg, raw, timeout, "the trainer's weight header")
    try:
        header = json.loads(raw.cpu().numpy().tobytes())
        step = int(header["step"])
        specs = [(str(n), getattr(torch, d), tuple(int(x) for x in s)) for n, d, s in header["tensors"] if d in DTYPES]
        if len(specs) != len(header["tensors"]) or any(x < 0 for _, _, s in specs for x in s):
            raise ValueError("unknown dtype or negative size")
    except (ValueError, KeyError, TypeError) as e:
        raise BroadcastError(f"malformed weight header: {e}") from None
    check(step, {name: (shape, dtype) for name, dtype, shape in specs})
    yield step, None
    runs = buckets(specs)
    numels = [[math.prod(specs[i][2]) for i in run] for run in runs]

    def receive(b: int) -> tuple:
        flat = torch.empty(sum(numels[b]), dtype=specs[runs[b][0]][1], device=device)
        return flat, _start(lambda: pg.broadcast(flat, 0))

    coming = receive(0) if runs else None
    for b, run in enumerate(runs):
        flat, work = coming
        _settle(pg, work, timeout, f"bucket {b} of weight step {step}")
        coming = receive(b + 1) if b + 1 < len(runs) else None  # on the wire while the caller loads this one
        for i, part in zip(run, flat.split(numels[b]), strict=True):
            yield specs[i][0], part.view(specs[i][2])
    _acknowledge(pg, device, timeout, f"the other seats' acknowledgement of weight step {step}")


def _acknowledge(pg, device, timeout: float, what: str) -> None:
    """The end of a step: the sender returns only once every receiver has all of it (a receiver that died
    after the last bytes left the sender's socket is noticed here, not at the next step)."""
    import torch

    _run(pg, lambda: pg.allreduce([torch.zeros(1, device=device)]), timeout, what)


def _broadcast(pg, tensor, timeout: float, what: str, given_up: GivenUp | None = None) -> None:
    _run(pg, lambda: pg.broadcast(tensor, 0), timeout, what, given_up)


def _run(pg, collective, timeout: float, what: str, given_up: GivenUp | None = None) -> None:
    """Start a collective of the group and wait for it; a peer gone, a timeout or the transfer given up is a
    BroadcastError."""
    _settle(pg, _start(collective), timeout, what, given_up)


def _start(collective):
    """The work of a collective started on the group (its failure to start, a peer already gone: BroadcastError)."""
    import torch.distributed as dist

    try:
        return collective()
    except (RuntimeError, dist.DistError) as e:
        raise BroadcastError(_last_line(e)) from None


def _settle(pg, work, timeout: float, what: str, given_up: GivenUp | None = None) -> None:
    """Wait for a started collective (wait_for_work); its failure is a BroadcastError."""
    import torch.distributed as dist

    try:
        wait_for_work(work, pg, timeout, what, given_up)
    except BroadcastTimeout:
        raise
    except (RuntimeError, dist.DistError) as e:
        raise BroadcastError(_last_line(e)) from None


def _last_line(e: BaseException) -> str:
    return str(e).splitlines()[-1] if str(e) else type(e).__name__


def wait_for_work(work, pg, timeout: float, what: str, given_up: GivenUp | None = None) -> None:
    """Block the host until `work` (a collective of `pg`) completes, at most `timeout` seconds; then
    `work.wait()` raises its error, if any (and, on nccl, orders the current stream after it). Past the
    deadline the group is aborted, so that nothing stays hung on it, and BroadcastTimeout names `what`; once
    `given_up` reports the transfer given up, it is aborted too (BroadcastError).

    On nccl `work.wait()` alone returns at once (the host is not blocked) and `is_completed()` asks CUDA
    events without blocking, so this poll is what bounds a transfer there; on gloo the collective's own
    timeout usually answers first, with the peer's error."""
    deadline = time.monotonic() + timeout
    pause = 0.0002
    while not work.is_completed():
        if time.monotonic() >= deadline:
            abandon(pg)
            raise BroadcastTimeout(f"{what} did not complete within {timeout:g}s (weight group aborted)")
        if given_up is not None and (why := given_up()) is not None:
            abandon(pg)
            raise BroadcastError(f"{what}: the transfer was given up ({why})")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)  # a loopback bucket takes milliseconds: wake often at first
    work.wait()


# How long `abandon` waits for an abort. NCCL's abort ends NCCL kernels stuck on a dead peer, but it also waits
# for whatever else is queued ahead of them on the stream (seen on an H200: 27 s behind a 30 s kernel); the error
# must not wait with it.
ABORT_GRACE = 5.0


def abandon(pg) -> None:
    """Abort `pg` before it is dropped: on nccl this aborts its communicator, which ends kernels stuck on a dead
    peer. (gloo's abort does nothing for its peers; dropping the last reference closes its sockets, so they fail
    at once rather than at their timeout.) Best effort, at most ABORT_GRACE seconds: the abort goes on in a
    daemon thread past that, and the group is given up either way."""
    if pg is None:
        return

    def abort() -> None:
        try:
            pg.abort()
        except (RuntimeError, NotImplementedError, AttributeError):
            pass

    thread = threading.Thread(target=abort, name="weight-group-abort", daemon=True)
    thread.start()
    thread.join(ABORT_GRACE)
