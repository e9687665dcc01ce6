"""Shared fixtures: tiny models built locally (no hub access), free loopback ports."""

from __future__ import annotations

import pytest

from prime_rl.utils.net import free_port as _free_port
from prime_rl.utils.tiny_model import create_tiny_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Path to a tiny Qwen3 model + tokenizer, built once per test session."""
    return create_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3", "qwen3")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama")


@pytest.fixture(scope="session", autouse=True)
def cpu_attention_kernel():
    """Compile the trainer's CPU attention kernel once up front (~40 s on a fresh machine), not in a timed test."""
    from prime_rl.trainer.attention import cpu_kernel

    cpu_kernel()


@pytest.fixture
def free_port() -> int:
    """A free loopback port (also importable as prime_rl.utils.net.free_port)."""
    return _free_port()


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
