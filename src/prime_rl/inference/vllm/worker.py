"""vLLM worker extension (`--worker-extension-cls`): load a trainer's safetensors dir into the model runner.

vLLM mixes this class into every worker (GPU or CPU); the server calls its methods on all workers at once with
`engine_client.collective_rpc(name, args=...)`. Runs only inside vLLM; imports torch lazily.
"""

from __future__ import annotations

from pathlib import Path


class WeightUpdateExtension:
    """Methods vLLM adds to its `Worker` (so `self.model_runner` is the worker's model runner)."""

    model_runner: object

    def update_weights_from_path(self, weight_dir: str) -> None:
        """Load checkpoint-format (HF) tensors; vLLM's loader shards and fuses them (qkv, gate_up)."""
        from prime_rl.utils.hf_layout import iter_safetensors

        self.model_runner.reload_weights(weights_iterator=iter_safetensors(Path(weight_dir)))

    def reload_base_weights(self) -> None:
        """Load the served model's own weights again (vLLM reads `model_config.model`, unchanged by updates)."""
        self.model_runner.reload_weights()

    def receive_broadcast(self, request: dict, served: list, tied: bool) -> int:
        """Receive a broadcast weight step (protocol.broadcast) into host memory, checked against `served`
        [(name, shape, floating)]; `apply_received` loads it. The worker's seat is the server's first rank
        plus the worker's own rank."""
        import torch

        from prime_rl.inference.broadcast import BroadcastReceiver
        from prime_rl.inference.control import BroadcastRequest

        req = BroadcastRequest(**request)
        if getattr(self, "_receiver", None) is None:
            self._receiver = BroadcastReceiver()
        specs = {name: (tuple(shape), floating) for name, shape, floating in served}
        device = torch.device("cpu") if req.backend == "gloo" else self.device
        rank = req.rank + int(getattr(self, "rank", 0))
        self._received = None
        tensors = self._receiver.receive(req.rendezvous(), rank, req.step, device, specs, tied)
        # Host memory until applied (at the gate): the served weights stay intact if anything fails before.
        self._received = {name: t.to("cpu") for name, t in tensors.items()}
        return req.step

    def apply_received(self) -> None:
        received, self._received = self._received, None
        self.model_runner.reload_weights(weights_iterator=iter(received.items()))
