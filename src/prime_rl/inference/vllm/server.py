"""Run vLLM's OpenAI server in this process behind our control plane (DESIGN §4).

Imported only when the vLLM backend is chosen. `vllm serve` builds its app itself; its `--middleware` flag
puts `VllmControlPlane` (the same `ControlPlane` the built-in engine mounts) in front of every route, so
`/health`, `/update_weights`, `/reload_weights`, the API key, the body limit and the `x-weight-step` stamp
behave exactly as on the built-in engine. A weight swap, once no request is in flight, pauses vLLM's
scheduler (clearing the prefix cache, which holds keys of the old weights), has every worker load the
tensors (`collective_rpc("update_weights_from_path")`, worker.py) and resumes. Only one API server runs
(in this process); `--headless` nodes run engines only and serve no routes.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from prime_rl.inference.config import InferenceConfig
from prime_rl.inference.control import BroadcastRequest, ControlPlane
from prime_rl.inference.vllm.args import vllm_serve_args
from prime_rl.inference.weights import WeightsError, check_weight_dir, read_specs
from prime_rl.utils.hf_layout import TensorSpecs, checkpoint_files

logger = logging.getLogger("prime_rl")

_config: InferenceConfig | None = None  # set by serve_vllm before vLLM instantiates the middleware


def serve_vllm(config: InferenceConfig, host: str, cuda: bool) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    global _config
    _config = config
    args = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(vllm_serve_args(config, host, cuda))
    validate_parsed_serve_args(args)
    logger.info(f"starting vLLM for {config.model.name} on http://{host}:{config.server.port} (backend vllm)")
    ServeSubcommand.cmd(args)


class VllmControlPlane(ControlPlane):
    """The control plane as vLLM's `--middleware` class (vLLM passes only the app)."""

    def __init__(self, app):
        assert _config is not None, "VllmControlPlane runs only under serve_vllm"
        c = _config
        broadcast = c.weight_transfer == "broadcast"
        super().__init__(app, VllmModel(c), c.api_key, c.max_body_bytes, broadcast=broadcast)

    async def __call__(self, scope, receive, send):
        if self.served.client is None and "app" in scope:
            self.served.client = scope["app"].state.engine_client
        await super().__call__(scope, receive, send)


class VllmModel:
    """vLLM's engine (through its engine client) as the control plane sees it."""

    backend = "vllm"

    def __init__(self, config: InferenceConfig):
        self.model = config.model.name
        self.receivers = config.parallel.tp * config.parallel.dp  # one seat per worker
        self.client: Any = None
        self._specs: TensorSpecs | None = None

    def served_specs(self) -> TensorSpecs:
        """Names and shapes of the served checkpoint, which vLLM's loader expects (read once)."""
        if self._specs is None:
            files = checkpoint_files(self.model)
            if files is None:
                raise WeightsError(f"{self.model}: no safetensors checkpoint to check weight dirs against")
            self._specs = read_specs(files)
        return self._specs

    async def prepare(self, source: Path | BroadcastRequest | None) -> tuple[int, Path | BroadcastRequest | None]:
        if source is None:
            return 0, None
        hf_config = self.client.model_config.hf_config.to_dict()
        if isinstance(source, BroadcastRequest):
            served = [(name, list(shape), floating) for name, (shape, floating) in self.served_specs().items()]
            tied = bool(hf_config.get("tie_word_embeddings"))
            try:
                await self.client.collective_rpc("receive_broadcast", args=(source.model_dump(), served, tied))
            except Exception as e:  # the worker's WeightsError arrives wrapped by vLLM's RPC
                raise WeightsError(str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__) from None
            return source.step, source
        step, _ = await asyncio.to_thread(lambda: check_weight_dir(source, hf_config, self.served_specs()))
        return step, source

    async def apply(self, source: Path | BroadcastRequest | None) -> None:
        await self.client.pause_generation(mode="wait", clear_cache=True)
        try:
            if source is None:
                await self.client.collective_rpc("reload_base_weights")
            elif isinstance(source, BroadcastRequest):
                await self.client.collective_rpc("apply_received")
            else:
                await self.client.collective_rpc("update_weights_from_path", args=(str(source),))
        finally:
            await self.client.resume_generation()

    def health(self) -> dict[str, Any]:
        return {}
