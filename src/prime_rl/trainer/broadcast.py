"""The trainer's side of `weight_transfer = "broadcast"` (protocol.broadcast): send each step's weights to
every inference worker over a process group instead of writing `weights/step_n`.

Every trainer rank is a sender: it sends its own rows of each tensor (its FSDP shard, cast to the saved dtype:
what the filesystem export writes, so both transfers serve the same numbers), so no rank gathers the model and
the ranks' links all carry it. A tensor whose shard is not a run of rows (another placement, or one written
as several checkpoint tensors: a fused MoE expert tensor) goes to rank 0 alone, one at a time, and rank 0 sends
it (`SendPlan`). Each rank adds its rows to the step's weight checksum on its device; the ranks' parts are summed
once the step was sent, and the checksum goes into the step's announcement.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import time
import uuid
from dataclasses import dataclass

import torch

from prime_rl.configs.trainer import TrainerConfig
from prime_rl.protocol import wait_until
from prime_rl.protocol.broadcast import (
    BroadcastError,
    Rendezvous,
    all_ready_key,
    clear_markers,
    connect_store,
    failed_key,
    join_group,
    report_failure,
    size_key,
    unreached,
    unreached_file,
    write_marker,
)
from prime_rl.protocol.parity import RowSums
from prime_rl.protocol.weight_stream import abandon, rows_of, send_step
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.gather import gather_to, row_counts, row_run
from prime_rl.trainer.parallel import Dist
from prime_rl.trainer.weights import ModelFiles, checkpoint_parts, export_specs, gathered

logger = logging.getLogger("prime_rl")


# Tries of one step before the trainer gives up: each failure drops the group's dead seats (the orchestrator
# asks only live servers to rejoin), so a second try reaches the survivors; a third covers a failure during it.
SEND_ATTEMPTS = 3
# Seconds between looks for the orchestrator's report of a server it could not reach, while seats are awaited.
UNREACHED_POLL = 0.5
# New groups for one step because the seats changed (servers that came back or were added): no failure, but bounded.
MAX_RESEATS = 8


class Reseat(str):
    """Why a transfer was not tried: the servers now hold another number of seats than the group (a server came
    back, or the fleet changed); a new group seats them. Not a failure."""


class WeightSender:
    def __init__(self, config: TrainerConfig, model: torch.nn.Module, files: ModelFiles, d: Dist):
        self.config, self.d = config, d
        b = config.weight_transfer
        self.backend = b.backend if b.backend != "auto" else "nccl" if d.device.type == "cuda" else "gloo"
        # A fresh group per trainer start: servers still in an earlier one (a restarted trainer) rejoin.
        self.rdv = Rendezvous(b.host, b.port, "", 0, self.backend, b.timeout)  # the receivers tell the world size
        try:
            self.store = connect_store(self.rdv, master=d.is_main)
        except BroadcastError as e:
            raise TrainerError(f"{e} (is weight_transfer.port taken, by another run?)") from None
        if d.is_main:
            clear_markers(config.output_dir)
            self.store.set("group", uuid.uuid4().hex[:16])
        self.nonce = self.store.get("group").decode()
        self.generation = 0  # groups given up so far (each failed transfer); every rank counts the same
        self.rdv = self._group()
        self.pg = None
        self._looked = -math.inf  # when _asked last looked for the orchestrator's unreached file
        self.plan = SendPlan.of(model, files.dtype, d)  # the same every step: worked out once
        self.sums: RowSums | None = None  # this rank's part of the checksum of the step being sent
        if d.is_main:
            logger.info(f"weight broadcast: hosting the rendezvous on port {b.port} (group {self.rdv.group})")

    def _group(self) -> Rendezvous:
        b = self.config.weight_transfer
        group = f"{self.nonce}.{self.generation}"
        return Rendezvous(b.host, b.port, group, 0, self.backend, b.timeout, senders=self.d.world_size)

    def _asked(self, step: int) -> bool:
        """Whether every seat of the group asked for `step` (the last one to ask says so), one gave up, or the
        orchestrator could not reach a server to ask (a file on the shared filesystem: looked at every
        UNREACHED_POLL seconds, not at the store's 2 ms poll)."""
        if self.store.check([all_ready_key(self.rdv, step)]) or self.store.check([failed_key(self.rdv, step)]):
            return True
        if time.monotonic() - self._looked < UNREACHED_POLL:
            return False
        self._looked = time.monotonic()
        return unreached_file(self.config.output_dir, step, self.rdv.group).exists()

    def send(self, model: torch.nn.Module, step: int) -> None:
        """Announce step `step`, wait until every receiver asked for it, send it. A transfer that fails (a
        server died, or timed out) gives the group up and sends the step again in a new one, to the seats that
        ask then: the orchestrator asks its live servers only. TrainerError after SEND_ATTEMPTS failures."""
        problems, reseats = [], 0
        while True:
            problem = self._any_rank(self._try_send(model, step))
            if problem is None:
                checksum = self.sums.checksum(self._sum)  # what the servers check what they received against
                if self.d.is_main:  # (docs/design.md §4)
                    write_marker(self.config.output_dir, step, self.rdv, checksum.hex)
                return
            if isinstance(problem, Reseat):
                reseats += 1
            else:
                problems.append(problem)
            if len(problems) == SEND_ATTEMPTS or reseats > MAX_RESEATS:
                raise TrainerError(
                    f"weight broadcast of step {step} to the inference workers at {self.rdv.where} failed "
                    f"{len(problems)} times ({reseats} new groups for changed seats): {'; '.join(problems)}"
                )
            self._give_up(step, problem)

    def close(self) -> None:
        """Leave the weight group now, while the trainer's ranks still run: its gloo threads end here, not during
        interpreter shutdown, where a thread that wants the GIL aborts the process (trainer/parallel.py)."""
        self.pg = None
        gc.collect()

    def _give_up(self, step: int, problem: str) -> None:
        """Leave the group (its seats still waiting in it are told, and give up at once) for a new one."""
        if self.d.is_main and not self.store.check([failed_key(self.rdv, step)]):
            report_failure(self.store, self.rdv, step, f"the trainer gave group {self.rdv.group} up: {problem}")
        abandon(self.pg)
        self.pg, self.generation = None, self.generation + 1
        gc.collect()  # the group's last references go now: gloo closes its sockets, so the other seats fail at once
        self.rdv = self._group()
        if self.d.is_main and isinstance(problem, Reseat):
            logger.info(f"weight broadcast of step {step}: {problem}; seating them in group {self.rdv.group}")
        elif self.d.is_main:
            logger.warning(f"weight broadcast of step {step} failed: {problem}; sending it again in group "
                           f"{self.rdv.group} to the inference workers that ask for it")  # fmt: skip

    def _try_send(self, model: torch.nn.Module, step: int) -> str | None:
        """One transfer of step `step` in the current group; what went wrong, or None. Every rank agrees on the
        group being ready before any gathers (a rank that stopped early would leave the others in a gather)."""
        problem = self._any_rank(self._seat(step))
        if problem is not None:
            return problem
        device = _send_device(self.rdv, self.d)
        self.sums = RowSums(self.d.device)
        try:
            pieces = self.plan.pieces(model, self.d.rank, self.sums)
            send_step(self.pg, step, self.plan.specs, pieces, device, self.rdv.timeout, self.plan.rows, self.d.rank)
        except (BroadcastError, torch.distributed.DistError) as e:  # a receiver died or timed out, or the store went
            return f"{e}{self._reported(step, ' (')}"
        return None

    def _seat(self, step: int) -> str | None:
        """Announce `step` and wait until every seat of the group asked for it (rank 0 then joins the group);
        why the group cannot take it, or None."""
        c, rdv = self.config, self.rdv
        if self.d.is_main:
            write_marker(c.output_dir, step, rdv)
        try:
            wait_until(
                lambda: self._asked(step),
                f"the inference workers to ask for weight step {step} over the broadcast at {rdv.where}",
                c.data.timeout,
                output_dir=c.output_dir,
                writer="orchestrator",
                heartbeat_timeout=c.data.heartbeat_timeout,
                poll=0.002,  # one loopback round trip to the store: the hand-off stays within milliseconds
            )
            if self.store.check([failed_key(rdv, step)]):
                return self._reported(step) or "a receiver gave up"
            if (said := unreached(c.output_dir, step, rdv.group)) is not None:
                return f"the orchestrator could not reach a server to ask for it ({said})"
            world = int(self.store.get(size_key(rdv)))
            if self.rdv.world_size == 0:
                self.rdv = rdv = dataclasses.replace(rdv, world_size=world)
            elif world != rdv.world_size:  # a server came back (or the fleet changed): a new group seats it
                seats, was = world - rdv.senders, rdv.world_size - rdv.senders
                return Reseat(f"the inference servers now hold {seats} seat(s), the group {was}")
            if self.pg is None:
                self.pg = join_group(self.store, rdv, self.d.rank)
        except (BroadcastError, torch.distributed.DistError) as e:  # a receiver died or timed out, or the store went
            return f"{e}{self._reported(step, ' (')}"
        return None

    def _reported(self, step: int, prefix: str = "") -> str:
        """What a receiver reported of its failure in this group (protocol.broadcast.report_failure), if any."""
        try:
            if self.store.check([failed_key(self.rdv, step)]):
                said = self.store.get(failed_key(self.rdv, step)).decode()
                return f"{prefix}{said}{')' if prefix else ''}"
        except (RuntimeError, torch.distributed.DistError):
            pass
        return ""

    def _any_rank(self, problem: str | None) -> str | None:
        """Every trainer rank's verdict on a transfer, so that all of them try again or none does (rank 0
        sends what it gathers): rank 0's problem, or a stand-in for another rank's."""
        if self.d.world_size == 1:
            return problem
        flag = torch.tensor([0 if problem is None else 1], device=self.d.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return problem if problem is not None or not int(flag.item()) else "another trainer rank's transfer failed"

    def _sum(self, values: torch.Tensor) -> torch.Tensor:
        if self.d.world_size > 1:
            torch.distributed.all_reduce(values)
        return values


def _send_device(rdv: Rendezvous, d: Dist) -> torch.device:
    return d.device if rdv.backend == "nccl" else torch.device("cpu")


@dataclass(frozen=True)
class SendPlan:
    """What each trainer rank sends of a step: the checkpoint tensors in order (`specs`), how many of each one's
    rows (dim 0) every rank sends (`rows`, per tensor: one count per rank), and, for the exported tensors each
    rank sends its rows of (`first`: their first row on this rank), where those rows start."""

    specs: list[tuple[str, torch.dtype, tuple[int, ...]]]
    rows: list[list[int]]
    parts: dict[str, list]  # exported name -> its checkpoint tensors (weights.checkpoint_parts)
    first: dict[str, int]
    held: dict[str, list[int] | None]  # exported name -> the rows each rank holds of it (gather.row_counts)
    dtype: torch.dtype  # of the exported floating tensors

    @classmethod
    def of(cls, model: torch.nn.Module, dtype: torch.dtype, d: Dist) -> SendPlan:
        """A tensor is sent where its rows are when it is its own checkpoint tensor and every rank's shard is a
        run of its rows (FSDP's Shard(0); a replica other than the first sends none), the runs in rank order;
        otherwise rank 0 sends it whole (its rows sent to rank 0 first when sharded). Collective: every rank tells
        its runs."""
        state, exported = export_specs(model, dtype)
        parts = checkpoint_parts(model, exported)
        held = row_counts(state, exported, d.world_size)
        specs, rows, first = [], [], {}
        for name in exported:
            counts = held[name] if parts[name] == [(name, *exported[name])] else None
            if counts is not None:
                first[name] = row_run(state[name])[0]
            for spec in parts[name]:
                specs.append(spec)
                rows.append(counts or [rows_of(spec[2])[0]] + [0] * (d.world_size - 1))
        return cls(specs, rows, parts, first, held, dtype)

    def pieces(self, model: torch.nn.Module, rank: int, sums: RowSums):
        """Collective (a tensor rank 0 sends whole goes to rank 0 alone first): this rank's rows of every
        checkpoint tensor in `specs` order, each added to `sums` (an empty run where it sends none, so that every
        rank adds the same tensors)."""
        state, exported = export_specs(model, self.dtype)
        k = 0
        for name in exported:
            dtype, shape = exported[name]
            if name in self.first:
                local = state[name].detach().to_local()
                local = local.to(dtype) if local.is_floating_point() else local
                local = local if self.rows[k][rank] else local[:0]
                sums.add(name, dtype, shape, local, self.first[name])
                k += 1
                yield local
            elif rank == 0:
                for key, tensor in gathered(model, state, exported, self.parts, [name], 0, self.held):
                    sums.add(key, tensor.dtype, tuple(tensor.shape), tensor, 0)
                    k += 1
                    yield tensor
            else:
                gather_to(state[name], dtype, 0, self.held[name], rank)  # sends its rows to rank 0
                for key, part_dtype, part_shape in self.parts[name]:
                    empty = torch.empty(0, dtype=part_dtype, device=sums.device)
                    sums.add(key, part_dtype, part_shape, empty, 0)
                    k += 1
                    yield empty
