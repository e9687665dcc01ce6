"""What the benchmarks share: medians, Markdown tables, subcommands, starting a server, running `rl`, building a
preset model, writing the JSON record.

A script imports it as `from common import ...`: Python puts a script's own folder (benchmarks/) first on
sys.path. Everything `prime_rl` comes from the project's environment (`uv run`), never from a path added here,
so a benchmark measures the code the venv has installed (`orchestration.py --before` alone runs another tree,
in its own subprocess).

A script answers one question per subcommand (`question_parser`, `add_question`): its docstring holds each one's
section, which that subcommand's --help shows.

Every benchmark writes one JSON record (`--json PATH`, default benchmarks/results/<name>.json, git-ignored):
{"benchmark", "date" (UTC), "argv", "args", ...the script's own results}; the script prints its table as well.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that were measured (None: not measured), None when none were."""
    measured = [v for v in values if v is not None]
    return statistics.median(measured) if measured else None


def median_of(rows: list[dict], key: str) -> float | None:
    return median(r.get(key) for r in rows)


def mean_ends(values: list[float]) -> tuple[float, float]:
    """Means of the first and last 10 % (at least one value each): a learning curve's start and end."""
    k = max(1, len(values) // 10)
    return sum(values[:k]) / k, sum(values[-k:]) / k


def markdown_table(header: list[str], rows: Iterable[Iterable[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def question_parser(doc: str) -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """A script's parser (its whole docstring as --help) and its subcommands, one per question (required)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser, parser.add_subparsers(dest="question", required=True)


def add_question(sub: argparse._SubParsersAction, doc: str, name: str, help: str) -> argparse.ArgumentParser:
    """One subcommand; its --help shows the docstring's command lines that run it and its section: from the line
    that starts with "`name`:" to the next line that starts with another "`subcommand`:"."""
    lines = doc.splitlines()
    commands = [line for line in lines if re.search(rf"benchmarks/\S+\.py {re.escape(name)}(\s|$)", line)]
    start = next(i for i, line in enumerate(lines) if line.startswith(f"`{name}`:"))
    heads = [i for i, line in enumerate(lines) if re.match(r"`[a-z][\w-]*`: ", line)]
    end = next((i for i in heads if i > start), len(lines))
    description = "\n".join(commands) + "\n\n" + "\n".join(lines[start:end]).strip()
    return sub.add_parser(
        name, help=help, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_json_argument(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument(
        "--json",
        type=Path,
        default=RESULTS / f"{name}.json",
        help=f"the JSON record (default {RESULTS.name}/{name}.json)",
    )


def write_json(args: argparse.Namespace, name: str, results: dict) -> Path:
    """Write the run's record to `args.json` (see the module docstring) and say where on stderr."""
    record = {
        "benchmark": name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        **results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1, default=str))
    print(f"results: {args.json}", file=sys.stderr)
    return args.json


def print_line(record: dict) -> None:
    """One JSON line on stdout in one write (< 4 KiB, atomic on a pipe): the lines of ranks that share the pipe
    never interleave."""
    os.write(1, (json.dumps(record) + "\n").encode())


def preset_model(model_dir: Path, preset: str, layers: int | None) -> Path:
    """`tiny-model --preset` (random weights of a real model's shape, cut to `layers`) built into `model_dir`,
    unless it holds a model already."""
    if not (model_dir / "config.json").is_file():
        build = [sys.executable, "-m", "prime_rl.utils.tiny_model", str(model_dir), "--preset", preset]
        done = subprocess.run(build + (["--num-layers", str(layers)] if layers else []), capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"tiny-model --preset {preset} failed:\n{done.stderr[-3000:]}")
    return model_dir


def start_server(model: Path, port: int, out: Path, extra: list[str] = (), timeout: float = 180):
    """One built-in inference server on `port`, started and awaited as `rl` does (launch.supervise); its log is
    out/server.log. Stop it with `launch.supervise.stop_all([server])`."""
    from prime_rl.launch.supervise import Service, wait_for_inference

    cmd = [sys.executable, "-m", "prime_rl.entrypoints.inference", "--model.name", str(model),
           "--server.port", str(port), "--output-dir", str(out), "--no-log.file", *extra]  # fmt: skip
    server = Service("inference", cmd, out / "server.log", {})
    wait_for_inference([server], f"http://127.0.0.1:{port}/health", timeout)
    return server


def rl_config_toml(
    model: Path,
    output_dir: Path,
    *,
    steps: int,
    async_level: int,
    transfer: str,
    port: int,
    backend: str,
    batch_size: int,
    rollouts: int,
    max_tokens: int,
    lr: float,
    share_prompts: bool = False,
    extra: str = "",
) -> str:
    """An `rl` config of reverse-text steps at a model's size (vLLM eager: no compile in the timings); `extra`
    is appended (more TOML tables). `share_prompts`: rows count a group's shared prompt once (the CPU trainer's
    default computes it once either way)."""
    return f"""
output_dir = "{output_dir}"
max_steps = {steps}
async_level = {async_level}
weight_transfer = "{transfer}"

[model]
name = "{model}"

[inference]
backend = "{backend}"
enforce_eager = true
server.port = {port}
max_model_len = 256

[orchestrator]
batch_size = {batch_size}
rollouts_per_example = {rollouts}
seq_len = 256
sampling.max_tokens = {max_tokens}
sampling.temperature = 1.0
env.id = "reverse-text"
share_prompts = {str(share_prompts).lower()}

[trainer]
optim.lr = {lr}
{extra}"""


def run_rl(config: Path, env: dict[str, str] | None = None, timeout: float | None = None) -> float:
    """Run `rl @ config` from the repo root as a user would; exit with its last output if it fails. Seconds."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "prime_rl.entrypoints.rl", "@", str(config)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"rl failed for {config}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return time.perf_counter() - start
