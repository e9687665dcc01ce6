"""Our `InferenceConfig` → the arguments of `vllm serve` (vLLM 0.26). Pure: imports neither vLLM nor torch.

Example: `--model.name Qwen/Qwen3-0.6B --parallel.tp 2 --max-model-len 8192` →
`Qwen/Qwen3-0.6B --host 127.0.0.1 --port 8000 --tensor-parallel-size 2 --data-parallel-size 1
 --gpu-memory-utilization 0.9 --max-model-len 8192 --max-num-seqs 64 --seed 0
 --worker-extension-cls prime_rl.inference.vllm.worker.WeightUpdateExtension
 --logprobs-mode processed_logprobs --generation-config vllm --enable-auto-tool-choice --tool-call-parser hermes
 --api-server-count 1 ...`
"""

from __future__ import annotations

import json

from prime_rl.configs.inference import InferenceConfig, StartupError

# `--max-lora-rank` values vLLM 0.26 accepts (vllm.config.lora.MaxLoRARanks).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
WORKER_EXTENSION = "prime_rl.inference.vllm.worker.WeightUpdateExtension"
CONTROL_PLANE = "prime_rl.inference.vllm.server.VllmControlPlane"
TRANSFER_ENGINE = "prime"  # the name our weight-transfer engine is registered under in vLLM's factory


def vllm_serve_args(config: InferenceConfig, host: str, cuda: bool = True) -> list[str]:
    """The argv (after `vllm serve`) that runs our config; the API key is enforced by our control plane."""
    args = [config.model.name, "--host", host, "--port", str(config.server.port)]
    args += ["--served-model-name", config.model.name]
    args += ["--tensor-parallel-size", str(config.parallel.tp), "--data-parallel-size", str(config.parallel.dp)]
    args += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    args += ["--max-model-len", str(config.max_model_len), "--max-num-seqs", str(config.engine.max_batch_size)]
    args += ["--seed", str(config.seed), "--worker-extension-cls", WORKER_EXTENSION]
    # Weight updates go through vLLM's weight-transfer phases with our engine (transfer.py), which the worker
    # extension registers in vLLM's factory.
    args += ["--weight-transfer-config", json.dumps({"backend": TRANSFER_ENGINE})]
    # Logprobs of log_softmax(logits / temperature), what the trainer recomputes (vLLM's default is the raw
    # logits' logprobs, before temperature). Sampling defaults come from vLLM, never from the checkpoint's
    # generation_config.json (its top_k, min_p, ... would make vLLM sample another distribution than the
    # built-in engine and the trainer for the same request).
    args += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]
    # Same precision as the built-in engine: float32 on CPU, vLLM's choice (bf16) on GPU.
    dtype = config.engine.dtype if config.engine.dtype != "auto" or cuda else "float32"
    if dtype != "auto":
        args += ["--dtype", dtype]
    if config.tool_call_parser is not None:
        # Parsed tool calls on chat requests with tools (tool_choice "auto"), as the built-in engine does.
        args += ["--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser]
    if config.enforce_eager:
        args.append("--enforce-eager")
    if config.trust_request_chat_template:
        args.append("--trust-request-chat-template")
    if config.model.lora is not None:
        # One adapter (the policy's), replaced in place at each step (server.py).
        args += ["--enable-lora", "--max-lora-rank", str(max_lora_rank(config.model.lora.rank)), "--max-loras", "1"]
    multi_node = {
        "--data-parallel-size-local": config.data_parallel_size_local,
        "--data-parallel-address": config.data_parallel_address,
        "--data-parallel-rpc-port": config.data_parallel_rpc_port,
        "--data-parallel-start-rank": config.data_parallel_start_rank,
    }
    for flag, value in multi_node.items():
        if value is not None:
            args += [flag, str(value)]
    if config.headless:
        args.append("--headless")  # engines only: no API server, so no routes
    else:
        # One API server, in this process: the control plane's state (step, gate) lives in it.
        args += ["--api-server-count", "1", "--middleware", CONTROL_PLANE]
    args += ["--disable-uvicorn-access-log", "--disable-fastapi-docs"]
    return args


def max_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds adapters of rank `rank`: 4 -> 8, 16 -> 16."""
    fitting = [r for r in LORA_RANKS if r >= rank]
    if not fitting:
        raise StartupError(f"model.lora.rank {rank}: vLLM serves LoRA ranks up to {LORA_RANKS[-1]}")
    return fitting[0]
