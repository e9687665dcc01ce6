"""vLLM worker extension (`--worker-extension-cls`): our weight-transfer engine's seat in every vLLM worker.

vLLM mixes this class into every worker (GPU or CPU) and imports this module before it loads the model, so
the import registers our engine (transfer.py) in vLLM's weight-transfer factory in time for the worker to
create it (`--weight-transfer-config {"backend": "prime"}`). The server calls these methods on all workers at
once with `engine_client.collective_rpc(name, args=...)`; the updates themselves go through vLLM's own
phases (`start_weight_update` / `update_weights` / `finish_weight_update`).
"""

from __future__ import annotations

from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from prime_rl.inference.vllm.args import TRANSFER_ENGINE

try:
    WeightTransferEngineFactory.register_engine(
        TRANSFER_ENGINE, "prime_rl.inference.vllm.transfer", "PrimeTransferEngine"
    )
except ValueError:  # registered already (this module imported again in the same process)
    pass


class WeightUpdateExtension:
    """Methods vLLM adds to its `Worker` (so `self.model_runner` is the worker's model runner)."""

    model_runner: object

    def reload_base_weights(self) -> None:
        """Load the served model's own weights again (vLLM reads `model_config.model`, unchanged by updates)."""
        from prime_rl.inference.vllm.transfer import repack_cpu_experts

        self.model_runner.reload_weights()
        model = self.model_runner.get_model()
        repack_cpu_experts(model, next(model.parameters()).device)

    def seat(self) -> int:
        """This worker's index among the server's workers (vLLM's order for a per-worker update list)."""
        parallel = self.vllm_config.parallel_config
        return parallel.data_parallel_index * parallel.world_size + self.rank

    def weights_checksum(self) -> str | None:
        """The weight checksum of what the last update fed this worker's model (None: none since the start)."""
        return self.weight_transfer_engine.checksum

    def staging_room(self) -> tuple[int, int]:
        return self.weight_transfer_engine.staging_room()

    def abandon_weight_update(self) -> None:
        """After an `update_weights` that failed: end the layerwise reload (layers the update did not reach get
        their old tensors back), which vLLM's `finish_weight_update` refuses once an update has failed."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            self.weight_transfer_engine.finish_weight_update()

    def stage_broadcast(self, request: dict) -> None:
        """Receive a broadcast step into device memory as seat `request.rank + seat()`, for a later
        `update_weights({"staged": True})`; the served weights keep serving meanwhile."""
        from prime_rl.inference.control import BroadcastRequest

        request = BroadcastRequest(**request)
        self.weight_transfer_engine.stage(request, request.rank + self.seat())
