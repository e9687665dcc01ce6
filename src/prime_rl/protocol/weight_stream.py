"""The bytes of one weight step over the broadcast group (protocol/broadcast.py sets the group up): a header
(JSON in a uint8 tensor, never pickle: the store is unauthenticated) naming every tensor with its dtype, shape
and the rows (dim 0) each sender holds of it, then the tensors in header order, in buckets of up to 64 MiB (fewer,
larger transfers), each bucket one piece per sender holding rows of it (a broadcast from that sender), one bucket
on the wire while the next is taken (senders) or loaded (receivers), and an acknowledgement. Every collective is
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


def rows_of(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, elements per row) of a tensor of `shape`: rows are along dim 0; a 0-d tensor is one row."""
    return (shape[0], math.prod(shape[1:])) if shape else (1, 1)


def piece_numels(specs: list[tuple[str, Any, tuple[int, ...]]], rows: list[list[int]],
                 run: list[int]) -> list[list[int]]:  # fmt: skip
    """How a bucket (`run`, indices of `specs`) travels, both sides computing it from the header: per sender, the
    elements of each of the bucket's tensors it sends (its rows of it)."""
    senders = len(rows[run[0]]) if run else 1
    return [[rows[i][r] * rows_of(specs[i][2])[1] for i in run] for r in range(senders)]


def send_step(pg, step: int, specs: list[tuple[str, Any, tuple[int, ...]]], pieces: Iterable, device, timeout: float,
              rows: list[list[int]] | None = None, rank: int = 0) -> None:  # fmt: skip
    """A sender's side: the header for `specs` [(name, dtype, shape)] (group rank 0 sends it), then the tensors in
    `buckets`, each collective waited for at most `timeout` seconds.

    The tensors' rows (dim 0) may be spread over several senders (group ranks 0 .. senders - 1; this one is
    `rank`): `rows[i][r]` of tensor i come from sender r, in sender order (default: all from rank 0). Each bucket
    then travels as one piece per sender holding some of its rows: every sender's own rows, never a whole
    tensor gathered on one rank. `pieces` yields, for every tensor in order, this rank's rows of it (read only
    where it holds some); it may be a generator that gathers just in time: it runs on every trainer rank, even
    one with no `pg` (single sender: only rank 0 sends). One bucket is on the wire while the next is taken (at
    most two held). A failed send still walks `pieces` to its end (trainer ranks take part in each other's
    gathers), then raises its BroadcastError."""
    import torch

    rows = rows or [[rows_of(shape)[0]] for _, _, shape in specs]
    senders = len(rows[0]) if rows else 1
    failed: BroadcastError | None = None
    on_wire: list = []  # the works of the bucket in flight, kept (with their tensors) until completed

    def settle() -> None:
        nonlocal failed
        for work, _, what in on_wire:
            try:
                _settle(pg, work, timeout, what)
            except BroadcastError as e:
                failed = failed or e
        on_wire.clear()

    def send(tensors: list, what: str) -> None:
        """Start a bucket's broadcasts: (tensor, root) each."""
        nonlocal failed
        settle()
        for tensor, root in tensors if failed is None else ():
            try:
                on_wire.append((_start(lambda t=tensor, r=root: pg.broadcast(t, r)), tensor, what))
            except BroadcastError as e:
                failed = e
                return

    entries = [[n, str(d).removeprefix("torch."), list(s)] + ([r] if senders > 1 else []) for (n, d, s), r in
               zip(specs, rows, strict=True)]  # fmt: skip
    raw = json.dumps({"step": step, "senders": senders, "tensors": entries}).encode()
    if pg is not None:  # every sender has the same header: rank 0's is the one read
        send([(torch.tensor([len(raw)], dtype=torch.int64, device=device), 0)], f"the header size of step {step}")
        send([(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device), 0)], f"the header of step {step}")
    pieces = iter(pieces)
    for b, run in enumerate(buckets(specs)):
        stamp()  # sending 70B takes a while: each bucket is progress
        mine = [next(pieces) for _ in run]
        if pg is None or failed is not None:  # a rank that only gathers, or a send that already failed
            continue
        dtype = specs[run[0]][1]
        out = []
        for r, numels in enumerate(piece_numels(specs, rows, run)):
            count = sum(numels)
            if count == 0:
                continue
            if r != rank:  # another sender's piece reaches every member of the group: room for it
                out.append((torch.empty(count, dtype=dtype, device=device), r))
                continue
            parts = [t.to(device=device, dtype=dtype).reshape(-1) for t, i in zip(mine, run, strict=True) if rows[i][r]]
            out.append((parts[0] if len(parts) == 1 else torch.cat(parts), r))
        send(out, f"bucket {b} of step {step}")
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
    every tensor (each bucket's senders' pieces put together, the next bucket arriving while the caller takes
    one), each collective waited for at most `timeout` seconds (the first also until `given_up` says the
    transfer was given up). A header `check` refuses (by raising) ends the transfer: the receiver leaves,
    which the senders see at once as a peer gone."""
    import torch

    size = torch.zeros(1, dtype=torch.int64, device=device)
    _broadcast(pg, size, timeout, "the trainer's weight header size", given_up)
    if not 0 < int(size.item()) <= 256 * 2**20:
        raise BroadcastError(f"a weight header of {int(size.item())} bytes")
    raw = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    _broadcast(pg, raw, timeout, "the trainer's weight header")
    step, specs, rows = _header(raw.cpu().numpy().tobytes())
    check(step, {name: (shape, dtype) for name, dtype, shape in specs})
    yield step, None
    runs = buckets(specs)
    numels = [piece_numels(specs, rows, run) for run in runs]

    def receive(b: int) -> list:
        dtype = specs[runs[b][0]][1]
        flats = {r: torch.empty(sum(n), dtype=dtype, device=device) for r, n in enumerate(numels[b]) if sum(n)}
        return [(r, flat, _start(lambda f=flat, r=r: pg.broadcast(f, r))) for r, flat in flats.items()]

    coming = receive(0) if runs else None
    for b, run in enumerate(runs):
        pieces = {}
        for r, flat, work in coming:
            _settle(pg, work, timeout, f"bucket {b} of weight step {step} from trainer rank {r}")
            pieces[r] = flat.split(numels[b][r])
        coming = receive(b + 1) if b + 1 < len(runs) else None  # on the wire while the caller loads this one
        for k, i in enumerate(run):
            name, dtype, shape = specs[i]
            parts = [(pieces[r][k], rows[i][r]) for r in pieces if rows[i][r]]
            if len(parts) == 1:
                yield name, parts[0][0].view(shape)
            elif not parts:  # no rows at all
                yield name, torch.empty(shape, dtype=dtype, device=device)
            else:
                yield name, torch.cat([p.view(n, *shape[1:]) for p, n in parts])
    _acknowledge(pg, device, timeout, f"the other seats' acknowledgement of weight step {step}")


def _header(raw: bytes) -> tuple[int, list, list[list[int]]]:
    """(step, specs [(name, dtype, shape)], rows [per tensor: rows per sender]) of a received header, checked:
    known dtypes, no negative size, each tensor's rows adding up to its shape."""
    import torch

    try:
        header = json.loads(raw)
        step, senders = int(header["step"]), int(header.get("senders", 1))
        if not 1 <= senders <= 65536:
            raise ValueError(f"{senders} senders")
        specs, rows = [], []
        for entry in header["tensors"]:
            name, dtype, shape = str(entry[0]), entry[1], tuple(int(x) for x in entry[2])
            if dtype not in DTYPES or any(x < 0 for x in shape):
                raise ValueError(f"{name}: unknown dtype or negative size")
            split = [int(x) for x in entry[3]] if len(entry) > 3 else [rows_of(shape)[0]]
            if len(split) != senders or min(split) < 0 or sum(split) != rows_of(shape)[0]:
                raise ValueError(f"{name}: rows {split} of {senders} sender(s) do not make shape {list(shape)}")
            specs.append((name, getattr(torch, dtype), shape))
            rows.append(split)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise BroadcastError(f"malformed weight header: {e}") from None
    return step, specs, rows


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
