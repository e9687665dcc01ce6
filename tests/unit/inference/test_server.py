"""Backend choice, bind address and start-up failures of the `inference` entry point."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

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


def test_vllm_spawns_its_processes_unless_the_environment_says_otherwise(monkeypatch):
    """`vllm serve` sets VLLM_WORKER_MULTIPROC_METHOD=spawn before importing vLLM; serve_vllm skips that command, so
    the service sets it (vLLM's default is fork, which breaks CUDA in the children); a user's choice stands."""
    for key in ("VLLM_WORKER_MULTIPROC_METHOD", "PYTORCH_NVML_BASED_CUDA_CHECK"):
        monkeypatch.setenv(key, "")  # recorded, so that monkeypatch restores the session's environment
        monkeypatch.delenv(key)
    server.prepare_process()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    server.prepare_process()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"


FORK_AFTER_CUDA_CHECK = """
import os
from prime_rl.inference.server import prepare_process
cuda = prepare_process()
import torch
pid = os.fork()
if pid == 0:
    os._exit(3 if torch._C._cuda_isInBadFork() else 0)
print(cuda, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 3)
"""


def test_finding_out_about_cuda_leaves_a_forked_child_able_to_use_it():
    """The service's CUDA check initialises nothing, so processes forked from it (vLLM's CPU build, anyone's
    DataLoader) can still use CUDA; torch's runtime check (`cudaGetDeviceCount`) would mark them all unable
    (torch._C._cuda_isInBadFork), GPU or not. A fresh interpreter: this one may have asked CUDA already."""
    import torch

    if not torch.cuda._is_compiled():
        pytest.skip("this torch has no CUDA, so no fork to poison (PyPI's torch for Linux has)")
    if os.environ.get("CUDA_VISIBLE_DEVICES", "").startswith("MIG-"):
        pytest.skip("NVML cannot count MIG devices named by UUID: torch asks the CUDA runtime (vLLM spawns anyway)")
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    done = subprocess.run([sys.executable, "-c", FORK_AFTER_CUDA_CHECK], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    cuda, child_in_bad_fork = done.stdout.split()
    assert cuda == str(torch.cuda.is_available()) and child_in_bad_fork == "False", done.stdout
