"""Trainer start-up: what each rank holds in host memory, and how long it takes, to load a real-size model, whole
on every rank then sharded (`model.build_model` + FSDP2) against each rank reading only its shards
(`loading.build_sharded`), at 1, 2 and 4 ranks.

    uv run python benchmarks/loading.py                          # Qwen3-0.6B's shape: ~5 min on a 2-core CPU
    uv run python benchmarks/loading.py --ranks 2 --layers 4     # quicker

The model is `tiny-model --preset` (random bf16 weights of the real shape, built once into --model-dir).
Each (mode, ranks) runs `torchrun --standalone` on the CPU (gloo); every rank reports its resident memory
after the imports (the floor), its peak (`ru_maxrss`) after the model is loaded and parallelized, and the
seconds between the two. The load's own cost is peak - floor. Modes alternate per rank count.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from common import add_json_argument, markdown_table, median, write_json

MODES = ("whole", "sharded")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-0.6b", help="tiny-model preset (a real model's shape)")
    p.add_argument("--layers", type=int, help="cut the preset to this many layers (default: all)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--model-dir", type=Path, help="where the model is built (default: a temporary dir)")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    add_json_argument(p, "loading")
    return p.parse_args(argv)


def gib(kib: float) -> float:
    return kib / 2**20


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def worker(mode: str, model: Path) -> None:
    """One rank under torchrun: load `model` as `mode` does and print one JSON line."""
    import time

    from prime_rl.configs import parse_config
    from prime_rl.configs.trainer import TrainerConfig
    from prime_rl.trainer.loading import build_sharded
    from prime_rl.trainer.model import build_model
    from prime_rl.trainer.parallel import close_distributed, init_distributed, parallelize

    config = parse_config(TrainerConfig, ["--model.name", str(model), "--output-dir", tempfile.mkdtemp()], prog="b")
    world = init_distributed("cpu")
    floor = rss_kib()
    start = time.perf_counter()
    if mode == "sharded":
        built = build_sharded(config, world)
        assert built is not None, "this checkpoint cannot be loaded sharded"
    else:
        built = build_model(str(model))
        parallelize(built, world, config)
    seconds = time.perf_counter() - start
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in built.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    line = json.dumps({"rank": world.rank, "floor_gib": gib(floor), "peak_gib": gib(peak), "seconds": seconds,
                       "local_params": local})  # fmt: skip
    os.write(1, (line + "\n").encode())  # one write (< 4 KiB, atomic on a pipe): the ranks' lines never interleave
    close_distributed()


def run(mode: str, ranks: int, model: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           __file__, "--worker", mode, "--model-dir", str(model)]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{mode} on {ranks} rank(s) failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args.worker, args.model_dir)
    model = args.model_dir or Path(tempfile.mkdtemp()) / args.preset
    if not (model / "config.json").is_file():
        build = [sys.executable, "-m", "prime_rl.utils.tiny_model", str(model), "--preset", args.preset]
        subprocess.run(build + (["--num-layers", str(args.layers)] if args.layers else []), check=True)
    header = ["mode", "ranks", "peak host GiB (max rank)", "load's own GiB (peak - floor)", "load s (median rank)",
              "rank 0's parameters"]  # fmt: skip
    results, rows = {}, []
    for ranks in args.ranks:
        for mode in MODES:
            per_rank = results[f"{mode}/{ranks}"] = run(mode, ranks, model)
            peak = max(r["peak_gib"] for r in per_rank)
            own = max(r["peak_gib"] - r["floor_gib"] for r in per_rank)
            seconds = median(r["seconds"] for r in per_rank)
            local = per_rank[0]["local_params"]
            rows.append([mode, ranks, f"{peak:.2f}", f"{own:.2f}", f"{seconds:.1f}", f"{local:,}"])
            print(markdown_table(header, rows[-1:]), flush=True)
    print(markdown_table(header, rows))
    write_json(args, "loading", {"model": str(model), "runs": results})


if __name__ == "__main__":
    main()
