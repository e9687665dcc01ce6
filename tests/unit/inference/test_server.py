"""Backend choice, bind address and start-up failures of the `inference` entry point."""

from __future__ import annotations

import socket

import pytest

from prime_rl.configs.inference import InferenceConfig, ServerConfig, StartupError
from prime_rl.entrypoints import inference as inference_entry
from prime_rl.inference import server


@pytest.mark.parametrize(
    ("requested", "has_vllm", "has_cuda", "expected"),
    [
        ("auto", False, False, "builtin"),
        ("auto", True, False, "builtin"),
        ("auto", False, True, "builtin"),
        ("auto", True, True, "vllm"),
        ("builtin", True, True, "builtin"),
        ("vllm", True, False, "vllm"),
    ],
)
def test_backend_resolution(requested, has_vllm, has_cuda, expected):
    assert server.resolve_backend(requested, has_vllm, has_cuda) == expected


def test_vllm_backend_without_vllm_is_a_clear_error():
    with pytest.raises(StartupError, match="vLLM is not installed"):
        server.resolve_backend("vllm", has_vllm=False, has_cuda=True)


def test_main_exits_1_with_a_message_when_the_backend_is_unavailable(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(server, "vllm_importable", lambda: False)
    argv = ["inference", "--backend", "vllm", "--output-dir", str(tmp_path), "--no-log.file"]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        inference_entry.main()
    assert exit_info.value.code == 1
    assert "ERROR backend vllm requested, but vLLM is not installed" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("host", "api_key", "expected"),
    [(None, None, "127.0.0.1"), (None, "k", "0.0.0.0"), ("127.0.0.1", "k", "127.0.0.1"), ("::1", None, "::1")],
)
def test_bind_host_defaults_to_loopback_without_an_api_key(host, api_key, expected):
    config = InferenceConfig(server=ServerConfig(host=host), api_key=api_key)
    assert server.bind_host(config) == expected


def test_serving_on_a_busy_port_is_a_clear_error():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(StartupError, match=f"cannot listen on 127.0.0.1:{port}"):
            server.serve(app=None, host="127.0.0.1", port=port, ready_message="")


def test_vllm_on_cpu_refuses_a_head_dim_its_attention_cannot_run(monkeypatch, tiny_model, tmp_path, capsys):
    """The tiny model has head_dim 16: one line and exit 1 up front, not vLLM's error minutes into start-up."""
    monkeypatch.setattr(server, "vllm_importable", lambda: True)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    argv = ["inference", "--backend", "vllm", "--model.name", str(tiny_model), "--output-dir", str(tmp_path)]
    monkeypatch.setattr("sys.argv", [*argv, "--no-log.file"])
    with pytest.raises(SystemExit) as exit_info:
        inference_entry.main()
    assert exit_info.value.code == 1
    assert "vLLM's CPU build needs head_dim >= 32, and" in capsys.readouterr().err
