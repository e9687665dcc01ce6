"""Config of the `inference` service. Imports no torch."""

from __future__ import annotations

import os
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from prime_rl.configs import BaseConfig, LogConfig, ModelConfig, OutputDir, Section, WeightTransferConfig
from prime_rl.configs.base import FieldError
from prime_rl.configs.shared import EnvVarName, EnvVars
from prime_rl.configs.vllm_flags import VllmFlags

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class StartupError(RuntimeError):
    """The config asks for something this machine cannot provide (a backend, a device, a port, a model)."""


class BadVllmFlag(StartupError):
    """A `[vllm]` flag vLLM's own parser refuses, found when the server starts: a config error (exit 2, not
    retried by `rl --restart`)."""


class ServerConfig(Section):
    host: Annotated[
        str | None,
        Field(description="bind address; unset = 0.0.0.0 when an API key is set, else 127.0.0.1"),
    ] = None
    port: Annotated[int, Field(ge=0, le=65535, description="HTTP port")] = 8000


BUILTIN_MAX_BATCH_SIZE = 64  # the built-in engine's batch rows when engine.max_batch_size is unset


class EngineConfig(Section):
    device: Annotated[Literal["auto", "cpu", "cuda"], Field(description="built-in engine device")] = "auto"
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        Field(description="weights dtype; auto = float32 on CPU, bfloat16 on CUDA"),
    ] = "auto"
    max_batch_size: Annotated[
        int | None,
        Field(
            ge=1,
            description="most sequences decoded together (continuous batching); also the built-in engine's largest "
            f"n. Unset: {BUILTIN_MAX_BATCH_SIZE} on the built-in engine; on vLLM its own --max-num-seqs default "
            "(vLLM 0.32/0.33: 1024 on an H100/H200, 256 on smaller GPUs, 128 x tp x pp on CPU)",
        ),
    ] = None
    max_waiting: Annotated[
        int, Field(ge=1, description="most requests waiting for a batch slot; more are answered 429")
    ] = 1024
    cpu_threads: Annotated[
        int,
        Field(ge=0, description="torch threads on CPU; 0 = auto (one core spared for HTTP on short iterations)"),
    ] = 0
    model_impl: Annotated[
        Literal["auto", "native", "transformers"],
        Field(
            description="forward pass: native = the engine's own for Llama/Mistral/Qwen2/Qwen3 (slot KV cache), "
            "transformers = the model's HF forward (any causal LM); auto = native when the architecture allows"
        ),
    ] = "auto"

    @property
    def batch_rows(self) -> int:
        """The built-in engine's batch rows: max_batch_size, or its default where unset (vLLM keeps its own)."""
        return self.max_batch_size if self.max_batch_size is not None else BUILTIN_MAX_BATCH_SIZE


class ParallelConfig(Section):
    dp: Annotated[int, Field(ge=1, description="data-parallel engine replicas (vLLM)")] = 1
    tp: Annotated[int, Field(ge=1, description="tensor-parallel size (vLLM)")] = 1


class InferenceConfig(BaseConfig):
    """OpenAI-compatible inference server with runtime weight updates."""

    flag_aliases: ClassVar[dict[str, str]] = {  # vLLM's own flag names, as multi-node commands use them
        "data_parallel_size": "parallel.dp",
        "tensor_parallel_size": "parallel.tp",
    }

    model: Annotated[ModelConfig, Field(description="the served model")] = ModelConfig()
    output_dir: OutputDir
    backend: Annotated[
        Literal["auto", "vllm", "builtin"],
        Field(description="auto = vLLM when importable and CUDA is present, else the built-in engine"),
    ] = "auto"
    server: Annotated[ServerConfig, Field(description="HTTP server")] = ServerConfig()
    engine: Annotated[EngineConfig, Field(description="built-in engine")] = EngineConfig()
    parallel: Annotated[ParallelConfig, Field(description="parallelism (vLLM backend)")] = ParallelConfig()
    api_key: Annotated[
        str | None, Field(description="require `Authorization: Bearer <key>` on every route but /health")
    ] = None
    api_key_var: Annotated[EnvVarName | None, Field(description="name of an env var holding the API key")] = None
    allow_unauthenticated: Annotated[
        bool, Field(description="allow binding a non-loopback address without an API key")
    ] = False
    trust_request_chat_template: Annotated[
        bool, Field(description="accept a chat_template sent in a request (it is code the server runs)")
    ] = False
    tool_call_parser: Annotated[
        str | None,
        Field(
            description="how tool calls are read from the model's output: `hermes` = `<tool_call>{json}</tool_call>` "
            "blocks (Qwen, Hermes; the built-in engine's only one); vLLM takes any of its `--tool-call-parser` "
            "names; `none` = tool calling off (requests with tools get 400 unless tool_choice is none)"
        ),
    ] = "hermes"
    max_model_len: Annotated[int, Field(ge=1, description="most prompt + completion tokens per sequence")] = 4096
    gpu_memory_utilization: Annotated[
        float | None,
        Field(
            gt=0,
            le=1,
            description="vLLM: fraction of the GPU's memory the server may use; unset = vLLM's own default (0.92 "
            "in vLLM 0.32/0.33), or under `rl` with the trainer on the same GPU a share that leaves it room (0.5)",
        ),
    ] = None
    enforce_eager: Annotated[
        bool,
        Field(
            description="vLLM: run the model eagerly, without torch.compile or CUDA graphs (starts faster, "
            "decodes slower: tests, short jobs)"
        ),
    ] = False
    seed: Annotated[int, Field(description="seed for requests that give none")] = 0
    request_timeout: Annotated[
        float, Field(gt=0, description="seconds a generation request may take (queue + decode) before a 504")
    ] = 600.0
    max_body_bytes: Annotated[int, Field(ge=1024, description="largest request body accepted; larger is a 413")] = (
        8 * 1024 * 1024
    )
    data_parallel_size_local: Annotated[
        int | None, Field(ge=1, description="vLLM multi-node DP: engine replicas on this node")
    ] = None
    data_parallel_address: Annotated[str | None, Field(description="vLLM multi-node DP: address of the head node")] = (
        None
    )
    data_parallel_rpc_port: Annotated[
        int | None, Field(ge=1, le=65535, description="vLLM multi-node DP: RPC port on the head node")
    ] = None
    data_parallel_start_rank: Annotated[
        int | None, Field(ge=0, description="vLLM multi-node DP: first DP rank on this node")
    ] = None
    headless: Annotated[
        bool, Field(description="vLLM multi-node DP: run engines only, no API server (secondary nodes)")
    ] = False
    kv_cache_gb: Annotated[
        float | None,
        Field(
            gt=0,
            description="vLLM: GiB of KV cache (--kv-cache-memory-bytes); unset = on GPU what gpu_memory_utilization "
            "leaves, on CPU max_model_len x the sequences vLLM runs at once (engine.max_batch_size, else vLLM's CPU "
            "default) tokens of the model's KV + 20%, at most a quarter of the machine's memory "
            "(VLLM_CPU_KVCACHE_SPACE in the environment still wins)",
        ),
    ] = None
    vllm: VllmFlags = {}
    env_vars: EnvVars = {}
    weight_transfer: Annotated[
        WeightTransferConfig,
        NoDecode,
        Field(
            description="how new weights reach this server; it reads type only (a broadcast's rendezvous "
            "comes with each request), so one weight_transfer table fits every service"
        ),
    ] = WeightTransferConfig()
    weight_staging: Annotated[
        Literal["auto", "device", "stream"],
        Field(
            description="vLLM, broadcast updates: `device` receives a step whole into spare device memory while "
            "the old weights serve, then swaps (a transfer failing half-way changes nothing); `stream` loads it "
            "into the model as it arrives, after the in-flight requests finished (no spare copy; a transfer "
            "failing half-way leaves the server refusing requests until the next good step); `auto` = `device` "
            "when the device has room for a copy of the model"
        ),
    ] = "auto"
    log: Annotated[LogConfig, Field(description="logging")] = LogConfig()

    @field_validator("tool_call_parser", mode="before")
    @classmethod
    def _none_turns_tool_calling_off(cls, value: object) -> object:
        return None if isinstance(value, str) and value.lower() == "none" else value  # flags and TOML have no null

    @model_validator(mode="after")
    def _vllm_flags_need_vllm(self) -> InferenceConfig:
        """vLLM flags are a request for vLLM: `auto` then means vllm (where vLLM is missing the start says so),
        and the built-in engine, which would ignore them, is refused."""
        if self.vllm and self.backend == "auto":
            self.__dict__["backend"] = "vllm"
        elif self.vllm and self.backend == "builtin":
            first = next(iter(self.vllm))
            raise FieldError(
                f"vllm.{first}",
                "vLLM flags with backend builtin, which would ignore them: drop [vllm] or use backend vllm",
                also=("backend",),
            )
        return self

    @model_validator(mode="after")
    def _resolve_api_key(self) -> InferenceConfig:
        if self.api_key is None and self.api_key_var:
            key = os.environ.get(self.api_key_var)
            if not key:
                raise ValueError(f"api_key_var names {self.api_key_var}, but that env var is unset or empty")
            self.__dict__["api_key"] = key  # resolved once here, so the server reads one field
        return self

    @model_validator(mode="after")
    def _bind_is_safe(self) -> InferenceConfig:
        host = self.server.host
        if host is not None and host not in LOOPBACK and not self.api_key and not self.allow_unauthenticated:
            raise ValueError(
                f"refusing to bind {host} without an API key: set --api-key / --api-key-var, or --allow-unauthenticated"
            )
        return self
