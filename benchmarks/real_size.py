"""The RL loop at a real model size: Qwen3-0.6B's transformer on this machine, every phase of a step timed.

    uv run python benchmarks/real_size.py                                    # ~25 min on 2 cores, both backends
    uv run python benchmarks/real_size.py --backends builtin --transfers filesystem --steps 3
    uv run python benchmarks/real_size.py --trl      # + TRL's GRPOTrainer beside it (bash benchmarks/trl_env.sh)
    uv run python benchmarks/real_size.py --layers 2 --steps 2  # real layer shapes, 2 of them (what CI runs)
    uv run python benchmarks/real_size.py --size tiny --backends builtin --transfers filesystem --steps 12 --trl

The model: `tiny-model --preset qwen3-0.6b --vocab-size 2048` (hidden 1024, 28 layers, 16 q / 8 kv heads,
head_dim 128, MLP 3072, tied embeddings; a 2,048-id BPE vocabulary, so 0.44 B parameters: the transformer of
Qwen3-0.6B without its 152k-row embedding, which a CPU cannot afford to train). `--size tiny`: the 0.8 M
Qwen3 (hidden 128 x 4 layers, the char-level tokenizer) at `benchmarks/loop.py handoffs`' batch, 8 prompts x 8.
Each case is one real `rl` run (a 1-rank trainer, fp32, synchronous: async_level 0, so every phase is on the
step's critical path) on reverse-text with a checkpoint every `--ckpt-interval` steps. Per step, medians over the
steps after the first:
- generate: the orchestrator's generation requests (and scoring);
- train: the trainer's forward/backward/optimizer step;
- export: the trainer writing the weights (filesystem) or sending them (broadcast);
- to served: the trainer's optimizer step done -> the servers answering with those weights;
- checkpoint: what the step waited for its checkpoint (`time/save_ckpt`), and the largest share of a trainer
  step (`time/step` of the record holding it) it took;
- step: wall time between the ends of two orchestrator steps;
- mismatch KL: the trainer's, between the servers' sampling logprobs and its own (sync: the same weights);
- peak RSS per service: the largest resident memory of each service's process tree (a vLLM server's engine
  process counts for inference), sampled from /proc every 0.5 s.
`--ckpt-modes async,sync` adds the same case with the synchronous checkpoint (the before of the async save).
With `--trl`, TRL's GRPOTrainer (its own environment, `.venv-trl`, never in the project's lock) runs the same
model, task, batch, lengths and optimizer settings, sync, and the table gets its step and split beside ours.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import add_json_argument, median_of, rl_config_toml, write_json

from prime_rl.utils.metrics import read_metrics
from prime_rl.utils.net import free_port
from prime_rl.utils.tiny_model import create_tiny_model

ROOT = Path(__file__).resolve().parents[1]

SERVICES = {"inference": "prime_rl.entrypoints.inference", "orchestrator": "prime_rl.entrypoints.orchestrator",
            "trainer": "prime_rl.entrypoints.trainer"}  # fmt: skip
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
# The task both sides run: completions of <= 32 tokens, AdamW at lr 1e-5 (the batch: --batch-size, --rollouts).
MAX_TOKENS, LR = 32, 1e-5


def config_text(model: Path, out: Path, args, transfer: str, backend: str, ckpt_async: bool) -> str:
    ckpt = (
        f"\n[ckpt]\ninterval = {args.ckpt_interval}\nasync_save = {str(ckpt_async).lower()}\n"
        if args.ckpt_interval
        else ""
    )
    if args.no_share_prompts:  # still in the [trainer] table rl_config_toml ends with
        ckpt = "share_prompts = false\n" + ckpt
    return rl_config_toml(model, out, steps=args.steps, async_level=0, transfer=transfer, port=free_port(),
                          backend=backend, batch_size=args.batch_size, rollouts=args.rollouts, max_tokens=MAX_TOKENS,
                          lr=LR, share_prompts=not args.no_share_prompts, extra=ckpt)  # fmt: skip


class ServiceMemory(threading.Thread):
    """Peak resident memory (GiB) of each service's process tree, from /proc every 0.5 s."""

    def __init__(self, root_pid: int) -> None:
        super().__init__(daemon=True)
        self.root, self.peaks, self.done = root_pid, {}, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            table, now = processes(), {}
            for pid, (_, _, rss) in table.items():
                if service := self.service_of(pid, table):
                    now[service] = now.get(service, 0.0) + rss
            for k, v in now.items():
                self.peaks[k] = max(self.peaks.get(k, 0.0), v)

    def service_of(self, pid: int, table: dict) -> str | None:
        """The service whose entrypoint is in `pid`'s parent chain below the rl process, if any."""
        for _ in range(16):
            if pid == self.root or pid not in table:
                return None
            parent, cmdline, _ = table[pid]
            if name := next((s for s, module in SERVICES.items() if module in cmdline), None):
                return name
            pid = parent
        return None


def processes() -> dict[int, tuple[int, str, float]]:
    """pid -> (parent pid, command line, resident GiB) of every process /proc shows."""
    out = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            parent = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            rss = int((d / "statm").read_text().split()[1]) * page / 2**30
        except (OSError, ValueError, IndexError):
            continue
        out[int(d.name)] = (parent, cmdline, rss)
    return out


def run_case(model: Path, work: Path, args, transfer: str, backend: str, ckpt_async: bool) -> dict:
    name = f"{backend}-{transfer}-{'async' if ckpt_async else 'sync'}"
    out, cfg = work / name, work / f"{name}.toml"
    cfg.write_text(config_text(model, out, args, transfer, backend, ckpt_async))
    log = (work / f"{name}.log").open("w")
    start = time.perf_counter()
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "2"}  # GiB
    cmd = [sys.executable, "-m", "prime_rl.entrypoints.rl", "@", str(cfg)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    memory = ServiceMemory(proc.pid)
    memory.start()
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.wait(60)
        rc = f"timed out after {args.timeout:.0f} s"
    memory.done.set()
    memory.join()
    if rc != 0:
        sys.exit(f"rl {name} failed ({rc}); its log: {log.name}\n{Path(log.name).read_text()[-3000:]}")
    orch = {r["step"]: r for r in read_metrics(out, "orchestrator")}
    trainer = {r["step"]: r for r in read_metrics(out, "trainer")}
    rows = []
    for step in range(1, args.steps):
        o, prev, t = orch[step], orch[step - 1], trainer[step - 1]  # step's weights come from trainer step - 1
        w = o["weight_step"]
        served = o["weights_served_at"] - trainer[w - 1]["optimized_at"] if "weights_served_at" in o and w else None
        export = t.get("time/save_weights", 0.0) + t.get("time/broadcast_weights", 0.0)
        # A step's save is timed in the next step's record, whose time/step holds it.
        nxt = trainer.get(step, {})
        rows.append({"generate": o["time/generate"], "train": t["time/train"], "export": export, "to_served": served,
                     "ckpt": nxt.get("time/save_ckpt", 0.0), "trainer_step": nxt.get("time/step"),
                     "mismatch_kl": t.get("mismatch_kl"),
                     "step": o["time"] - prev["time"]})  # fmt: skip
    rss = {f"{k} (metrics)": max(r["peak_rss_gib"] for r in recs.values())
           for k, recs in (("trainer", trainer), ("orchestrator", orch))}  # fmt: skip
    for bulky in ("checkpoints", "weights", "rollouts"):  # ~20 GB a case at 0.44 B: the next case needs the disk
        shutil.rmtree(out / bulky, ignore_errors=True)
    return {"name": name, "rows": rows, "peaks": memory.peaks | rss, "seconds": time.perf_counter() - start}


def run_trl(model: Path, work: Path, args) -> dict:
    if not TRL_PYTHON.exists():
        sys.exit(f"--trl needs TRL's environment: bash benchmarks/trl_env.sh (no {TRL_PYTHON})")
    out = work / "trl.json"
    # As many steps as each of our cases measures (its first is left out), after one of warm-up.
    cmd = [str(TRL_PYTHON), str(ROOT / "benchmarks" / "trl_grpo.py"), "--model", str(model), "--steps",
           str(args.steps - 1), "--warmup", "1", "--batch-size", str(args.batch_size), "--rollouts-per-example",
           str(args.rollouts), "--max-tokens", str(MAX_TOKENS), "--lr", str(LR), "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        sys.exit(f"TRL failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())["summary"]


def seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=("real", "tiny"), default="real", help="Qwen3-0.6B's shape or 0.8 M")
    parser.add_argument("--layers", type=int, default=28, help="layers of the 0.6B shape (28 = all: 0.44 B)")
    parser.add_argument("--backends", default="builtin,vllm")
    parser.add_argument("--transfers", default="filesystem,broadcast")
    parser.add_argument("--ckpt-modes", default="async", help="async, sync or both: the trainer's checkpoint save")
    parser.add_argument("--steps", type=int, default=4, help="rl steps per case (the first is left out)")
    parser.add_argument("--batch-size", type=int, help="samples per step (prompts x --rollouts): 16, tiny 64")
    parser.add_argument("--rollouts", type=int, help="completions per prompt: 4, tiny 8")
    parser.add_argument("--ckpt-interval", type=int, default=2, help="0: no checkpoints (as TRL's side saves none)")
    parser.add_argument(
        "--no-share-prompts",
        action="store_true",
        help="ours: each completion computes its prompt (else rows count a group's prompt once)",
    )
    parser.add_argument("--trl", action="store_true", help="TRL's GRPOTrainer beside ours (.venv-trl)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    add_json_argument(parser, "real_size")
    args = parser.parse_args()
    tiny = args.size == "tiny"
    args.batch_size = args.batch_size or (64 if tiny else 16)
    args.rollouts = args.rollouts or (8 if tiny else 4)

    with tempfile.TemporaryDirectory(prefix="bench-real-") as tmp:
        work = Path(tmp)
        if tiny:
            model = create_tiny_model(work / "tiny", hidden_size=128, num_layers=4, tokenizer_vocab_size=259)
        else:
            model = create_tiny_model(work / "qwen3-0.6b-shape", preset="qwen3-0.6b", num_layers=args.layers,
                                      vocab_size=2048, tokenizer_vocab_size=2048)  # fmt: skip
        cases = []
        for backend, transfer, mode in itertools.product(
            *(getattr(args, k).split(",") for k in ("backends", "transfers", "ckpt_modes"))
        ):
            case = run_case(model, work, args, transfer, backend, mode == "async")
            print(f"{case['name']}: {len(case['rows'])} steps, run {case['seconds']:.0f} s", file=sys.stderr)
            cases.append(case)
            write_json(args, "real_size", {"cases": cases, "trl": None})  # a later failure keeps the earlier ones
        trl = run_trl(model, work, args) if args.trl else None

    print("| case | generate | train | export | to served | checkpoint (share) | step | mismatch KL (max) | peak RSS: "
          "inference / orchestrator / trainer |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        rows, peaks = case["rows"][1:] or case["rows"], case["peaks"]
        step, ckpt = median_of(rows, "step"), [r["ckpt"] / r["trainer_step"] for r in rows if r["ckpt"]]
        share = f"{seconds(median_of([r for r in rows if r['ckpt']], 'ckpt'))} ({max(ckpt):.1%} max)" if ckpt else "—"
        mem = " / ".join(f"{peaks.get(s, 0.0):.1f}" for s in SERVICES)
        print(f"| {case['name']} | {seconds(median_of(rows, 'generate'))} | {seconds(median_of(rows, 'train'))} | "
              f"{seconds(median_of(rows, 'export'))} | {seconds(median_of(rows, 'to_served'))} | {share} | "
              f"{seconds(step)} | {max(r['mismatch_kl'] or 0.0 for r in case['rows']):.1e} | {mem} GiB |")  # fmt: skip
    if trl:
        print(f"| TRL {trl['trl']} GRPOTrainer | {seconds(trl['generate_s'])} | {seconds(trl['train_s'])} "
              f"| — | — | — | {seconds(trl['step_s'])} | — | trainer {trl['peak_rss_gib']:.1f} GiB |")  # fmt: skip
        ours = next((c for c in cases if c["name"].startswith("builtin-filesystem")), cases[0] if cases else None)
        if ours:
            rows = ours["rows"][1:] or ours["rows"]
            ratios = {k: median_of(rows, k) / trl[f"{k}_s"] for k in ("step", "generate", "train") if trl[f"{k}_s"]}
            print(f"\nours ({ours['name']}) / TRL: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    write_json(args, "real_size", {"cases": cases, "trl": trl})


if __name__ == "__main__":
    main()
