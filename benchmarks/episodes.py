"""Reverse-text played two ways, each a real `rl` run (built-in engine, 1-rank trainer, CPU), one invocation:

    uv run python benchmarks/episodes.py               # 6 steps each, medians over the steps after the first
    uv run python benchmarks/episodes.py --steps 10 --warmup 2

- `in-process`: the built-in `reverse-text` environment, sampled by the orchestrator itself (one chat request
  per group of `rollouts` samples).
- `verifiers`: the same texts and reward as a verifiers taskset (`prime_rl_reverse`) played by verifiers itself
  (`verifiers-env`: its `null` harness program on the subprocess runtime, one per episode, calling the pool
  endpoint through its training client; orchestrator/episodes.py).

Same model, batch, sampling and seed. Reported per way, over the steps after `--warmup`: the median step, its
generation, tokens per second of the step, and the reward. Needs `uv sync --extra verifiers` and `uv` on PATH.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import add_json_argument, markdown_table, median_of, rl_config_toml, run_rl, write_json

from prime_rl.utils.metrics import read_metrics
from prime_rl.utils.net import free_port

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "assets" / "reverse-qwen3"
WAYS = {
    "in-process": "",
    "verifiers": """
[[orchestrator.env]]
id = "verifiers-env"
name = "reverse-text"
[orchestrator.env.args]
taskset = { id = "prime_rl_reverse", min_chars = 5, max_chars = 16 }
agent = { harness = { id = "null" }, runtime = { type = "subprocess" } }
""",
}


def measure(way: str, out: Path, args: argparse.Namespace) -> dict:
    config = rl_config_toml(MODEL, out, steps=args.steps, async_level=1, transfer="filesystem", port=free_port(),
                            backend="builtin", batch_size=args.batch_size, rollouts=args.rollouts, max_tokens=24,
                            lr=5e-4)  # fmt: skip
    if WAYS[way]:  # the env table replaces the config's `env.id = "reverse-text"`
        config = config.replace('env.id = "reverse-text"\n', "") + WAYS[way]
    else:
        config = config.replace('env.id = "reverse-text"\n', 'env.id = "reverse-text"\nenv.args = { min_chars = 5, '
                                'max_chars = 16 }\n')  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.parent / f"{way}.toml"
    path.write_text(config)
    seconds = run_rl(path, timeout=3600)
    rows = [m for m in read_metrics(out, "orchestrator") if m["step"] >= args.warmup]
    return {
        "rl_seconds": seconds,
        "step_s": median_of(rows, "time/step"),
        "generate_s": median_of(rows, "time/generate"),
        "tokens_per_s": median_of(rows, "tokens_per_s"),
        "reward": median_of(rows, "reward_mean"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rollouts", type=int, default=4)
    add_json_argument(parser, "episodes")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for way in WAYS:
            results[way] = measure(way, Path(tmp) / way / "out", args)
    header = ["way", "rl run", "step (median)", "generation", "tokens/s", "reward"]
    print(markdown_table(header, [
        [way, f"{r['rl_seconds']:.0f} s", f"{r['step_s']:.2f} s", f"{r['generate_s']:.2f} s",
         f"{r['tokens_per_s']:.0f}", f"{r['reward']:.3f}"]
        for way, r in results.items()
    ]))  # fmt: skip
    write_json(args, "episodes", results)


if __name__ == "__main__":
    main()
