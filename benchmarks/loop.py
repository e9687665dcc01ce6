"""Where a step of the RL loop spends its time: hand-offs between services, the orchestrator's own overhead,
what having verifiers play the episodes costs, and what each service costs to run at all.

    uv run python benchmarks/loop.py handoffs             # ~9 min: both models, sync and async_level 1
    uv run python benchmarks/loop.py handoffs --models tiny --modes sync --transfers filesystem,broadcast
    uv run python benchmarks/loop.py handoffs --models 10m --modes sync --backends builtin,vllm   # vLLM: its CPU build
    uv run python benchmarks/loop.py handoffs --models 10m --cores shared,split --steps 6  # cores of their own
    uv run python benchmarks/loop.py overhead             # ~1 min: orchestrator overhead at batch 256, both servers
    uv run python benchmarks/loop.py overhead --server real   # or --server fake
    uv run python benchmarks/loop.py episodes             # ~1 min: 6 steps each, medians over the steps after the first
    uv run python benchmarks/loop.py episodes --steps 10 --warmup 2
    uv run python benchmarks/loop.py services             # ~1 min: the README's debug run, 3 times
    uv run python benchmarks/loop.py services --src ../before --runs 5   # another tree's rl, taking turns

`handoffs`: each case is one real `rl` run (inference server, orchestrator, 1-rank trainer on this machine's
CPU, fp32) on reverse-text: 8 prompts × 8 samples, ≤ 32 tokens. Per step, from the services' own metrics files:
- generate: the orchestrator's generation requests (and scoring, which overlaps them);
- train: the trainer's forward/backward/optimizer step;
- transfer: filesystem: the trainer writing the weights plus the servers loading them; broadcast: the
  orchestrator's request until the servers answer, the trainer's sending included;
- to served: from the trainer's optimizer step (of step - 1) to the servers answering with its weights,
  everything in between included (wall clocks of one machine);
- work: all of the above plus packing, writing and reading rank files;
- step: wall time between the ends of two orchestrator steps;
- hand-offs: step - work (`prime_rl.utils.plot_data.handoffs`, the plot's hand-off line too). With
  async_level 0 the services alternate, so every instant of a step is one side's work or waiting for the
  other to notice something (bookkeeping outside the timers, such as metrics lines and the orchestrator's
  progress record, counts here too). With async_level 1 they overlap, and a negative figure is the overlap.
- limit: max(generate, train) + transfer, the step of a loop whose generation and training fully overlap.
`--cores split` runs the server on this machine's first core and the trainer on its last (`--inference-cpus`,
`--trainer-cpus`: each on a core of its own, where `shared` lets both use every core in turn).
Medians over the steps after `--warmup`.

`overhead`: the real orchestrator loop in-process (reverse-text, async_level = steps so no trainer is needed)
against two servers, medians over the steps after the first:
- `real`: the real inference server (built-in engine) with the tiny model on this machine's CPU. This is
  the share a user sees: overhead / step time.
- `fake`: a separate process that answers every chat request at once with canned completions of
  `--tokens` tokens. Generation costs nothing there, so the absolute seconds of everything else
  (HTTP + JSON parsing of the responses, scoring, advantages, packing, writing rank files) stand alone.
Overhead = step time - time waiting for weights - time in generation requests (the `generate` timer,
which includes the client's own parsing of the responses and the environment's scoring and advantages, which
run as each group arrives while the server works on the others); pack and write are timed on their own.

`episodes`: reverse-text played two ways, each a real `rl` run (built-in engine, 1-rank trainer, CPU), one
invocation:
- `in-process`: the built-in `reverse-text` environment, sampled by the orchestrator itself (one chat request
  per group of `rollouts` samples).
- `verifiers`: the same texts and reward as a verifiers taskset (`prime_rl_reverse`) played by verifiers itself
  (`verifiers-env`: its `null` harness program on the subprocess runtime, one per episode, calling the pool
  endpoint through its training client; orchestrator/episodes.py).

Same model, batch, sampling and seed. Reported per way, over the steps after `--warmup`: the median step, its
generation, tokens per second of the step, and the reward. Needs `uv sync --extra verifiers` and `uv` on PATH.

`services`: the README's first command (`rl @ configs/debug/rl.toml`, 5 steps of the tiny model) `--runs` times,
each process of the run sampled every 50 ms from /proc: its CPU seconds (user + system, start-up included: on 2
cores a short run's services spend most of theirs importing) and its peak resident memory (VmHWM), medians per
service over the runs. With `--src DIR` another checkout's `rl` (its `src/` on PYTHONPATH, this environment) takes
turns with this one's, run by run, so the two compare on the same machine state.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from common import (
    ROOT,
    add_json_argument,
    add_question,
    markdown_table,
    median,
    median_of,
    question_parser,
    rl_config_toml,
    run_rl,
    start_server,
    write_json,
)

from prime_rl.configs.orchestrator import OrchestratorConfig
from prime_rl.launch.supervise import Service, stop_all, wait_for_inference
from prime_rl.orchestrator.orchestrator import orchestrate
from prime_rl.utils.logging import setup_logging
from prime_rl.utils.metrics import read_metrics
from prime_rl.utils.net import free_port
from prime_rl.utils.plot_data import ORCHESTRATOR_WORK, TRAINER_WORK, handoffs
from prime_rl.utils.tiny_model import create_tiny_model

MODELS = {  # name: (hidden, layers); both with the char-level tokenizer reverse-text wants
    "tiny": (128, 4),  # 0.8 M parameters
    "10m": (384, 6),  # 10 M parameters
}


def config_text(
    model: Path, output_dir: Path, steps: int, async_level: int, transfer: str, port: int, backend: str, cores: str
) -> str:
    mine = sorted(os.sched_getaffinity(0))
    pins = f"inference_cpus = [{mine[0]}]\ntrainer_cpus = [{mine[-1]}]\n" if cores == "split" else ""
    config = rl_config_toml(model, output_dir, steps=steps, async_level=async_level, transfer=transfer, port=port,
                            backend=backend, batch_size=64, rollouts=8, max_tokens=32, lr=1e-4)  # fmt: skip
    return pins + config


def handoff_case(
    model: Path, work: Path, steps: int, async_level: int, transfer: str, port: int, backend: str, cores: str
) -> dict:
    output_dir = work / f"{model.name}-a{async_level}-{transfer}-{backend}-{cores}"
    cfg = work / f"{output_dir.name}.toml"
    cfg.write_text(config_text(model, output_dir, steps, async_level, transfer, port, backend, cores))
    seconds = run_rl(cfg)
    orch_records, trainer_records = read_metrics(output_dir, "orchestrator"), read_metrics(output_dir, "trainer")
    orch, trainer = {r["step"]: r for r in orch_records}, {r["step"]: r for r in trainer_records}
    handoff = dict(handoffs(orch_records, trainer_records))  # the plot's hand-off line: the same numbers
    rows = []
    for step in range(1, steps):
        o, prev, t = orch[step], orch[step - 1], trainer[step - 1]  # step's weights come from trainer step - 1
        generate = o["time/generate"]
        transfer_s = t.get("time/save_weights", 0.0) + o.get("time/update_weights", 0.0)
        busy = sum(o.get(f"time/{k}", 0.0) for k in ORCHESTRATOR_WORK)
        busy += sum(t.get(f"time/{k}", 0.0) for k in TRAINER_WORK)
        wall = o["time"] - prev["time"]
        # The trainer's optimizer step done → the servers answered with those weights (sync mode: at once).
        w = o["weight_step"]  # the step the servers were given before this step's requests
        latency = o["weights_served_at"] - trainer[w - 1]["optimized_at"] if "weights_served_at" in o and w else None
        rows.append({"generate": generate, "train": t["time/train"], "transfer": transfer_s, "work": busy,
                     "step": wall, "handoffs": handoff[step], "to_served": latency,
                     "limit": max(generate, t["time/train"]) + transfer_s})  # fmt: skip
    return {"rows": rows, "seconds": seconds}


def main_handoffs(args: argparse.Namespace) -> None:
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-rl-") as tmp:
        work = Path(tmp)
        for name in args.models.split(","):
            hidden, layers = MODELS[name]
            model = create_tiny_model(work / name, hidden_size=hidden, num_layers=layers, tokenizer_vocab_size=259)
            split = [getattr(args, k).split(",") for k in ("cores", "backends", "modes", "transfers")]
            for cores, backend, mode, transfer in itertools.product(*split):
                level = {"sync": 0, "async": 1}[mode]
                steps = args.steps + args.warmup + 1
                case = handoff_case(model, work, steps, level, transfer, args.port, backend, cores)
                rows = case["rows"][args.warmup :]
                results[f"{name}/{cores}/{backend}/{mode}/{transfer}"] = rows
                print(f"{name:>5} {cores:>6} {backend:>7} {mode:>5} {transfer:>10}: {len(rows)} steps measured, "
                      f"run {case['seconds']:.0f}s", file=sys.stderr)  # fmt: skip

    header = ["model", "cores", "backend", "mode", "transfer", "generate", "train", "transfer", "to served", "step",
              "hand-offs", "share", "step / limit"]  # fmt: skip
    table = []
    for key, rows in results.items():
        step, handoff = median_of(rows, "step"), median_of(rows, "handoffs")
        cells = [f"{median_of(rows, k):.3f} s" for k in ("generate", "train", "transfer", "to_served", "step")]
        limit = median(r["step"] / r["limit"] for r in rows)
        table.append([*key.split("/"), *cells, f"{handoff:.3f} s", f"{handoff / step:.1%}", f"{limit:.2f}"])
    print(markdown_table(header, table))
    write_json(args, "loop-handoffs", {"cases": results})


def serve_fake(port: int, tokens: int) -> None:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def reply(self, data: dict) -> None:
            payload = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("x-weight-step", "0")  # the policy that sampled it, as real servers report it
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self):
            self.reply({"status": "ok", "step": 0})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids = [100 + (i % 500) for i in range(tokens)]
            content = [{"token": f"token_id:{t}", "logprob": -0.5, "bytes": [], "top_logprobs": []} for t in ids]
            choices = [
                {"index": j, "message": {"role": "assistant", "content": "x" * tokens}, "finish_reason": "length",
                 "token_ids": ids, "logprobs": {"content": content}}
                for j in range(body["n"])
            ]  # fmt: skip
            self.reply({"object": "chat.completion", "prompt_token_ids": list(range(40)), "choices": choices})

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def overhead_case(kind: str, model: Path, args, root: Path) -> dict:
    port = free_port()
    out = root / kind
    out.mkdir()
    if kind == "fake":
        cmd = [sys.executable, __file__, "overhead", "--serve-fake", str(port), "--tokens", str(args.tokens)]
        server = Service("fake", cmd, out / "server.log", {})
        wait_for_inference([server], f"http://127.0.0.1:{port}/health", 180)
    else:
        server = start_server(model, port, out, ["--engine.max-batch-size", "256"])
    try:
        config = OrchestratorConfig(
            model={"name": str(model)}, output_dir=out, max_steps=args.steps, async_level=args.steps,
            batch_size=args.batch_size, rollouts_per_example=8, seq_len=1024, progress=False,
            sampling={"max_tokens": args.tokens}, client={"base_url": [f"http://127.0.0.1:{port}/v1"]},
        )  # fmt: skip
        asyncio.run(orchestrate(config))
    finally:
        stop_all([server])
    steps = read_metrics(out, "orchestrator")[1:]  # the first step warms up connections and caches
    # wait_weights is only recorded by a step that waited (never here: async_level = steps)
    overhead = [m["time/step"] - m["time/generate"] - m.get("time/wait_weights", 0.0) for m in steps]
    med = {k: median_of(steps, f"time/{k}") for k in ("step", "generate", "pack", "write")}
    return {
        "server": kind, **{f"{k}_s": v for k, v in med.items()}, "overhead_s": median(overhead),
        "overhead_share": median(o / m["time/step"] for o, m in zip(overhead, steps, strict=True)),
        "tokens_per_s": median_of(steps, "tokens_per_s"),
    }  # fmt: skip


def main_overhead(args: argparse.Namespace) -> None:
    if args.serve_fake is not None:
        return serve_fake(args.serve_fake, args.tokens)
    setup_logging("bench", None, "WARNING")
    logging.getLogger("prime_rl").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = args.model or create_tiny_model(root / "tiny", "qwen3")
        kinds = ["real", "fake"] if args.server == "both" else [args.server]
        rows = [overhead_case(kind, model, args, root) for kind in kinds]
    print(f"batch {args.batch_size}, {args.tokens} completion tokens, medians over steps 1..{args.steps - 1}")
    keys = list(rows[0])
    print(markdown_table(keys, ([f"{r[k]:.4f}" if isinstance(r[k], float) else r[k] for k in keys] for r in rows)))
    write_json(args, "loop-overhead", {"rows": rows})


# ---- episodes ---------------------------------------------------------------------------------------------

EPISODES_MODEL = ROOT / "assets" / "reverse-qwen3"
EPISODE_WAYS = {
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


def episodes_case(way: str, out: Path, args: argparse.Namespace) -> dict:
    config = rl_config_toml(EPISODES_MODEL, out, steps=args.steps, async_level=1, transfer="filesystem",
                            port=free_port(), backend="builtin", batch_size=args.batch_size, rollouts=args.rollouts,
                            max_tokens=24, lr=5e-4)  # fmt: skip
    if EPISODE_WAYS[way]:  # the env table replaces the config's `env.id = "reverse-text"`
        config = config.replace('env.id = "reverse-text"\n', "") + EPISODE_WAYS[way]
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


def main_episodes(args: argparse.Namespace) -> None:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for way in EPISODE_WAYS:
            results[way] = episodes_case(way, Path(tmp) / way / "out", args)
    header = ["way", "rl run", "step (median)", "generation", "tokens/s", "reward"]
    print(markdown_table(header, [
        [way, f"{r['rl_seconds']:.0f} s", f"{r['step_s']:.2f} s", f"{r['generate_s']:.2f} s",
         f"{r['tokens_per_s']:.0f}", f"{r['reward']:.3f}"]
        for way, r in results.items()
    ]))  # fmt: skip
    write_json(args, "episodes", results)


def sample_processes(command: list[str], env: dict[str, str]) -> dict[str, dict]:
    """Run `command`; per service of it (the entrypoint a process runs, or its first word) the largest CPU seconds
    and peak RSS its processes reached while it ran."""
    tick = os.sysconf("SC_CLK_TCK")
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: dict[int, dict] = {}
    while proc.poll() is None:
        family = {proc.pid}
        for pid, ppid in _parents().items():  # descendants: /proc lists children after their parents
            if ppid in family:
                family.add(pid)
        for pid in family:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                status = Path(f"/proc/{pid}/status").read_text()
                argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            except OSError:
                continue
            hwm = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM")), 0)
            name = next((a.rsplit(".", 1)[1] for a in argv if a.startswith("prime_rl.entrypoints.")), None)
            row = seen.setdefault(pid, {"service": name or Path(argv[0]).name, "cpu_s": 0.0, "rss_mib": 0.0})
            row["cpu_s"] = max(row["cpu_s"], (int(stat[11]) + int(stat[12])) / tick)
            row["rss_mib"] = max(row["rss_mib"], hwm / 1024)
        time.sleep(0.05)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(command)} exited {proc.returncode}")
    services: dict[str, dict] = {}
    for row in seen.values():
        if row["cpu_s"] > 0.05:
            total = services.setdefault(row["service"], {"cpu_s": 0.0, "rss_mib": 0.0})
            total["cpu_s"] += row["cpu_s"]
            total["rss_mib"] = max(total["rss_mib"], row["rss_mib"])
    return services


def _parents() -> dict[int, int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
    return parents


def main_services(args: argparse.Namespace) -> None:
    trees = {"this": ROOT} | ({"src": args.src.resolve()} if args.src else {})
    runs: dict[str, list[dict]] = {tree: [] for tree in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for tree, root in trees.items():
                # Bytecode cached, as `uv run` and CI have it: a shell that sets PYTHONDONTWRITEBYTECODE would add
                # every module's compilation to each process (~3-4 CPU-s of the ~16 here).
                env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
                env["PYTHONPATH"] = str(root / "src")
                out = Path(tmp) / f"{tree}-{i}"
                start = time.perf_counter()
                rl = [sys.executable, "-m", "prime_rl.entrypoints.rl", "@", "configs/debug/rl.toml", "--output-dir"]
                services = sample_processes([*rl, str(out), "--inference.server.port", str(free_port())], env)
                runs[tree].append({"wall_s": time.perf_counter() - start, "services": services})
    results, rows = {}, []
    for tree, records in runs.items():
        names = sorted(
            {n for r in records for n in r["services"]},
            key=lambda n: -records[0]["services"].get(n, {}).get("cpu_s", 0),
        )
        results[tree] = {"root": str(trees[tree]), "runs": records, "wall_s": median(r["wall_s"] for r in records)}
        for name in names:
            cpu = median(r["services"].get(name, {}).get("cpu_s") for r in records)
            rss = median(r["services"].get(name, {}).get("rss_mib") for r in records)
            rows.append([tree, name, f"{cpu:.2f} s", f"{rss:.0f} MiB"])
        cpu_all = median(sum(v["cpu_s"] for v in r["services"].values()) for r in records)
        rows.append([tree, "**all**", f"{cpu_all:.2f} s", f"wall {results[tree]['wall_s']:.1f} s"])
    print(markdown_table(["tree", "service", "CPU (median)", "peak RSS (median)"], rows))
    write_json(args, "loop-services", results)


def main() -> None:
    parser, sub = question_parser(__doc__)
    h = add_question(sub, __doc__, "handoffs", "where a step's time goes, real `rl` runs")
    h.add_argument("--models", default="tiny,10m")
    h.add_argument("--modes", default="sync,async", help="sync = async_level 0, async = async_level 1")
    h.add_argument("--transfers", default="filesystem,broadcast")
    h.add_argument("--backends", default="builtin", help="inference backends: builtin, vllm")
    h.add_argument("--cores", default="shared", help="shared: every service on every core; split: server and trainer "
                   "each on a core of its own")  # fmt: skip
    h.add_argument("--steps", type=int, default=10, help="measured steps (after the warm-up)")
    h.add_argument("--warmup", type=int, default=2)
    h.add_argument("--port", type=int, default=8791)
    add_json_argument(h, "loop-handoffs")
    o = add_question(sub, __doc__, "overhead", "the orchestrator's share of a step at batch 256")
    o.add_argument("--server", choices=["real", "fake", "both"], default="both")
    o.add_argument("--batch-size", type=int, default=256)
    o.add_argument("--tokens", type=int, default=64, help="completion tokens per rollout")
    o.add_argument("--steps", type=int, default=4)
    o.add_argument("--model", type=Path, default=None, help="model dir; default: a fresh tiny Qwen3")
    o.add_argument("--serve-fake", type=int, default=None, help=argparse.SUPPRESS)
    add_json_argument(o, "loop-overhead")
    e = add_question(sub, __doc__, "episodes", "reverse-text in-process vs played by verifiers: step, tokens/s")
    e.add_argument("--steps", type=int, default=6)
    e.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    e.add_argument("--batch-size", type=int, default=8)
    e.add_argument("--rollouts", type=int, default=4)
    add_json_argument(e, "episodes")
    v = add_question(sub, __doc__, "services", "CPU seconds and peak memory of each service of the debug run")
    v.add_argument("--runs", type=int, default=3)
    v.add_argument("--src", type=Path, default=None, help="another checkout whose rl takes turns with this one's")
    add_json_argument(v, "loop-services")
    args = parser.parse_args()
    questions = {"handoffs": main_handoffs, "overhead": main_overhead, "episodes": main_episodes}
    questions["services"] = main_services
    questions[args.question](args)


if __name__ == "__main__":
    main()
