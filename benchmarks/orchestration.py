"""Orchestration modes side by side, each a real `rl` run (built-in engine, 1-rank trainer, CPU, fp32):

    uv run python benchmarks/orchestration.py                  # all cases
    uv run python benchmarks/orchestration.py --cases long-tail
    uv run python benchmarks/orchestration.py --cases long-tail --before /tmp/before/src   # and an older commit's
    uv run python benchmarks/orchestration.py --cases long-tail --backend vllm   # vLLM serving (its CPU build here)

- `long-tail`: a long-tailed multi-turn environment (benchmarks/long_tail.py: one group in 8 plays 10 model
  turns, the rest 1; 8 groups of 4 a step), barrier mode (each step samples its own batch and waits for
  its slowest group) vs continuous mode (`max_inflight` = 2 batches, `max_off_policy_steps` = 2), same
  seeds.
- `long-tail-generation`: the same two modes without a trainer (the orchestrator in-process against one
  built-in server, async_level = steps): on this machine the trainer shares the two cores with inference,
  so the whole loop is compute-bound either way; this case shows the scheduling alone, as on a cluster
  where inference has its own devices.
- `eval`: reverse-text without and with an `[[orchestrator.eval]]` every 2 steps; the step time against
  the eval's share of all requests.
Reported per mode, over the steps after `--warmup`: the median step (wall time between the ends of two
orchestrator steps) and its generation; the trainer's idle share (its `time/wait` for rank files over its
`time/step`, summed); the server's idle share (the time between the warm-up's end and the last step over
which its generated-token counter, read from /metrics every 0.1 s by this process, did not move); the lag
histogram of what was trained (per token, `token_lag/k`, where the run records per-token policy steps, else
per rollout, `off_policy_gap/k`); the share of long episodes among trained rollouts (and among all generated ones, where
the run reports `generated/*`); groups dropped as stale; the evals' share of requests.
`--before` also runs each mode with `rl` from another source tree ahead of this venv's (e.g. `git worktree add
/tmp/before <commit>`), right before this tree's: before/after in one invocation, same environment file.
`--backend vllm` serves with vLLM (compiled graphs off, 1 GiB KV cache: it starts in minutes on 2 cores; the
server's idle share reads vLLM's `vllm:generation_tokens_total`); `long-tail` only.
Inference and the trainer get one torch thread each: two multi-threaded processes on two cores spin
against each other, and whichever mode keeps both busier would look slower for that reason alone.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from common import add_json_argument, start_server, write_json

from prime_rl.utils.metrics import read_metrics
from prime_rl.utils.net import free_port
from prime_rl.utils.tiny_model import create_tiny_model

ROOT = Path(__file__).resolve().parents[1]

BASE = """
output_dir = "{out}"
max_steps = {steps}
async_level = 1

[model]
name = "{model}"

[inference]
server.port = {port}
max_model_len = 512
engine.cpu_threads = 1  # one core each for inference and the trainer (OMP_NUM_THREADS=1), as on separate devices

[orchestrator]
batch_size = {batch_size}
rollouts_per_example = {rollouts}
seq_len = 512
sampling.max_tokens = {max_tokens}
sampling.seed = 7

[trainer]
optim.lr = 1e-4
"""

CASES = {
    "long-tail": {
        "barrier": '[[orchestrator.env]]\nid = "long_tail:load_environment"\n',
        "continuous": "[orchestrator]\nmax_inflight = 64\nmax_off_policy_steps = 2\n"
        '[[orchestrator.env]]\nid = "long_tail:load_environment"\n',
    },
    "long-tail-generation": {"barrier": "", "continuous": ""},
    "eval": {
        "no eval": '[[orchestrator.env]]\nid = "reverse-text"\n',
        "eval every 2": '[[orchestrator.env]]\nid = "reverse-text"\n'
        '[[orchestrator.eval]]\nid = "reverse-text"\ninterval = 2\nnum_examples = 16\nrollouts_per_example = 2\n',
    },
}


LONG = 10  # model turns of a long episode (benchmarks/long_tail.py); the others play 1

SHAPES = {  # case: (batch_size, rollouts_per_example, max_tokens)
    "long-tail": (32, 4, 12),  # 8 groups a step, one of them 10 turns long; training stays light
    "long-tail-generation": (32, 4, 12),
    "eval": (64, 8, 32),
}


VLLM = 'backend = "vllm"\nenforce_eager = true  # no compile warm-up: starts sooner on 2 cores\n'


def run_case(
    model: Path, out: Path, steps: int, port: int, case: str, extra: str, src: Path | None, backend: str = "builtin"
) -> list[dict]:
    # TOML tables cannot be reopened: fold the extra [orchestrator] keys into the base's table.
    batch_size, rollouts, max_tokens = SHAPES[case]
    base = BASE.format(out=out, steps=steps, model=model, port=port, max_tokens=max_tokens, batch_size=batch_size,
                       rollouts=rollouts)  # fmt: skip
    if backend == "vllm":
        # Unseeded: code before vllm/args.py turned chunked prefill off on CPU (a --before tree) ran vLLM's CPU
        # build with it, whose engine dies on a seeded request whose prefill is chunked ("CPU Generator does not
        # use offset"), which continuous mode's long contexts reach.
        base = base.replace("[inference]\n", "[inference]\n" + VLLM).replace("sampling.seed = 7\n", "")
    if extra.startswith("[orchestrator]\n"):
        keys, _, extra = extra.removeprefix("[orchestrator]\n").partition("[[")
        base, extra = base.replace("[orchestrator]\n", "[orchestrator]\n" + keys), "[[" + extra
    cfg = out.with_suffix(".toml")
    cfg.write_text(base + extra)
    paths = [str(src)] if src is not None else []  # ahead of the venv's own prime_rl
    paths += [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run([sys.executable, "-m", "prime_rl.entrypoints.rl", "@", str(cfg)], cwd=ROOT,
                          capture_output=True, text=True, env=env)  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"rl failed for {cfg}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return read_metrics(out, "orchestrator")


def generation_only(model: Path, out: Path, steps: int, continuous: bool, port: int) -> list[dict]:
    import asyncio

    from prime_rl.configs.orchestrator import OrchestratorConfig
    from prime_rl.launch.supervise import stop_all
    from prime_rl.orchestrator.orchestrator import orchestrate

    batch_size, rollouts, max_tokens = SHAPES["long-tail"]
    out.mkdir(parents=True)
    server = start_server(model, port, out, ["--engine.max-batch-size", "256"])
    try:
        config = OrchestratorConfig(
            model={"name": str(model)}, output_dir=out, max_steps=steps, async_level=steps, batch_size=batch_size,
            rollouts_per_example=rollouts, seq_len=512, progress=False, env={"id": "long_tail:load_environment"},
            sampling={"max_tokens": max_tokens, "seed": 7}, client={"base_url": [f"http://127.0.0.1:{port}/v1"]},
            max_inflight=2 * batch_size if continuous else None, max_off_policy_steps=steps,
        )  # fmt: skip
        asyncio.run(orchestrate(config))
    finally:
        stop_all([server])
    return read_metrics(out, "orchestrator")


class ServerLoad(threading.Thread):
    """Reads a built-in server's generated-token counter (/metrics) every `interval` s in the background.

    The server was idle over an interval between two reads when the counter did not move. Time-weighted
    over the intervals, not a share of reads: a busy server answers /metrics late, so a share of reads of
    a gauge (sequences running) would over-sample its idle moments."""

    def __init__(self, port: int, interval: float = 0.1):
        super().__init__(daemon=True)
        self.url, self.interval, self.reads = f"http://127.0.0.1:{port}/metrics", interval, []
        self.stopped = threading.Event()

    def run(self) -> None:
        import httpx

        while not self.stopped.wait(self.interval):
            sent = time.time()
            try:
                text = httpx.get(self.url, timeout=10.0).text
            except httpx.HTTPError:
                continue  # not up yet, or gone
            tokens = [float(line.split()[-1]) for line in text.splitlines()
                      if line.startswith(("prime_rl_inference_generated_tokens_total ",
                                          "vllm:generation_tokens_total"))]  # fmt: skip
            if tokens:
                self.reads.append(((sent + time.time()) / 2, tokens[0]))

    def idle_share(self, start: float, end: float) -> float | None:
        reads = [(t, n) for t, n in self.reads if start <= t <= end]
        spans = [(b[0] - a[0], b[1] == a[1]) for a, b in itertools.pairwise(reads)]
        total = sum(dt for dt, _ in spans)
        return sum(dt for dt, idle in spans if idle) / total if total else None


def histogram(measured: list[dict]) -> str:
    """Per-token lag (`token_lag/k`: tokens sampled k steps before the step that trains them) where the run
    records it, else the per-rollout off-policy gap (`off_policy_gap/k`, the rollout's oldest policy)."""
    key = "token_lag/" if any(k.startswith("token_lag/") for m in measured for k in m) else "off_policy_gap/"
    counts = Counter()
    for m in measured:
        counts.update({int(k.split("/")[1]): v for k, v in m.items() if k.startswith(key)})
    total = sum(counts.values()) or 1
    unit = "tokens" if key == "token_lag/" else "rollouts"
    return f"{unit}: " + ", ".join(f"{g}: {n / total:.0%}" for g, n in sorted(counts.items()))


def long_share(measured: list[dict], prefix: str = "") -> str:
    """The share of long episodes (10 turns, the rest 1) among rollouts: (turns_mean - 1) / 9."""
    key = f"{prefix}turns_mean"
    values = [(m[key], m.get(f"{prefix}groups", 1)) for m in measured if key in m]
    if not values:
        return "-"
    turns = sum(t * n for t, n in values) / max(sum(n for _, n in values), 1)
    return f"{(turns - 1) / (LONG - 1):.1%}"


def row(case: str, mode: str, out: Path, orch: list[dict], warmup: int, load: ServerLoad) -> dict:
    measured = orch[warmup + 1 :]
    walls = [b["time"] - a["time"] for a, b in itertools.pairwise(orch[warmup:])]
    trainer = read_metrics(out, "trainer")[warmup + 1 :]
    trainer_idle = (f"{sum(t.get('time/wait', 0) for t in trainer) / sum(t['time/step'] for t in trainer):.0%}"
                    if trainer else "-")  # fmt: skip
    idle = load.idle_share(orch[warmup]["time"], orch[-1]["time"])
    server_idle = "-" if idle is None else f"{idle:.0%}"
    evals = read_metrics(out, "eval")
    train_requests = SHAPES[case][0] * len(orch)
    eval_requests = sum(e["samples"] for e in evals)
    share = f"{eval_requests / (eval_requests + train_requests):.1%}" if evals else "-"
    long = "-"
    if case.startswith("long-tail"):
        long = long_share(measured, "trained/" if "trained/turns_mean" in measured[0] else "")
        if "generated/turns_mean" in measured[0]:
            long += f" ({long_share(measured, 'generated/')})"
    generate = statistics.median(m["time/generate"] for m in measured)
    stale = sum(m.get("stale_groups", 0) for m in measured)
    return {"mode": mode, "step_s": statistics.median(walls), "generate_s": generate, "trainer_idle": trainer_idle,
            "server_idle": server_idle, "lag": histogram(measured), "long_episodes": long, "stale_groups": stale,
            "eval_share": share}  # fmt: skip


def cells(r: dict) -> str:
    return (
        f"| {r['mode']} | {r['step_s']:.2f} s | {r['generate_s']:.2f} s | {r['trainer_idle']} | "
        f"{r['server_idle']} | {r['lag']} | {r['long_episodes']} | {r['stale_groups']} | {r['eval_share']} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="long-tail,long-tail-generation,eval")
    parser.add_argument("--steps", type=int, default=10, help="measured steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--backend", choices=["builtin", "vllm"], default="builtin")
    parser.add_argument("--before", type=Path, help="also run `rl` from this source tree (an older commit's "
                        "worktree's src/), each mode before this tree's")  # fmt: skip
    add_json_argument(parser, "orchestration")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {}
    trees = {"before": args.before, "after": None} if args.before is not None else {"": None}
    with tempfile.TemporaryDirectory(prefix="bench-orch-") as tmp:
        work = Path(tmp)
        model = create_tiny_model(work / "model", hidden_size=128, num_layers=4, tokenizer_vocab_size=259)
        for case in args.cases.split(","):
            print(f"\n### {case}\n")
            print("| mode | step (median) | generate | trainer idle | server idle | lag | long episodes: trained "
                  "(generated) | stale groups | eval share |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|---|")
            if args.backend != "builtin" and case != "long-tail":
                sys.exit(f"--backend {args.backend}: only the long-tail case runs a chosen backend")
            for mode, extra in CASES[case].items():
                for tree, src in trees.items():
                    if case == "long-tail-generation" and src is not None:
                        continue  # runs this tree's orchestrator in-process
                    label = f"{mode}, {tree}" if tree else mode
                    out = work / f"{case}-{label.replace(' ', '-').replace(',', '')}"
                    start = time.perf_counter()
                    steps = args.steps + args.warmup + 1
                    port = free_port()
                    load = ServerLoad(port)
                    load.start()
                    try:
                        if case == "long-tail-generation":
                            orch = generation_only(model, out, steps, mode == "continuous", port)
                        else:
                            orch = run_case(model, out, steps, port, case, extra, src, args.backend)
                    finally:
                        load.stopped.set()
                    results.setdefault(case, []).append(row(case, label, out, orch, args.warmup, load))
                    print(cells(results[case][-1]), flush=True)
                    print(f"    ({label}: run {time.perf_counter() - start:.0f} s)", file=sys.stderr)
    write_json(args, "orchestration", {"cases": results})


if __name__ == "__main__":
    main()
