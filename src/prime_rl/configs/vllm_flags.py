"""`[inference.vllm]`: more `vllm serve` flags, passed through as given, but for those prime-rl sets itself.

TOML `[inference.vllm]` (or `[vllm]` in an inference file): `quantization = "fp8"`, `enable-prefix-caching = true`,
`max-num-batched-tokens = 8192`; flags `--vllm.max-num-batched-tokens 8192` (`--inference.vllm...` under `rl`).
A key is a flag's name without its dashes (`_` and `-` alike, as vLLM reads them); `inference/vllm/args.py` renders
the values (true: the bare flag, false: `--no-<flag>` or nothing, a list: its items, a table: JSON) and checks them
against vLLM's own parser when the server starts: this module imports no vLLM. Refused here, one line each: the
flags prime-rl renders from its own keys (named, so the line says which key to set) or needs as they are.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field

from prime_rl.configs.base import FieldError
from prime_rl.configs.fields import FLAG_TABLE

# vLLM flag -> the inference key prime-rl renders it from (inference/vllm/args.py).
FROM_CONFIG = {
    "model": "model.name",
    "served-model-name": "model.name",
    "host": "server.host",
    "port": "server.port",
    "api-key": "api_key (or api_key_var)",
    "tensor-parallel-size": "parallel.tp",
    "tp": "parallel.tp",
    "data-parallel-size": "parallel.dp",
    "dp": "parallel.dp",
    "gpu-memory-utilization": "gpu_memory_utilization",
    "kv-cache-memory-bytes": "kv_cache_gb",
    "max-model-len": "max_model_len",
    "max-num-seqs": "engine.max_batch_size",
    "seed": "seed",
    "dtype": "engine.dtype",
    "tool-call-parser": "tool_call_parser",
    "enable-auto-tool-choice": "tool_call_parser",
    "enforce-eager": "enforce_eager",
    "trust-request-chat-template": "trust_request_chat_template",
    "enable-lora": "model.lora",
    "max-loras": "model.lora",
    "max-lora-rank": "model.lora.rank",
    "data-parallel-size-local": "data_parallel_size_local",
    "data-parallel-address": "data_parallel_address",
    "data-parallel-rpc-port": "data_parallel_rpc_port",
    "data-parallel-start-rank": "data_parallel_start_rank",
    "headless": "headless",
}

# vLLM flag -> why prime-rl sets it itself, and to nothing else.
OWNED = {
    "worker-extension-cls": "its worker extension loads new weights",
    "weight-transfer-config": "its weight-transfer engine moves new weights",
    "middleware": "its control plane answers /health, /update_weights and the API key",
    "api-server-count": "the control plane's state lives in one API server",
    "logprobs-mode": "the logprobs are those the trainer recomputes",
    "generation-config": "no sampling defaults come from the checkpoint",
    "disable-uvicorn-access-log": "its own logging",
    "disable-fastapi-docs": "its own routes",
    "enable-scale-out": "its token-in/token-out route (/inference/v1/generate) is always served",
    "config": "a vLLM config file could set any flag: put its flags in this table",
    "help": "not a serving flag",
}


def flag_name(key: str) -> str:
    """The flag a key names, without dashes: `kv_cache_dtype`, `--kv-cache-dtype` -> `kv-cache-dtype`; a dotted
    key keeps its sub-keys as given (`compilation_config.cudagraph_mode` -> `compilation-config.cudagraph_mode`)."""
    head, dot, rest = key.lstrip("-").partition(".")
    return head.replace("_", "-") + dot + rest


def _passable(table: dict[str, Any]) -> dict[str, Any]:
    """The table keyed by flag name (a later spelling of the same flag wins, as flags over TOML); the flags
    prime-rl sets are refused, naming the key to set instead."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = flag_name(key)
        flag = name.partition(".")[0]
        own = flag.removeprefix("no-")
        if not flag:
            raise FieldError(key, "not a flag name")
        if own in FROM_CONFIG:
            raise FieldError(key, f"--{flag} is set by prime-rl from {FROM_CONFIG[own]}: set that instead")
        if own in OWNED:
            raise FieldError(key, f"--{flag} is prime-rl's own ({OWNED[own]}): it cannot be passed through")
        out.pop(name, None)
        out[name] = value
    return out


VllmValue = bool | int | float | str | list[Any] | dict[str, Any]

VllmFlags = Annotated[
    dict[str, VllmValue],
    FLAG_TABLE,
    AfterValidator(_passable),
    Field(
        description="more `vllm serve` flags, by name (`enable-prefix-caching = true`, `max-num-batched-tokens = "
        "8192`; checked against vLLM's parser at start); those prime-rl sets are refused, naming the key to set"
    ),
]
