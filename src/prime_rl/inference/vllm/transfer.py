"""Our engine in vLLM's weight-transfer protocol (`--weight-transfer-config {"backend": "prime"}`).

vLLM drives every weight update through the phases of `vllm.distributed.weight_transfer`: init (once, the
served layout) → start_weight_update (layerwise reload begins: each layer's kernel tensors are kept aside)
→ update_weights (checkpoint-format tensors go to `model.load_weights`, a layer is processed and copied into
its kernel tensors as soon as all of its weights arrived) → finish_weight_update (layers that got nothing
get their old tensors back). Tensors land on the worker's device; nothing is staged in host memory on a GPU.

One engine for both transports, so the CPU build in CI runs the phases a GPU node runs:
- a `weights/step_n` dir: read file by file (`path`);
- a broadcast step (protocol.broadcast: gloo on CPU, nccl on CUDA), either streamed into the model as it
  arrives (`broadcast`), or received beforehand into device memory while the old weights keep serving
  (`stage`, then `staged`): an update that fails half-way then leaves the served weights whole. The server
  stages when the device has room for a copy of the model (`weight_staging`, docs/design.md §4).

Every update sums the weight checksum (protocol.parity) of the (name, tensor) pairs fed to `load_weights`,
which the server reads from every worker after the update (`weights_checksum`).

Runs inside vLLM's worker processes; the worker extension (worker.py) registers it in vLLM's factory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from prime_rl.inference.broadcast import BroadcastReceiver
from prime_rl.inference.control import BroadcastRequest
from prime_rl.protocol.parity import Checksum, summing
from prime_rl.utils.hf_layout import iter_safetensors


def _not_rotary(record: logging.LogRecord) -> bool:
    """Layerwise reload warns "RotaryEmbedding: Failed to load weights" at every update: the layer holds only a
    computed cos/sin cache (no checkpoint tensor), which it keeps, as it should. Other layers' warnings stay."""
    return "RotaryEmbedding: Failed to load weights" not in record.getMessage()


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_not_rotary)


@dataclass
class PrimeInitInfo(WeightTransferInitInfo):
    served: list  # [(name, shape, floating)] of the served checkpoint: what a broadcast header is checked against
    tied: bool  # the checkpoint ties lm_head to the embeddings (a sender may omit lm_head.weight)


@dataclass
class PrimeUpdateInfo(WeightTransferUpdateInfo):
    """Exactly one source: a weight dir, a broadcast to stream in as this worker's `seat`, or what `stage` got."""

    path: str | None = None
    broadcast: dict | None = None
    seat: int = 0
    staged: bool = False


class PrimeTransferEngine(WeightTransferEngine[PrimeInitInfo, PrimeUpdateInfo]):
    init_info_cls = PrimeInitInfo
    update_info_cls = PrimeUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.receiver = BroadcastReceiver()
        self.served: dict[str, tuple[tuple[int, ...], bool]] = {}
        self.tied = False
        self.staged: dict[str, torch.Tensor] | None = None
        # The weight checksum (protocol.parity) of the pairs the last update fed to `load_weights`.
        self.checksum: str | None = None

    def init_transfer_engine(self, init_info: PrimeInitInfo) -> None:
        self.served = {name: (tuple(shape), floating) for name, shape, floating in init_info.served}
        self.tied = init_info.tied

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        repack_cpu_experts(self.model, self.device)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's default ends with torch.accelerator.synchronize(), which raises on a machine without one.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: PrimeUpdateInfo) -> None:
        if update_info.path is not None:
            weights = iter_safetensors(Path(update_info.path))
        elif update_info.staged:
            if self.staged is None:
                raise RuntimeError("no staged weights to load (the staging transfer failed or was loaded)")
            weights, self.staged = iter(self.staged.items()), None
        else:
            request = BroadcastRequest(**update_info.broadcast)
            weights = self.receiver.stream(
                request.rendezvous(), update_info.seat, request.step, self.transport_device(request), self.served,
                self.tied,
            )  # fmt: skip
        # Summed as they are fed, before vLLM fuses or shards them; on this worker's device (a file's host
        # tensors a chunk at a time), so no host pass over a large model's bytes.
        checksum = Checksum(device=self.device)
        self.checksum = None
        self.model.load_weights(summing(weights, checksum))
        self.checksum = checksum.hex

    def stage(self, request: BroadcastRequest, seat: int) -> None:
        """Receive a broadcast step whole into device memory; the served weights are untouched."""
        self.staged = None
        received = self.receiver.stream(
            request.rendezvous(), seat, request.step, self.transport_device(request), self.served, self.tied
        )
        self.staged = {name: tensor.to(self.device) for name, tensor in received}

    def staging_room(self) -> tuple[int, int]:
        """(bytes a staged copy of the model takes, bytes free on the device)."""
        import psutil

        itemsize = next(self.model.parameters()).element_size()
        need = sum(int(torch.Size(shape).numel()) for shape, _ in self.served.values()) * itemsize
        if self.device.type == "cuda":
            return need, int(torch.cuda.mem_get_info(self.device)[0])
        return need, int(psutil.virtual_memory().available)

    def transport_device(self, request: BroadcastRequest) -> torch.device:
        return torch.device("cpu") if request.backend == "gloo" else self.device

    def shutdown(self) -> None:
        self.receiver.leave()
        self.staged = None


def repack_cpu_experts(model: torch.nn.Module, device: torch.device) -> None:
    """vLLM's CPU MoE kernel packs the expert weights into its own layout after the first load only; a reload
    copies checkpoint-layout weights over the packed ones (vLLM 0.32: served logprobs off by up to 0.7 nats
    after an update). Packing them again restores what a fresh load of the same weights serves. A model on
    another device has no such kernel: nothing is imported or walked there."""
    if device.type != "cpu":
        return
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(layer)
