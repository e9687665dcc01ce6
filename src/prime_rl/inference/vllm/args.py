"""Our `InferenceConfig` → the arguments of `vllm serve` (vLLM 0.32 CPU build / 0.33 GPU), and the environment
it runs in. Imports neither vLLM nor torch, but for `vllm_parser` (vLLM's own parser, which checks the `[vllm]`
flags passed through).

Example: `--model.name Qwen/Qwen3-0.6B --parallel.tp 2 --max-model-len 8192 --vllm.enable-prefix-caching` →
`Qwen/Qwen3-0.6B --host 127.0.0.1 --port 8000 --served-model-name Qwen/Qwen3-0.6B --tensor-parallel-size 2
 --data-parallel-size 1 --max-model-len 8192 --seed 0
 --worker-extension-cls prime_rl.inference.vllm.worker.WeightUpdateExtension --weight-transfer-config ...
 --logprobs-mode processed_logprobs --generation-config vllm --enable-auto-tool-choice --tool-call-parser hermes
 --api-server-count 1 ... --enable-prefix-caching ...`

vLLM's throughput is vLLM's: nothing is passed for a knob the config leaves unset, so vLLM picks its own
`--max-num-seqs` (1024 on an H100/H200), `--max-num-batched-tokens`, `--gpu-memory-utilization` (0.92), CUDA
graphs and prefix caching. `engine.max_batch_size`, `gpu_memory_utilization` and `enforce_eager` are passed
when set; anything else through `[vllm]`. What is always passed is what correctness or our routes need (each
says why where it is added).

The KV cache: `kv_cache_gb` is `--kv-cache-memory-bytes`. Unset, a GPU's comes from `gpu_memory_utilization`
(vLLM's way); on CPU vLLM would take that share of the host's RAM (beside a trainer it refuses to start), so it
gets what the run needs: `max_model_len` x the sequences vLLM runs at once (`engine.max_batch_size`, else vLLM's
CPU default, 128 x tp x pp) tokens of the model's KV plus 20%, at most a quarter of the machine's memory
(`kv_cache_size`). `VLLM_CPU_KVCACHE_SPACE` (GiB) in the environment wins.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

from prime_rl.configs.inference import BadVllmFlag, InferenceConfig, StartupError
from prime_rl.configs.vllm_flags import FROM_CONFIG, OWNED

logger = logging.getLogger("prime_rl")

# `--max-lora-rank` values vLLM accepts (vllm.config.lora.MaxLoRARanks).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
WORKER_EXTENSION = "prime_rl.inference.vllm.worker.WeightUpdateExtension"
CONTROL_PLANE = "prime_rl.inference.vllm.server.VllmControlPlane"
TRANSFER_ENGINE = "prime"  # the name our weight-transfer engine is registered under in vLLM's factory


def vllm_serve_args(config: InferenceConfig, host: str, cuda: bool = True, parser: Any = None) -> list[str]:
    """The argv (after `vllm serve`) that runs our config; the API key is enforced by our control plane. The
    `[vllm]` flags are rendered and checked with `parser` (default: vLLM's own, `vllm_parser()`)."""
    args = [config.model.name, "--host", host, "--port", str(config.server.port)]
    args += ["--served-model-name", config.model.name]  # the name the orchestrator's requests carry
    # The workers that take broadcast seats (VllmModel.receivers counts them from the same keys).
    args += ["--tensor-parallel-size", str(config.parallel.tp), "--data-parallel-size", str(config.parallel.dp)]
    # The length the config promises: `rl` checks orchestrator.seq_len against it and longer requests are a 400
    # on both backends (vLLM's own would be the model's whole context).
    args += ["--max-model-len", str(config.max_model_len)]
    # Requests without a seed draw from the same seeded stream on both backends.
    args += ["--seed", str(config.seed)]
    # vLLM's throughput knobs only where the config sets them; unset, vLLM's defaults for this device serve.
    if config.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    if config.engine.max_batch_size is not None:
        args += ["--max-num-seqs", str(config.engine.max_batch_size)]
    args += ["--worker-extension-cls", WORKER_EXTENSION]
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
        # vLLM's token-in/token-out route, /inference/v1/generate (with /render and /derender), which training
        # clients that render their own prompts call (verifiers' TrainClient): off unless asked for.
        args.append("--enable-scale-out")
    args += kv_cache_args(config, cuda)
    if not cuda and not {"enable-chunked-prefill", "enable_chunked_prefill"} & set(config.vllm):
        # vLLM's CPU build rewinds a seeded request's generator after a partial prefill chunk (`set_offset`), which
        # torch's CPU generators refuse: one seeded request whose prefill was split killed the engine. Whole
        # prefills, as vLLM itself runs MLA models on CPU (it then sizes max-num-batched-tokens to max-model-len).
        args.append("--no-enable-chunked-prefill")
    if config.vllm:
        args += passthrough_args(config, parser if parser is not None else vllm_parser())
    args += ["--disable-uvicorn-access-log", "--disable-fastapi-docs"]
    return args


# ---------------------------------------------------------------------------------------------
# [vllm]: more flags, passed through


def vllm_cli_args() -> Any:
    """vLLM's module of `vllm serve` arguments (`make_arg_parser`, `validate_parsed_serve_args`), which moved
    between the supported releases (imports vLLM: call it only where vLLM runs)."""
    try:
        from vllm.entrypoints.common import cli_args  # vLLM 0.33
    except ImportError:
        from vllm.entrypoints.launchers import cli_args  # vLLM 0.32
    return cli_args


def vllm_parser() -> Any:
    """vLLM's `vllm serve` argument parser (imports vLLM: call it only where vLLM runs)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return vllm_cli_args().make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def render_flag(name: str, value: Any, parser: Any = None) -> list[str]:
    """One `[vllm]` entry as argv: true is the bare flag; false `--no-<flag>` (nothing where the parser knows the
    flag has no such form: off is its default); a list its items after the flag (repeated flags for an `append`
    one, JSON for a flag that takes one value); a table JSON; anything else `--flag=value`. The parser, when
    given, also picks vLLM's short spelling (`pp` -> `-pp`) for a name it knows only as one."""
    actions = getattr(parser, "_option_string_actions", None)
    flag = f"--{name}"
    if actions is not None and flag not in actions and f"-{name}" in actions:
        flag = f"-{name}"
    action = actions.get(flag.partition(".")[0]) if actions is not None else None
    if value is True:
        return [flag]
    if value is False:
        negative = f"--no-{name}"
        return [negative] if actions is None or negative in actions or action is None else []
    if isinstance(value, list) and type(action).__name__ == "_AppendAction":
        return [part for item in value for part in (flag, _text(item))]
    if isinstance(value, list) and (action is None or action.nargs not in (None, "?")):
        return [flag, *map(_text, value)]
    return [f"{flag}={_text(value)}"]  # a list for a flag of one value: JSON (vLLM's list-valued JSON flags)


def _text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict | list) else str(value)


class _Refused(Exception):
    pass


def passthrough_args(config: InferenceConfig, parser: Any) -> list[str]:
    """The `[vllm]` flags as argv, read by `parser` as vLLM reads them: a flag it does not know, or a value it
    refuses, is one line (BadVllmFlag: exit 2, never retried), not argparse's usage text and exit."""
    extra = [part for name, value in config.vllm.items() for part in render_flag(name, value, parser)]

    def refuse(message: str):
        raise _Refused(message)

    parser.error = refuse  # argparse reports every problem through error(), which would print usage and exit
    try:
        parser.parse_args([config.model.name, *extra])
    except _Refused as e:
        raise BadVllmFlag(_refusal_line(str(e), parser)) from None
    except SystemExit:  # an action that exits (a version flag): not a serving flag
        raise BadVllmFlag(f"inference.vllm: {' '.join(extra)}: vLLM exits on it; not a serving flag") from None
    return extra


def _refusal_line(message: str, parser: Any) -> str:
    """argparse's message as one line naming the [vllm] key: an unknown flag with the nearest vLLM flag."""
    message = " ".join(message.split())
    unknown = re.match(r"unrecognized arguments: (\S+)", message)
    if unknown:
        flag = unknown.group(1).split("=")[0]
        ours = {*FROM_CONFIG, *OWNED}  # never suggested: refused at config time
        known = [o for o in getattr(parser, "_option_string_actions", {}) if o.startswith("--") and o[2:] not in ours]
        near = difflib.get_close_matches(flag, known, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        key = flag.lstrip("-").removeprefix("no-")
        return f"inference.vllm.{key}: vLLM has no flag {flag}{hint}; `vllm serve --help` lists them"
    bad = re.match(r"argument (\S+?)(/\S+)?: (.*)", message)
    if bad:
        return f"inference.vllm.{bad.group(1).lstrip('-')}: vLLM refuses it: {bad.group(3)}"
    return f"inference.vllm: vLLM refuses these flags: {message}"


# ---------------------------------------------------------------------------------------------
# Workers: vLLM runs tp x pp x pcp workers per data-parallel replica (its ParallelConfig.world_size)


def vllm_int_flag(config: InferenceConfig, *names: str) -> int:
    """An integer `[vllm]` flag under any of its spellings (`pipeline-parallel-size` or `pp`); 1 where unset.
    vLLM's parser checked the value when the server started (passthrough_args)."""
    for name in names:
        if name in config.vllm:
            return int(str(config.vllm[name]))
    return 1


def workers_per_replica(config: InferenceConfig, with_pcp: bool = True) -> int:
    """tp x pp (x prefill context parallel): vLLM's world size within one data-parallel replica."""
    pp = vllm_int_flag(config, "pipeline-parallel-size", "pp")
    pcp = vllm_int_flag(config, "prefill-context-parallel-size", "pcp") if with_pcp else 1
    return config.parallel.tp * pp * pcp


def weight_receivers(config: InferenceConfig) -> int:
    """The server's seats in a weight broadcast group: one per vLLM worker, tp x pp x pcp x dp. Each worker
    receives the whole step and vLLM's `load_weights` keeps the tensors of its shard and its pipeline stage; the
    worker extension's seat is vLLM's index of the worker, `dp_index x world_size + rank` (worker.py)."""
    return workers_per_replica(config) * config.parallel.dp


# ---------------------------------------------------------------------------------------------
# The environment vLLM runs in

# Since vLLM 0.24 its tool parsers constrain tool calls with a structural-tag grammar by default (vllm/envs.py
# VLLM_ENFORCE_STRICT_TOOL_CALLING, default true; the switch is this variable, not a `vllm serve` flag): the
# tokens of a tool call would be sampled from a masked distribution whose logprobs the trainer, recomputing the
# unconstrained policy, never reproduces. Off, tool calls are sampled like any other tokens, as the built-in
# engine samples them. Set before vLLM imports its tool parsers (their classes read it when defined).
VLLM_ENV = {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}


def apply_vllm_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set VLLM_ENV in `environ` (os.environ) where it is not set; an explicit setting is kept, with a warning
    when it turns constrained tool calls back on. Returns what was set."""
    environ = os.environ if environ is None else environ
    added = {}
    for name, value in VLLM_ENV.items():
        if name not in environ:
            environ[name] = added[name] = value
        elif environ[name] != value:
            logger.warning(
                f"{name}={environ[name]} in the environment: vLLM may constrain tool calls, and their logprobs "
                "then differ from the trainer's (prime-rl sets it to 0)"
            )
    return added


# ---------------------------------------------------------------------------------------------
# The KV cache

KV_HEADROOM = 1.2  # blocks partly filled, the scheduler's slack
# vLLM's CPU default --max-num-seqs for `vllm serve`, per tp x pp worker (vllm/engine/arg_utils.py,
# EngineArgs.get_batch_defaults: OPENAI_API_SERVER 128 x world_size; tests read it from there).
VLLM_CPU_SEQS_PER_WORKER = 128
KV_SHARE_OF_MEMORY = 0.25  # a CPU run's default KV cache takes at most this share of the machine's memory
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_cache_args(config: InferenceConfig, cuda: bool) -> list[str]:
    """`--kv-cache-memory-bytes` for `kv_cache_gb`, or on CPU for what the run needs (`kv_cache_size`); nothing
    where vLLM's own sizing is meant (a GPU without kv_cache_gb; VLLM_CPU_KVCACHE_SPACE set on CPU, which vLLM's
    CPU platform puts over the flag anyway)."""
    if not cuda and os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        logger.info(f"vLLM KV cache: {os.environ['VLLM_CPU_KVCACHE_SPACE']} GiB (VLLM_CPU_KVCACHE_SPACE)")
        return []
    if config.kv_cache_gb is not None:
        size = int(config.kv_cache_gb * 2**30)
        logger.info(f"vLLM KV cache: {size / 2**30:.2f} GiB (kv_cache_gb)")
        return ["--kv-cache-memory-bytes", str(size)]
    if cuda:
        return []
    size, why = kv_cache_size(config, read_model_config(config.model.name), machine_memory())
    logger.info(f"vLLM KV cache: {size / 2**30:.2f} GiB ({why}; kv_cache_gb sets it)")
    return ["--kv-cache-memory-bytes", str(size)]


def kv_bytes_per_token(model_config: dict, dtype_bytes: int) -> int | None:
    """Bytes of KV cache one token takes: layers x (K and V) x kv heads x head_dim x dtype bytes (MLA models:
    layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes); None when config.json does not say."""
    c = model_config.get("text_config") or model_config
    layers, heads = c.get("num_hidden_layers"), c.get("num_attention_heads")
    if not layers or not heads:
        return None
    if c.get("kv_lora_rank"):
        return layers * (c["kv_lora_rank"] + (c.get("qk_rope_head_dim") or 0)) * dtype_bytes
    head_dim = c.get("head_dim") or (c["hidden_size"] // heads if c.get("hidden_size") else None)
    if not head_dim:
        return None
    return layers * 2 * (c.get("num_key_value_heads") or heads) * head_dim * dtype_bytes


def cpu_max_num_seqs(config: InferenceConfig) -> int:
    """The sequences vLLM's CPU build runs at once: engine.max_batch_size, else vLLM's default (x 2 in its
    throughput performance mode, as vLLM doubles it)."""
    if config.engine.max_batch_size is not None:
        return config.engine.max_batch_size
    seqs = VLLM_CPU_SEQS_PER_WORKER * workers_per_replica(config, with_pcp=False)
    return seqs * 2 if config.vllm.get("performance-mode") == "throughput" else seqs


def kv_cache_size(config: InferenceConfig, model_config: dict | None, memory: int) -> tuple[int, str]:
    """(bytes, why): max_model_len x cpu_max_num_seqs tokens of the model's KV, + 20%, at most a quarter of
    `memory` but never less than one max_model_len sequence (vLLM refuses less). 4 GiB where the model's
    config.json cannot be read."""
    kv_dtype = str(config.vllm.get("kv-cache-dtype", "auto"))
    dtype = config.engine.dtype if config.engine.dtype != "auto" else "float32"  # CPU: float32 (vllm_serve_args)
    dtype_bytes = 1 if kv_dtype.startswith("fp8") else DTYPE_BYTES[dtype]
    per_token = kv_bytes_per_token(model_config or {}, dtype_bytes)
    if per_token is None:
        return 4 * 2**30, f"{config.model.name}: no config.json to size it from"
    seqs = cpu_max_num_seqs(config)
    want = math.ceil(per_token * config.max_model_len * seqs * KV_HEADROOM)
    why = f"{seqs} x {config.max_model_len} tokens x {per_token} B + 20%"
    cap = int(memory * KV_SHARE_OF_MEMORY)
    if want <= cap:
        return want, why
    one = math.ceil(per_token * config.max_model_len * KV_HEADROOM)
    return max(cap, one), f"{why} = {want / 2**30:.1f} GiB, capped at a quarter of {memory / 2**30:.0f} GiB"


def read_model_config(name: str) -> dict | None:
    """The model's config.json (a local dir, or the hub's cached copy: no download), or None."""
    from prime_rl.utils.hf_layout import checkpoint_file

    try:
        path = checkpoint_file(name, "config.json")
    except Exception:  # not a hub id
        return None
    try:
        return json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None


def machine_memory() -> int:
    """Bytes of memory this process may use: the machine's, or its cgroup's limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        return min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        return total


def max_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds adapters of rank `rank`: 4 -> 8, 16 -> 16."""
    fitting = [r for r in LORA_RANKS if r >= rank]
    if not fitting:
        raise StartupError(f"model.lora.rank {rank}: vLLM serves LoRA ranks up to {LORA_RANKS[-1]}")
    return fitting[0]
