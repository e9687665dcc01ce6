"""Run vLLM's OpenAI server (vLLM 0.20) in this process with our routes added (DESIGN §4).

Imported only when the vLLM backend is chosen (it pulls in the built-in API module for shared pieces).
`vllm serve` builds its FastAPI app in `vllm.entrypoints.openai.api_server.build_app`; we wrap that
function so the app it returns also has:
- `GET /health` → {"status": "ok", "step": n} (replacing vLLM's empty 200),
- `POST /update_weights {"weight_dir"}`: the dir is checked first (complete `step_n`, readable safetensors
  headers, `config.json` of the served architecture) — a bad dir is a 400 and the old weights keep serving;
  then generation is paused with mode "wait" (running requests finish on the old weights, new ones queue),
  every worker loads the tensors (`collective_rpc("update_weights_from_path")`, worker.py), the prefix
  cache is cleared and generation resumes. So no response mixes two policies;
- `POST /reload_weights`: the same with the served model's own weights, step 0;
- our `Guard` middleware: the API key on every route but /health (vLLM's own check covers only /v1) and
  the body size limit.
Only one API server runs (in this process); `--headless` nodes run engines only and serve no routes.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from prime_rl.inference.api import Guard, UpdateWeightsRequest
from prime_rl.inference.config import InferenceConfig
from prime_rl.inference.engine.weights import WeightsError, check_config, check_weight_files
from prime_rl.inference.vllm.args import vllm_serve_args

logger = logging.getLogger("prime_rl")


def serve_vllm(config: InferenceConfig, host: str) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.openai import api_server
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(vllm_serve_args(config, host))
    validate_parsed_serve_args(args)
    build_app = api_server.build_app

    def build_app_with_our_routes(*a, **kw):
        app = build_app(*a, **kw)
        add_routes(app, config)
        return app

    api_server.build_app = build_app_with_our_routes
    logger.info(f"starting vLLM for {config.model.name} on http://{host}:{config.server.port} (backend vllm)")
    ServeSubcommand.cmd(args)


def add_routes(app, config: InferenceConfig) -> None:
    """Our health, weight-update routes and middleware on vLLM's app (its engine client is on app.state)."""
    state = {"step": 0}
    lock = asyncio.Lock()
    router = APIRouter()

    async def swap(request: Request, method: str, args: tuple, step: int) -> float:
        client = request.app.state.engine_client
        start = time.perf_counter()
        async with lock:
            await client.pause_generation(mode="wait", clear_cache=True)
            try:
                await client.collective_rpc(method, args=args)
            finally:
                await client.resume_generation()
            state["step"] = step
        logger.info(f"now serving weights step {step}")
        return round(time.perf_counter() - start, 3)

    @router.get("/health")
    async def health():
        return {"status": "ok", "step": state["step"], "backend": "vllm"}

    @router.post("/update_weights")
    async def update_weights(body: UpdateWeightsRequest, request: Request):
        weight_dir = Path(body.weight_dir)
        try:
            step, files = check_weight_files(weight_dir)
            check_config(weight_dir, request.app.state.engine_client.model_config.hf_config.to_dict())
            check_headers(files)
        except WeightsError as e:
            error = {"message": str(e), "type": "invalid_request_error", "code": 400}
            return JSONResponse({"error": error}, status_code=400)
        seconds = await swap(request, "update_weights_from_path", (str(weight_dir),), step)
        return {"step": step, "weight_dir": body.weight_dir, "seconds": seconds}

    @router.post("/reload_weights")
    async def reload_weights(request: Request):
        return {"step": 0, "seconds": await swap(request, "reload_base_weights", (), 0)}

    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != "/health"]
    app.include_router(router)
    app.add_middleware(
        Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes, counts=collections.Counter()
    )


def check_headers(files: list[Path]) -> None:
    """Every file opens as safetensors (reads headers only), so a corrupt dir is refused before the swap."""
    from safetensors import safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                f.keys()
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise WeightsError(f"{file}: cannot read: {e}") from None
