"""`scripts/gpu_check.sh` (scripts/gpu_check.py): its plan, its refusal without CUDA, and its table.

The real run needs a CUDA GPU and vLLM; here the plan is read back and every command in it must load into its
entrypoint's config, so a renamed flag fails here rather than 20 minutes into a GPU session.
"""

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from prime_rl.configs import load_config
from prime_rl.configs.rl import RLConfig
from prime_rl.configs.trainer import TrainerConfig
from prime_rl.utils.metrics import MetricsWriter

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def load_gpu_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def check(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_dry_run_prints_every_command_with_its_timeout_and_the_table(tmp_path):
    done = check("--dry-run", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert not (tmp_path / "gpu_check.md").exists()  # a plan only
    steps = [line for line in out.splitlines() if line[:1].isdigit() and "[timeout " in line]
    assert len(steps) == 5
    assert sum(int(line.split("[timeout ")[1].split()[0]) for line in steps) <= 40 * 60
    commands = [shlex.split(line) for line in out.splitlines() if line.startswith("   ") and "-m prime_rl" in line]
    model = str(tmp_path / "qwen3-0.6b")
    assert commands[0][-3:] == [model, "--preset", "qwen3-0.6b"]
    assert "-m pytest -m gpu" in out

    rl_runs = [c[c.index("prime_rl.entrypoints.rl") + 1 :] for c in commands if "prime_rl.entrypoints.rl" in c]
    configs = [load_config(RLConfig, argv) for argv in rl_runs]
    assert [c.trainer.weight_transfer.type for c in configs] == ["broadcast", "filesystem"]
    assert "weight transfer broadcast" in out
    for config in configs:
        assert config.inference.backend == "vllm"
        assert config.trainer.dtype == "bfloat16"
        assert config.trainer.model.name == config.inference.model.name == model
        assert config.inference.gpu_memory_utilization < 0.5  # the trainer shares the GPU
    assert configs[0].max_steps == 20 and configs[1].max_steps < 20

    bench = next(c for c in commands if "prime_rl.entrypoints.trainer" in c)
    trainer = load_config(TrainerConfig, bench[bench.index("prime_rl.entrypoints.trainer") + 1 :])
    assert trainer.bench and trainer.data.fake and trainer.activation_checkpointing

    gpu = load_gpu_module()
    header = next(line for line in out.splitlines() if line.startswith("| figure |"))
    assert [c.strip() for c in header.strip("|").split("|")][1:] == gpu.COLUMNS
    for row in ("trainer tokens/s", "trainer MFU", "generated tokens/s", "time to served", "mismatch KL",
                "peak GPU memory: inference", "peak GPU memory: trainer"):  # fmt: skip
        assert f"| {row}" in out
    assert "11.9k" in out and "11.1%" in out  # upstream's reference column


def test_quick_plan_fits_eleven_minutes_and_benches_upstreams_shape(tmp_path):
    done = check("--quick", "--dry-run", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    steps = [line for line in done.stdout.splitlines() if line[:1].isdigit() and "[timeout " in line]
    assert len(steps) == 7
    assert sum(int(line.split("[timeout ")[1].split()[0]) for line in steps) <= 11 * 60
    lines = done.stdout.splitlines()
    commands = [shlex.split(line) for line in lines if line.startswith("   ") and not line.startswith("   (")]
    assert [c[-2] for c in commands if "gpu_probes.py" in c[1]] == ["fork", "nccl", "loading"]
    benches = [
        c[c.index("prime_rl.entrypoints.trainer") + 1 :] for c in commands if "prime_rl.entrypoints.trainer" in c
    ]
    plain, compiled = (load_config(TrainerConfig, argv) for argv in benches)
    for trainer in (plain, compiled):  # one 16,384-token sample a row, as upstream benches
        assert trainer.data.fake_min_len == trainer.data.fake_max_len == trainer.data.fake_seq_len == 16384
    assert compiled.compile and not plain.compile
    rl = next(c for c in commands if "prime_rl.entrypoints.rl" in c)
    config = load_config(RLConfig, rl[rl.index("prime_rl.entrypoints.rl") + 1 :])
    assert config.max_steps == 6 and config.trainer.weight_transfer.type == "broadcast"


def test_compiled_bench_counts_recompiles_from_its_log(tmp_path):
    gpu = load_gpu_module()
    writer = MetricsWriter(tmp_path, "trainer")
    for step in range(3):
        writer.log(step, {"tokens_per_s": 1000.0, "peak_memory_gib": 1.0})
    writer.close()
    log = tmp_path / "step5.log"
    log.write_text("x\nV1127 torch/_dynamo/guards.py] [0/1] [__recompiles] Recompiling function forward in f.py:3\n")
    step = gpu.Step("bench", ["trainer", "--bench"], 1, gpu.COLUMNS[3], tmp_path, gpu.RECOMPILES)
    col = gpu.figures(step, gpu.Outcome(0, 9.0, {}, log), lambda context: 1.0, peak_tflops=None)
    assert col["recompiles"] == "1"


def test_without_cuda_the_real_run_stops_at_once_with_one_line(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: the real run would start")
    done = check("--out", str(tmp_path / "out"))
    assert done.returncode != 0
    assert done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "gpu_check: needs a CUDA GPU (torch sees none); --dry-run prints the plan"
    ]
    assert not (tmp_path / "out").exists()


def test_table_reads_the_runs_metrics(tmp_path):
    """One rl column from metrics files as the trainer and the orchestrator write them."""
    gpu = load_gpu_module()
    trainer, orchestrator = MetricsWriter(tmp_path, "trainer"), MetricsWriter(tmp_path, "orchestrator")
    for step in range(6):
        trainer.log(step, {"tokens_per_s": 1000.0 * (step + 1), "mismatch_kl": 1e-3 * step, "peak_memory_gib": 9.5,
                           "optimized_at": 100.0 + step})  # fmt: skip
        orchestrator.log(step, {"seq_len_mean": 200.0, "completion_len_mean": 100.0, "samples": 10,
                                "time/generate": 0.5, "weight_step": step,
                                **({"weights_served_at": 100.0 + step - 1 + 0.25} if step else {})})  # fmt: skip
    trainer.close()
    orchestrator.close()
    step = gpu.Step("rl", ["rl"], 1, gpu.COLUMNS[1], tmp_path)
    outcome = gpu.Outcome(0, 60.0, {"inference": 20480.0, "trainer": 12288.0, "whole GPU": 33792.0})
    col = gpu.figures(step, outcome, lambda context: 6e9 + context, peak_tflops=1000.0)
    assert col["status"] == "ok: 6 steps, 60 s"
    assert col["trainer tokens/s (median)"] == "4,500"  # steps 2-5 (after the warm-up)
    assert col["trainer MFU"] == f"{100 * 4500 * (6e9 + 100) / 1e15:.1f}%"
    assert col["generated tokens/s (median)"] == "2,000"
    assert col["time to served per update (median)"] == "0.250 s (n = 4)"
    assert col["mismatch KL per step (median / max)"] == "2.50e-03 / 5.00e-03"
    assert col["peak GPU memory: inference (nvidia-smi)"] == "20.0 GiB"
    assert col["peak GPU memory: trainer (nvidia-smi / torch allocated)"] == "12.0 GiB / 9.5 GiB"
    assert "| status | — | ok: 6 steps, 60 s |" in gpu.table({gpu.COLUMNS[1]: col})


def test_a_step_the_budget_stops_says_so_and_one_past_its_own_timeout_times_out(tmp_path):
    """A short --budget gives a step less than its own timeout: stopped there it reads "stopped by --budget", not
    as a hang; a step past its own timeout still reads "timed out"."""
    gpu = load_gpu_module()
    sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
    cut = gpu.run_step(gpu.Step("rl", sleep, 60), tmp_path / "cut.log", timeout=1)
    assert (cut.rc, cut.status()) == (124, "stopped by --budget (1 of its 60 s)")
    own = gpu.run_step(gpu.Step("rl", sleep, 1), tmp_path / "own.log", timeout=1)
    assert (own.rc, own.status()) == (124, "timed out")
    assert gpu.Outcome(0, 1.0).status() == "ok" and gpu.Outcome(3, 1.0).status() == "FAILED (exit 3)"
