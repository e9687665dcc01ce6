"""GPU acceptance in one command: a Qwen3-0.6B-shaped model, the gpu tests, RL on vLLM with both weight
transfers, and one table of what they measured beside upstream prime-rl's published single-H100 figures.

    bash scripts/gpu_check.sh              # one CUDA GPU, `uv sync --extra vllm` done, no internet: <= 40 min
    bash scripts/gpu_check.sh --quick      # <= 11 min, vLLM not needed: probes, benches, a short rl
    bash scripts/gpu_check.sh --dry-run    # every command it would run, in order, with its timeout

Steps (each a subprocess with its own timeout and log under --out; a failed one is reported, the others
still run, and the exit status is 1):
1. `tiny-model --preset qwen3-0.6b`: Qwen3-0.6B's exact shape, random bf16 weights, an offline tokenizer;
2. `pytest -m gpu`: the tests marked gpu;
3. `rl` on the reverse-text example (configs/examples/reverse_text/rl.toml) with that model: vLLM, a bf16
   FSDP2 trainer on the same GPU, `weight_transfer = broadcast` (nccl; gloo when both share one GPU);
4. `trainer --bench` alone in upstream's shape: one 16,384-token sample a row, activation checkpointing;
5. `rl` with `weight_transfer = filesystem`, fewer steps.
`--quick`: 1, then the fork probe, a one-rank NCCL weight group and sharded loading (scripts/gpu_probes.py), 4, 4 with
`--compile` (TORCH_LOGS=recompiles: the recompilations are counted), and 3 for 6 steps.
The rl runs are synchronous (async_level 0): every step samples from the weights the trainer has, so the
mismatch KL is the two engines' numerics, not a policy lag.

Every figure is read from what the runs write: metrics/{trainer,orchestrator}.jsonl (trainer tokens/s and
torch peak memory, mismatch KL, generated tokens over generation time, time to served = the trainer's
optimizer step done -> the servers answering with those weights, as benchmarks/loop.py handoffs measures it); MFU with
trainer/rl/bench.py's FLOPs per token (6 x matmul parameters + 12 x layers x attention width x mean causal
context); peak GPU memory per service from nvidia-smi, sampled every second by a side thread (a process counts
for the service whose entrypoint is in its parent chain). Upstream's figures: PrimeIntellect-ai/prime-rl
benchmarks/results/BENCHMARKS.md, Qwen3-0.6B, RL full, 16,384-token rows, recompute, FA3, 1xH100 HBM3:
11.90k tokens/s, 11.1% MFU, 12.5 GiB.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from prime_rl.utils.metrics import read_metrics
from prime_rl.utils.net import free_port

ROOT = Path(__file__).resolve().parents[1]

PRESET = "qwen3-0.6b"
RL_CONFIG = "configs/examples/reverse_text/rl.toml"
# Over the example: more rollouts, longer answers and packed rows of 2k tokens than CPU sizes; a 0.6B model's
# learning rate. vLLM picks its own batch size (1024 sequences on an H100/H200); the built-in engine decodes 256.
RL_GPU = ["--async-level", "0", "--orchestrator.batch-size", "256",
          "--orchestrator.sampling.max-tokens", "128", "--orchestrator.seq-len", "2048",
          "--inference.max-model-len", "2048", "--trainer.dtype", "bfloat16", "--trainer.optim.lr", "1e-6"]  # fmt: skip
# vLLM leaves the trainer ~70% of the GPU. Without vLLM (a machine where it cannot be installed) the runs use
# the built-in engine on CUDA, in bfloat16, and the table says so.
BACKEND_ARGS = {"vllm": ["--inference.backend", "vllm", "--inference.gpu-memory-utilization", "0.3"],
                "builtin": ["--inference.backend", "builtin", "--inference.engine.max-batch-size", "256"]}  # fmt: skip
# The bench in upstream's shape: one 16,384-token sample a row (two rows a step), so attention is a real share.
SAMPLE_LEN = 16384
BENCH_ROWS = ["--data.fake-seq-len", str(SAMPLE_LEN), "--data.fake-micro-batches", "2", "--data.fake-min-len",
              str(SAMPLE_LEN), "--data.fake-max-len", str(SAMPLE_LEN)]  # fmt: skip
# The compiled bench logs every recompilation (a new row length should not recompile: dynamic shapes).
RECOMPILES = {"TORCH_LOGS": "recompiles"}
# NCCL refuses two ranks of one group on one GPU ('Duplicate GPU detected'), where rl puts both on a 1-GPU node.
ONE_GPU = (
    "with one GPU, rl puts the trainer and vLLM on GPU 0 and sends the broadcast over gloo (weight_transfer.backend "
    "auto; NCCL refuses two ranks of one group on one GPU): tensors still land on the GPU, through host memory; "
    "with two GPUs the trainer gets GPU 1 and the broadcast is nccl"
)
# Every step's environment: no hub look-ups (the machine has no internet), no vLLM usage reports, logs as they come.
ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1"}
WARMUP = 2  # steps left out of the medians (the rl runs; the bench leaves out its first, as its own table does)
SERVICES = {"inference": "prime_rl.entrypoints.inference", "trainer": "prime_rl.entrypoints.trainer"}
COLUMNS = ["rl, broadcast", "rl, filesystem", "trainer --bench (16k rows, AC)", "trainer --bench --compile",
           "upstream prime-rl, 1xH100"]  # fmt: skip
UPSTREAM_COLUMN = COLUMNS[-1]
ROWS = ["status", "inference backend", "trainer tokens/s (median)", "trainer MFU", "generated tokens/s (median)",
        "time to served per update (median)", "mismatch KL per step (median / max)",
        "peak GPU memory: inference (nvidia-smi)", "peak GPU memory: trainer (nvidia-smi / torch allocated)",
        "peak GPU memory: whole GPU (nvidia-smi)", "recompiles"]  # fmt: skip
UPSTREAM = {"status": "published", "trainer tokens/s (median)": "11.9k (16k rows, AC, FA3)", "trainer MFU": "11.1%",
            "peak GPU memory: trainer (nvidia-smi / torch allocated)": "12.5 GiB"}  # fmt: skip


@dataclass
class Step:
    name: str
    cmd: list[str]
    timeout: int
    column: str | None = None  # the table column its figures go to
    output_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)  # over ENV


@dataclass
class Outcome:
    rc: int
    seconds: float
    peaks: dict[str, float] = field(default_factory=dict)  # MiB per service, from nvidia-smi
    log: Path | None = None
    cut: str = ""  # a step the budget stopped before its own timeout: " by --budget (64 of its 160 s)"

    def status(self) -> str:
        """ok, or how it ended (a step cut by the budget did not fail on its own: a plain 'timed out' would read as
        a hang)."""
        if self.cut:
            return f"stopped{self.cut}"
        return "ok" if self.rc == 0 else "timed out" if self.rc == 124 else f"FAILED (exit {self.rc})"


def plan(out: Path, steps: int, fs_steps: int, backend: str, quick: bool = False) -> list[Step]:
    """The full check (model, gpu tests, rl broadcast, bench, rl filesystem), or with `quick` (<= 11 min, no vLLM
    needed): model, fork probe, one-rank NCCL, bench, bench --compile, a short rl with broadcast."""
    py, model = sys.executable, out / PRESET
    rl = [py, "-m", "prime_rl.entrypoints.rl", "@", RL_CONFIG, "--model.name", str(model), *BACKEND_ARGS[backend]]
    trainer = [py, "-m", "prime_rl.launch.torchrun", "--standalone", "--nproc-per-node", "1",
               "-m", "prime_rl.entrypoints.trainer"]  # fmt: skip
    engine = "vLLM" if backend == "vllm" else "built-in engine"

    def rl_run(transfer: str, n: int, timeout: int) -> Step:
        d = out / f"rl-{transfer}"
        cmd = [*rl, "--output-dir", str(d), "--max-steps", str(n), "--weight-transfer", transfer,
               "--inference.server.port", str(free_port()), *RL_GPU]  # fmt: skip
        name = f"rl: {engine} + FSDP2 bf16 trainer, weight transfer {transfer}"
        return Step(name, cmd, timeout, COLUMNS[0 if transfer == "broadcast" else 1], d)

    def bench(compiled: bool, timeout: int = 300) -> Step:
        d = out / ("trainer-bench-compile" if compiled else "trainer-bench")
        cmd = [*trainer, "--model.name", str(model), "--output-dir", str(d), "--bench", "--data.fake", *BENCH_ROWS,
               "--activation-checkpointing", "--dtype", "bfloat16", "--max-steps", "6"]  # fmt: skip
        name = "trainer benchmark" + (", compiled (recompiles logged)" if compiled else "")
        return Step(name, cmd + ["--compile"] * compiled, timeout, COLUMNS[3 if compiled else 2], d,
                    RECOMPILES if compiled else {})  # fmt: skip

    build = [py, "-m", "prime_rl.utils.tiny_model", str(model), "--preset", PRESET]
    if quick:  # timeouts: 11 min in all
        probes = [py, str(ROOT / "scripts" / "gpu_probes.py")]
        return [Step(f"build the {PRESET} model", build, 90),
                Step("fork probe: inference up to vLLM's engine start", [*probes, "fork", str(model)], 45),
                Step("NCCL: one-rank weight group sends the model", [*probes, "nccl", str(model)], 45),
                Step("sharded loading onto the GPU equals a whole load", [*probes, "loading", str(model)], 60),
                bench(compiled=False, timeout=100), bench(compiled=True, timeout=130),
                rl_run("broadcast", steps, 160)]  # fmt: skip
    build = Step(f"build the {PRESET} model", build, 300)
    return [build, Step("gpu tests", [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"], 600),
            rl_run("broadcast", steps, 720), bench(compiled=False), rl_run("filesystem", fs_steps, 480)]  # fmt: skip


def shown(cmd: list[str]) -> str:
    return shlex.join(os.path.relpath(c, ROOT) if c == sys.executable and c.startswith(str(ROOT)) else c for c in cmd)


class GpuMemory(threading.Thread):
    """Peak memory (MiB) per service while a step runs, from nvidia-smi every second; a process whose parent
    chain holds no service's entrypoint (or that /proc does not know: another PID namespace) counts as other."""

    QUERIES = (["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
               ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"])  # fmt: skip

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peaks: dict[str, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(1.0):
            try:
                apps, total = (
                    subprocess.run(q, capture_output=True, text=True, timeout=10).stdout for q in self.QUERIES
                )
            except (OSError, subprocess.TimeoutExpired):
                continue
            now = {"whole GPU": sum(float(x) for x in total.split() if x.replace(".", "").isdigit())}
            for line in apps.splitlines():
                pid, mib = (x.strip() for x in line.split(",")[:2])
                if pid.isdigit() and mib.replace(".", "").isdigit():
                    service = service_of(int(pid))
                    now[service] = now.get(service, 0.0) + float(mib)
            for key, value in now.items():
                self.peaks[key] = max(self.peaks.get(key, 0.0), value)


def service_of(pid: int) -> str:
    for _ in range(16):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if name := next((s for s, module in SERVICES.items() if module in cmdline), None):
            return name
    return "other"


def run_step(step: Step, log: Path, timeout: float) -> Outcome:
    """Run `step` in its own session, output to `log`; at `timeout` SIGTERM (rl stops its services), then
    SIGKILL 20 s later. rc 124 = timed out (`cut` where `timeout`, the budget's, was below the step's own)."""
    sampler = GpuMemory() if step.column else None
    if sampler:
        sampler.start()
    start = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(step.cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env=os.environ | ENV | step.env)  # fmt: skip
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = 124
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if proc.poll() is None:
                    os.killpg(proc.pid, sig)
                    try:
                        proc.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        pass
    if sampler:
        sampler.done.set()
        sampler.join()
    cut = f" by --budget ({timeout:.0f} of its {step.timeout} s)" if rc == 124 and timeout < step.timeout else ""
    return Outcome(rc, time.monotonic() - start, sampler.peaks if sampler else {}, log, cut)


def last_line(log: Path) -> str:
    """The step's own last word: its last line that is not a torch warning ("[W1127 ...")."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return next((x.strip() for x in reversed(lines) if x.strip() and not x.startswith("[W")), "")


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def figures(step: Step, outcome: Outcome, flops_per_token, peak_tflops: float | None) -> dict[str, str]:
    """One column of the table from the step's metrics files and its GPU memory samples."""
    trainer = {r["step"]: r for r in read_metrics(step.output_dir, "trainer")}
    orch = {r["step"]: r for r in read_metrics(step.output_dir, "orchestrator")}
    bench = "--bench" in step.cmd
    warmup = 1 if bench else WARMUP
    measured = [r for s, r in trainer.items() if s >= warmup] or list(trainer.values())
    col = {"status": f"{outcome.status()}: {len(trainer)} steps, {outcome.seconds:.0f} s"}
    if not bench:
        col["inference backend"] = next((a for a in BACKEND_ARGS if a in step.cmd), "?")
    if tps := median(r["tokens_per_s"] for r in measured):
        col["trainer tokens/s (median)"] = f"{tps:,.0f}"
        # Attention's mean causal context: the bench's samples are all SAMPLE_LEN long; rl's, their mean length.
        context = (SAMPLE_LEN + 1) / 2 if bench else median((r["seq_len_mean"] + 1) / 2 for r in orch.values())
        if peak_tflops and context:
            col["trainer MFU"] = f"{100 * tps * flops_per_token(context) / (peak_tflops * 1e12):.1f}%"
    later = [r for s, r in orch.items() if s >= WARMUP]
    if gen := median(r["completion_len_mean"] * r["samples"] / r["time/generate"] for r in later if r["time/generate"]):
        col["generated tokens/s (median)"] = f"{gen:,.0f}"
    served = [r["weights_served_at"] - trainer[r["weight_step"] - 1]["optimized_at"] for r in later
              if "weights_served_at" in r and r["weight_step"] - 1 in trainer]  # fmt: skip
    if served:
        col["time to served per update (median)"] = f"{median(served):.3f} s (n = {len(served)})"
    if "recompiles" in step.env.get("TORCH_LOGS", "") and outcome.log and outcome.log.exists():
        col["recompiles"] = str(outcome.log.read_text(errors="replace").count("Recompiling function"))
    if kl := [r["mismatch_kl"] for r in trainer.values() if "mismatch_kl" in r and not bench]:
        col["mismatch KL per step (median / max)"] = f"{median(kl):.2e} / {max(kl):.2e}"

    def smi(key: str) -> str:
        return f"{outcome.peaks[key] / 1024:.1f} GiB" if key in outcome.peaks else "n/a"

    torch_peak = max((r["peak_memory_gib"] for r in trainer.values()), default=None)
    if outcome.peaks:
        col["peak GPU memory: inference (nvidia-smi)"] = smi("inference")
        col["peak GPU memory: whole GPU (nvidia-smi)"] = smi("whole GPU")
    if outcome.peaks or torch_peak is not None:
        torch_text = f"{torch_peak:.1f} GiB" if torch_peak is not None else "n/a"
        col["peak GPU memory: trainer (nvidia-smi / torch allocated)"] = f"{smi('trainer')} / {torch_text}"
    return col


def table(columns: dict[str, dict[str, str]]) -> str:
    lines = ["| figure | " + " | ".join(COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for row in ROWS:
        lines.append(f"| {row} | " + " | ".join(columns.get(c, {}).get(row, "—") for c in COLUMNS) + " |")
    return "\n".join(lines)


def mfu_inputs(model_dir: Path, peak_tflops: float | None):
    """FLOPs per token as a function of the attention context, and the GPU's bf16 peak (--peak-tflops, else
    the known GPUs' table of trainer --bench)."""
    from transformers import AutoConfig

    from prime_rl.trainer.rl.bench import _PEAK_TFLOPS, flops_per_token
    from prime_rl.utils.tiny_model import meta_model

    config = AutoConfig.from_pretrained(model_dir)
    model = meta_model(config)
    if peak_tflops is None:
        q = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        name = subprocess.run(q, capture_output=True, text=True).stdout
        peak_tflops = next((v for k, v in _PEAK_TFLOPS.items() if k in name), None)
    return (lambda ctx: flops_per_token(model, ctx)), peak_tflops


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "gpu-check")
    parser.add_argument("--steps", type=int, default=20, help="steps of the broadcast rl run")
    parser.add_argument("--fs-steps", type=int, default=8, help="steps of the filesystem rl run")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak for MFU; unset = known GPUs")
    parser.add_argument("--budget", type=float, help="seconds for the whole check: a step gets what is left")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--quick", action="store_true", help="<= 11 min, no vLLM: probes, benches, a short rl")
    args = parser.parse_args()
    out = args.out.resolve()
    import importlib.util

    backend = "vllm" if importlib.util.find_spec("vllm") else "builtin"
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            sys.exit("gpu_check: needs a CUDA GPU (torch sees none); --dry-run prints the plan")
    if backend == "builtin":
        print("gpu_check: vLLM is not installed (uv sync --extra vllm): the rl runs use the built-in engine")
    steps = plan(out, min(args.steps, 6) if args.quick else args.steps, args.fs_steps, backend, args.quick)
    deadline = time.monotonic() + (args.budget or sum(s.timeout for s in steps))
    print(f"GPU acceptance: {len(steps)} steps, at most {sum(s.timeout for s in steps) // 60} min; outputs in {out}")
    print(f"environment of every step: {' '.join(f'{k}={v}' for k, v in ENV.items())}; cwd {ROOT}")
    for i, step in enumerate(steps, 1):
        print(f"{i}. {step.name} [timeout {step.timeout} s]\n   {shown(step.cmd)}")
    measured = ", ".join(str(i) for i, s in enumerate(steps, 1) if s.column)
    print(f"   (during steps {measured}: {shown(GpuMemory.QUERIES[0])} and {shown(GpuMemory.QUERIES[1])} every 1 s)")
    print(f"note: {ONE_GPU}")
    if args.dry_run:
        print(f"table, also written to {out / 'gpu_check.md'}:\n{table({UPSTREAM_COLUMN: UPSTREAM})}")
        return 0

    out.mkdir(parents=True, exist_ok=True)
    columns, notes, failed, mfu = {UPSTREAM_COLUMN: UPSTREAM}, [], 0, None
    for i, step in enumerate(steps, 1):
        log = out / f"step{i}.log"
        print(f"[{time.strftime('%H:%M:%S')}] {i}/{len(steps)} {step.name} (log: {log})", flush=True)
        left = deadline - time.monotonic() - 30  # the report's time
        if left < 30:
            notes.append(f"{i}. {step.name}: not run (--budget spent)")
            continue
        outcome = run_step(step, log, min(step.timeout, left))
        none_marked = step.name == "gpu tests" and outcome.rc == 5  # pytest: nothing selected
        said = "no test is marked gpu" if none_marked else outcome.status()
        notes.append(f"{i}. {step.name}: {said} ({outcome.seconds:.0f} s; {log})")
        if not step.column and (said_last := last_line(log)):
            notes.append(f"   {said_last}")
        if outcome.rc != 0 and not none_marked:
            failed += 1
            tail = log.read_text(errors="replace").splitlines()[-15:]
            print("\n".join("   " + line for line in tail), file=sys.stderr)
            if i == 1:
                break  # nothing else runs without the model
        if step.column:
            try:
                mfu = mfu or mfu_inputs(out / PRESET, args.peak_tflops)
                columns[step.column] = figures(step, outcome, *mfu)
            except Exception as e:  # a figure that cannot be read must not cost the rest of the report
                columns[step.column] = {"status": f"exit {outcome.rc}; figures unreadable: {e!r}"}
    report = table(columns) + "\n\n" + "\n".join(notes) + "\n"
    (out / "gpu_check.md").write_text(report)
    print(report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
