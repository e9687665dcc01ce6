"""Run vLLM's OpenAI server in this process behind our control plane (docs/design.md §4).

Imported only when the vLLM backend is chosen. `vllm serve` builds its app itself; its `--middleware` flag
puts `VllmControlPlane` (the same `ControlPlane` the built-in engine mounts) in front of every route, so
`/health`, `/update_weights`, `/reload_weights`, the API key, the body limit and the `x-weight-step` stamp
behave exactly as on the built-in engine; chat messages are checked as the built-in engine checks them
(a tool message without `tool_call_id` is a 400 on both). A weight swap, once no request is in flight, pauses vLLM's
scheduler (clearing the prefix cache, which holds keys of the old weights), has every worker load the
tensors (`collective_rpc("update_weights_from_path")`, worker.py) and resumes. Only one API server runs
(in this process); `--headless` nodes run engines only and serve no routes.

With `model.lora` vLLM runs with `--enable-lora` and the weight dirs are peft adapters: each is checked
(inference/weights.py) and, at the gate, loaded through vLLM's own LoRA API in place of the previous one under
the name `model.lora.name` (`OpenAIServingModels.load_lora_adapter(load_inplace=True)`, the object behind
vLLM's `/v1/load_lora_adapter`), so requests naming the adapter get base + adapter; `/reload_weights`
unloads it. Requests naming the base model keep getting the base weights, and say so: their
`x-weight-step` is 0 (`base_name`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from starlette.responses import JSONResponse

from prime_rl.configs.inference import InferenceConfig
from prime_rl.inference.control import BroadcastRequest, ControlPlane, error
from prime_rl.inference.openai.protocol import chat_messages_problem
from prime_rl.inference.vllm.args import vllm_serve_args
from prime_rl.inference.weights import WeightsError, check_weight_dir, linear_shapes, read_adapter, read_specs
from prime_rl.utils.hf_layout import TensorSpecs, checkpoint_files

logger = logging.getLogger("prime_rl")

_config: InferenceConfig | None = None  # set by serve_vllm before vLLM instantiates the middleware


def serve_vllm(config: InferenceConfig, host: str, cuda: bool) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
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
        broadcast = c.weight_transfer.type == "broadcast"
        super().__init__(app, VllmModel(c), c.api_key, c.max_body_bytes, broadcast=broadcast)

    def check_generation(self, path: str, body: bytes) -> JSONResponse | None:
        """Also refuses the chat messages the built-in engine refuses (vLLM accepts a tool message without
        `tool_call_id`), so a conversation is valid on both backends or on neither. Only bodies that mention
        tools are parsed: a JSON encoder never escapes the ASCII letters of `tool`."""
        refusal = super().check_generation(path, body)
        if refusal is not None or path != "/v1/chat/completions" or b"tool" not in body:
            return refusal
        try:
            parsed = json.loads(body)
        except ValueError:
            return None  # malformed JSON: vLLM says so
        problem = chat_messages_problem(parsed) if isinstance(parsed, dict) else None
        return None if problem is None else error(400, problem)

    def refusal_for(self, path: str, body: bytes, exc: Exception) -> JSONResponse | None:
        """vLLM's request models read some fields before validating them (`structured_outputs` as a dict, ...),
        so a body with another type there raised (AttributeError: a 500). When vLLM's own request model
        raises on the body with anything but a validation error, the body is at fault: a 400 naming it."""
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        model = ChatCompletionRequest if path == "/v1/chat/completions" else CompletionRequest
        try:
            model.model_validate(json.loads(body))
        except (ValidationError, ValueError):
            return None  # vLLM answers these itself: the error came from elsewhere
        except Exception as e:
            return error(400, f"invalid request: a field of the wrong type ({type(e).__name__}: {e})"[:2000])
        return None

    async def __call__(self, scope, receive, send):
        if self.served.client is None and "app" in scope:
            self.served.client = scope["app"].state.engine_client
            self.served.models = getattr(scope["app"].state, "openai_serving_models", None)
        await super().__call__(scope, receive, send)


class VllmModel:
    """vLLM's engine (through its engine client) as the control plane sees it."""

    backend = "vllm"

    def __init__(self, config: InferenceConfig):
        self.model = config.model.name
        self.receivers = config.parallel.tp * config.parallel.dp  # one seat per worker
        self.lora = config.model.lora
        self.adapter: str | None = None  # the LoRA adapter loaded (its name), None: none
        self.client: Any = None
        self.models: Any = None  # vLLM's OpenAIServingModels, which loads LoRA adapters
        self._specs: TensorSpecs | None = None

    def served_specs(self) -> TensorSpecs:
        """Names and shapes of the served checkpoint, which vLLM's loader expects (read once)."""
        if self._specs is None:
            files = checkpoint_files(self.model)
            if files is None:
                raise WeightsError(f"{self.model}: no safetensors checkpoint to check weight dirs against")
            self._specs = read_specs(files)
        return self._specs

    @property
    def base_name(self) -> str | None:
        """While an adapter is loaded, the name under which requests still get the base weights (step 0)."""
        return self.model if self.adapter is not None else None

    async def prepare(self, source: Path | BroadcastRequest | None) -> tuple[int, Path | BroadcastRequest | None]:
        if source is None:
            return 0, None
        if self.lora is not None:
            if isinstance(source, BroadcastRequest):
                raise WeightsError("this server serves LoRA adapters (model.lora): send them as weight dirs")
            # The tensors are read once here for the finite-values check; vLLM reads the dir again to load it.
            linears = linear_shapes(self.served_specs())
            adapter = await asyncio.to_thread(read_adapter, source, self.lora, linears)
            return adapter.step, source
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
        # Pausing clears the prefix cache: its blocks hold keys of the old weights (or the old adapter,
        # whose id an in-place load keeps).
        await self.client.pause_generation(mode="wait", clear_cache=True)
        try:
            if self.lora is not None:
                await (self.unload_adapter() if source is None else self.load_adapter(source))
            elif source is None:
                await self.client.collective_rpc("reload_base_weights")
            elif isinstance(source, BroadcastRequest):
                await self.client.collective_rpc("apply_received")
            else:
                await self.client.collective_rpc("update_weights_from_path", args=(str(source),))
        finally:
            await self.client.resume_generation()

    async def load_adapter(self, weight_dir: Path) -> None:
        """Serve the adapter in `weight_dir` under `model.lora.name`, replacing the loaded one."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        request = LoadLoRAAdapterRequest(lora_name=self.lora.name, lora_path=str(weight_dir), load_inplace=True)
        result = await self.models.load_lora_adapter(request)
        if isinstance(result, ErrorResponse):  # vLLM loads the new one before evicting: the old one serves on
            raise WeightsError(f"{weight_dir}: vLLM cannot load the adapter: {result.error.message}")
        self.adapter = self.lora.name

    async def unload_adapter(self) -> None:
        """Serve the base model only (a request naming the adapter is then a 404)."""
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        loaded = self.models.lora_requests.get(self.lora.name)
        if loaded is not None:
            await self.models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=self.lora.name))
            await self.client.remove_lora(loaded.lora_int_id)
        self.adapter = None

    def health(self) -> dict[str, Any]:
        return {"adapter": self.adapter} if self.lora is not None else {}
