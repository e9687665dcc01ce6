"""A model a command cannot get fails at its start in one line: not in the cache with HF_HUB_OFFLINE set, or no
route to the hub (it was 37-56 s of transformers' retries, then "check your internet connection")."""

import os
import socket
import subprocess
import sys
import time

import pytest

from prime_rl.utils.hub import check_model_source, unreachable


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on return: nothing listens there


def sft(tmp_path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PRIME_", "HF_"))}
    clean |= {"HF_HOME": str(tmp_path / "hf")} | env  # an empty cache
    (tmp_path / "x.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')  # data.path is checked at parse
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "prime_rl.entrypoints.sft", "--model.name", "Qwen/Qwen3-0.6B",
                             "--data.path", "x.jsonl", "--output-dir", str(tmp_path / "out")], cwd=tmp_path,
                            env=clean, capture_output=True, text=True, timeout=60)  # fmt: skip
    return result, time.monotonic() - started


def test_offline_and_not_cached_fails_at_once_saying_so(tmp_path):
    result, took = sft(tmp_path, {"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1 and "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert line.endswith("sft ERROR Qwen/Qwen3-0.6B is not in the local Hugging Face cache and HF_HUB_OFFLINE is "
                         "set: use a local path or pre-download it (`hf download`)")  # fmt: skip
    assert took < 20


def test_no_route_to_the_hub_fails_in_seconds_naming_the_endpoint(tmp_path):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    result, took = sft(tmp_path, {"HF_ENDPOINT": endpoint})
    assert result.returncode == 1 and "Traceback" not in result.stderr
    [line] = result.stderr.splitlines()
    assert f"sft ERROR cannot reach {endpoint} to download Qwen/Qwen3-0.6B (" in line
    assert line.endswith("): no network? use a local path or pre-download it")
    assert took < 20


def test_a_hub_that_answers_any_status_is_reachable(tmp_path):
    server = subprocess.Popen([sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1"], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        port = int(server.stdout.readline().split("port ")[1].split()[0])
        assert unreachable(f"http://127.0.0.1:{port}/no-such-page") is None  # a 404 is an answer
    finally:
        server.kill()
        server.wait()
    assert unreachable(f"http://127.0.0.1:{port}") is not None


def test_local_paths_are_checked_without_the_network(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(RuntimeError, match="without a config.json"):
        check_model_source(str(model))
    (model / "config.json").write_text("{}")
    check_model_source(str(model))
    with pytest.raises(ValueError, match=f"no such directory: {tmp_path}/modle .*did you mean {tmp_path}/model\\?"):
        check_model_source(str(tmp_path / "modle"), ValueError)
