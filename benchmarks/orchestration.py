"""Orchestration modes side by side, each a real `rl` run (built-in engine, 1-rank trainer, CPU, fp32):

    uv run python benchmarks/orchestration.py                  # both comparisons
    uv run python benchmarks/orchestration.py --cases long-tail

- `long-tail`: a long-tailed multi-turn environment (benchmarks/long_tail.py: one group in 8 plays 10 model
  turns, the rest 1; 8 groups of 4 a step), barrier mode (each step samples its own batch and waits for
  its slowest group) vs continuous mode (`max_inflight` = 2 batches, `max_off_policy_steps` = 2), same
  seeds. Reported: step
  time, the off-policy gap distribution of the rollouts trained on, and the groups dropped as stale.
- `long-tail-generation`: the same two modes without a trainer (the orchestrator in-process against one
  built-in server, async_level = steps): on this machine the trainer shares the two cores with inference,
  so the whole loop is compute-bound either way; this case shows the scheduling alone, as on a cluster
  where inference has its own devices.
- `eval`: reverse-text without and with an `[[orchestrator.eval]]` every 2 steps; the step time against
  the eval's share of all requests.
Medians over the steps after `--warmup`; step = wall time between the ends of two orchestrator steps.
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
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from prime_rl.utils.metrics import read_metrics  # noqa: E402
from prime_rl.utils.tiny_model import create_tiny_model  # noqa: E402

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


SHAPES = {  # case: (batch_size, rollouts_per_example, max_tokens)
    "long-tail": (32, 4, 12),  # 8 groups a step, one of them 10 turns long; training stays light
    "long-tail-generation": (32, 4, 12),
    "eval": (64, 8, 32),
}


def run_case(model: Path, out: Path, steps: int, port: int, case: str, extra: str) -> list[dict]:
    # TOML tables cannot be reopened: fold the extra [orchestrator] keys into the base's table.
    batch_size, rollouts, max_tokens = SHAPES[case]
    base = BASE.format(out=out, steps=steps, model=model, port=port, max_tokens=max_tokens, batch_size=batch_size,
                       rollouts=rollouts)  # fmt: skip
    if extra.startswith("[orchestrator]\n"):
        keys, _, extra = extra.removeprefix("[orchestrator]\n").partition("[[")
        base, extra = base.replace("[orchestrator]\n", "[orchestrator]\n" + keys), "[[" + extra
    cfg = out.with_suffix(".toml")
    cfg.write_text(base + extra)
    env = os.environ | {"PYTHONPATH": f"{ROOT / 'benchmarks'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                        "OMP_NUM_THREADS": "1"}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "prime_rl.entrypoints.rl", "@", str(cfg)], cwd=ROOT,
                          capture_output=True, text=True, env=env)  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"rl failed for {cfg}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return read_metrics(out, "orchestrator")


def generation_only(model: Path, out: Path, steps: int, continuous: bool) -> list[dict]:
    import asyncio

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from orchestrator import start_server  # benchmarks/orchestrator.py

    from prime_rl.configs.orchestrator import OrchestratorConfig
    from prime_rl.orchestrator.orchestrator import orchestrate
    from prime_rl.utils.net import free_port

    batch_size, rollouts, max_tokens = SHAPES["long-tail"]
    out.mkdir(parents=True)
    port = free_port()
    proc = start_server("real", model, port, max_tokens, out / "server.log")
    try:
        config = OrchestratorConfig(
            model={"name": str(model)}, output_dir=out, max_steps=steps, async_level=steps, batch_size=batch_size,
            rollouts_per_example=rollouts, seq_len=512, progress=False, env={"id": "long_tail:load_environment"},
            sampling={"max_tokens": max_tokens, "seed": 7}, client={"base_url": [f"http://127.0.0.1:{port}/v1"]},
            max_inflight=2 * batch_size if continuous else None, max_off_policy_steps=steps,
        )  # fmt: skip
        asyncio.run(orchestrate(config))
    finally:
        proc.terminate()
        proc.wait()
    return read_metrics(out, "orchestrator")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="long-tail,long-tail-generation,eval")
    parser.add_argument("--steps", type=int, default=10, help="measured steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--port", type=int, default=8793)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-orch-") as tmp:
        work = Path(tmp)
        model = create_tiny_model(work / "model", hidden_size=128, num_layers=4, tokenizer_vocab_size=259)
        for case in args.cases.split(","):
            print(f"\n### {case}\n")
            print("| mode | step (median) | generate | off-policy gap: rollouts | stale groups | eval share |")
            print("|---|---|---|---|---|---|")
            for mode, extra in CASES[case].items():
                out = work / f"{case}-{mode.replace(' ', '-')}"
                start = time.perf_counter()
                steps = args.steps + args.warmup + 1
                if case == "long-tail-generation":
                    orch = generation_only(model, out, steps, mode == "continuous")
                else:
                    orch = run_case(model, out, steps, args.port, case, extra)
                measured = orch[args.warmup + 1 :]
                walls = [b["time"] - a["time"] for a, b in itertools.pairwise(orch[args.warmup :])]
                gaps = Counter()
                for m in measured:
                    gaps.update({int(k.split("/")[1]): v for k, v in m.items() if k.startswith("off_policy_gap/")})
                gap_text = ", ".join(f"{g}: {n}" for g, n in sorted(gaps.items()))
                evals = read_metrics(out, "eval")
                train_requests = SHAPES[case][0] * len(orch)
                eval_requests = sum(e["samples"] for e in evals)
                share = f"{eval_requests / (eval_requests + train_requests):.1%}" if evals else "-"
                generate = statistics.median(m["time/generate"] for m in measured)
                print(f"| {mode} | {statistics.median(walls):.2f} s | {generate:.2f} s | {gap_text} | "
                      f"{sum(m.get('stale_groups', 0) for m in measured)} | {share} |", flush=True)  # fmt: skip
                print(f"    ({mode}: run {time.perf_counter() - start:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
