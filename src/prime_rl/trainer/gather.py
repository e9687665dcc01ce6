"""How an exported tensor's rows reach the rank that writes or sends it.

Under FSDP2 each trainer rank holds a run of each tensor's rows (dim 0: `Shard(0)`; with HSDP, a replica after
the first counts as holding none). Where the ranks' runs tile a tensor in rank order (`row_counts`), the
filesystem export sends each rank's rows to the one rank that writes the tensor (`gather_to`) and the broadcast
sends them from where they are (trainer/broadcast.py `SendPlan`); any other tensor is gathered whole
(`full_tensor`), one at a time. Floating tensors are cast to the export dtype before they move.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from prime_rl.protocol.weight_stream import rows_of


def full_tensor(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole tensor of a (possibly FSDP-sharded) parameter: a collective over the trainer's ranks. With
    `dtype`, each rank casts its shard first, so the gather moves the export's bytes (half of fp32's for bf16);
    the cast is elementwise, so the result is the same."""
    tensor = tensor.detach()
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def row_run(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(first row, rows) of the run of dim-0 rows this rank holds of an FSDP-sharded tensor (none: (0, 0), a
    replica after the first), or None when its shard is not a run of rows."""
    if not isinstance(tensor, DTensor) or tensor.dim() == 0:
        return None
    if not all(p == Shard(0) or isinstance(p, Replicate) for p in tensor.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    coordinate = tensor.device_mesh.get_coordinate()
    first_replica = all(c == 0 for c, p in zip(coordinate, tensor.placements, strict=True) if isinstance(p, Replicate))
    return (offset[0], shape[0]) if first_replica else (0, 0)


def tiling_counts(runs: list[tuple[int, int] | None], total: int) -> list[int] | None:
    """Rows per rank when the ranks' runs tile rows 0..total in rank order, else None."""
    if any(r is None for r in runs):
        return None
    at = 0
    for first, n in runs:
        if n and first != at:
            return None
        at += n
    return [n for _, n in runs] if at == total else None


def row_counts(state: dict, exported: dict, world: int) -> dict[str, list[int] | None]:
    """Collective (each rank tells its runs): per exported tensor, the rows (dim 0) each rank holds of it when the
    ranks' runs tile it in rank order (FSDP's Shard(0); a replica after the first holds none), else None."""
    mine = {n: run for n, t in state.items() if (run := row_run(t))}
    runs = [mine]
    if world > 1:
        runs = [None] * world
        dist.all_gather_object(runs, mine)
    return {n: tiling_counts([r.get(n) for r in runs], rows_of(exported[n][1])[0]) for n in exported}


def gather_to(tensor: torch.Tensor, dtype: torch.dtype, owner: int, counts: list[int] | None, rank: int):
    """Collective: the whole of an exported tensor (floating ones cast to `dtype` before they move) on rank
    `owner`, None on the others. Where the ranks' rows tile it (`counts`), each rank sends its rows to the owner
    alone, so a rank receives only the tensors it writes (an all-gather gives every rank every tensor: N times
    the bytes over the trainer's links); otherwise every rank takes part in a full gather."""
    if counts is None:
        whole = full_tensor(tensor, dtype)
        return whole if rank == owner else None
    local = tensor.detach().to_local()
    local = local.to(dtype) if local.is_floating_point() else local
    if counts[owner] == sum(counts):  # the owner holds every row (one rank)
        return local if rank == owner else None
    if rank != owner:
        if counts[rank]:
            _wait(dist.batch_isend_irecv([dist.P2POp(dist.isend, local.contiguous(), owner)]))
        return None
    whole = torch.empty(tensor.shape, dtype=local.dtype, device=local.device)
    ops, at = [], 0
    for r, n in enumerate(counts):
        if r == rank and n:
            whole[at : at + n].copy_(local)
        elif n:
            ops.append(dist.P2POp(dist.irecv, whole[at : at + n], r))
        at += n
    _wait(dist.batch_isend_irecv(ops) if ops else [])
    return whole


def received_bytes(nbytes: int, counts: list[int] | None, rank: int, owner: int) -> int:
    """What `gather_to` brings this rank of a tensor of `nbytes`: other ranks' rows to its owner (all of them to
    every rank in a full gather)."""
    if counts is None:
        return nbytes
    total = sum(counts)
    return nbytes * (total - counts[rank]) // total if rank == owner and total else 0


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()
