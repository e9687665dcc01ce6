"""The trainer's side of `weight_transfer = "broadcast"` (protocol.broadcast): send each step's weights to
every inference worker over a process group instead of writing `weights/step_n`.

Every trainer rank walks the state dict in the same order and gathers one full tensor at a time (an FSDP
collective), so no rank ever holds more than its shard plus one tensor; rank 0 casts it to the saved dtype
(what the filesystem export writes, so both transfers serve the same numbers) and sends it.
"""

from __future__ import annotations

import logging
import uuid

import torch

from prime_rl.protocol import wait_until
from prime_rl.protocol.broadcast import (
    BroadcastError,
    Rendezvous,
    clear_markers,
    connect_store,
    join_group,
    ready_key,
    send_step,
    write_marker,
)
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.weights import ModelFiles, saved_dtype
from prime_rl.utils.hf_layout import checkpoint_state_dict

logger = logging.getLogger("prime_rl")


class WeightSender:
    def __init__(self, config, model: torch.nn.Module, files: ModelFiles | None, d):
        self.config, self.d = config, d
        b = config.weight_broadcast
        backend = "nccl" if d.device.type == "cuda" else "gloo"
        # A fresh group per trainer start: servers still in an earlier one (a restarted trainer) rejoin.
        self.rdv = Rendezvous(b.host, b.port, "", b.receivers + 1, backend, b.timeout)
        try:
            self.store = connect_store(self.rdv, master=d.is_main)
        except BroadcastError as e:
            raise TrainerError(f"{e} (is weight_broadcast.port taken, by another run?)") from None
        if d.is_main:
            clear_markers(config.output_dir)
            self.store.set("group", uuid.uuid4().hex[:16])
        group = self.store.get("group").decode()
        self.rdv = Rendezvous(b.host, b.port, group, b.receivers + 1, backend, b.timeout)
        self.pg = None
        self.dtype = files.dtype if files is not None else saved_dtype(model.config)
        meta = {k: torch.empty_like(v, device="meta") for k, v in model.state_dict().items()}
        if set(checkpoint_state_dict(model, meta)) != set(meta):
            raise TrainerError(
                f"{type(model).__name__}: transformers converts its weights at load, which weight_transfer = "
                "broadcast does not undo; use weight_transfer = filesystem"
            )
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        if d.is_main:
            logger.info(f"weight broadcast: hosting the rendezvous on port {b.port} for {b.receivers} receiver(s)")

    def send(self, model: torch.nn.Module, step: int) -> None:
        """Announce step `step`, wait until every receiver asked for it, send it."""
        c, rdv = self.config, self.rdv
        if self.d.is_main:
            write_marker(c.output_dir, step, rdv)
        want = rdv.world_size - 1
        try:
            wait_until(
                lambda: self.store.add(ready_key(rdv, step), 0) >= want,
                f"{want} inference worker(s) to ask for weight step {step} over the broadcast at {rdv.where}",
                c.data.timeout,
                output_dir=c.output_dir,
                writer="orchestrator",
                heartbeat_timeout=c.data.heartbeat_timeout,
            )
            if self.d.is_main and self.pg is None:
                self.pg = join_group(self.store, rdv, 0)
            state = model.state_dict()
            names = [n for n in state if not (self.tied and n == "lm_head.weight")]
            specs = [(n, self.dtype if state[n].is_floating_point() else state[n].dtype, tuple(state[n].shape))
                     for n in names]  # fmt: skip
            full = (_full(state[n]) for n in names)
            send_step(self.pg if self.d.is_main else None, step, specs, full, _send_device(rdv, self.d))
        except (BroadcastError, torch.distributed.DistError) as e:  # a receiver died, or the store went
            raise TrainerError(
                f"weight broadcast of step {step} to the inference workers at {rdv.where} failed: {e}; "
                "did an inference server die?"
            ) from None


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _send_device(rdv: Rendezvous, d) -> torch.device:
    return d.device if rdv.backend == "nccl" else torch.device("cpu")
