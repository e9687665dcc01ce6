"""Adaptive vs fixed per-server concurrency: a burst of requests against one built-in server with a small batch.

    uv run python benchmarks/concurrency.py          # ~1-2 min on 2 CPU cores

One real inference server (built-in engine, assets/tiny-qwen3, `--engine.max-batch-size` = `--capacity`) gets
bursts of `--requests` completions (n = 1, up to `--tokens` tokens; the random model stops some sooner) from
the orchestrator's own client (`InferenceClient.complete`), alternately with `client.concurrency = "fixed"`
(`max_concurrency` = `--ceiling`) and `"adaptive"` (`min_concurrency` = `--floor`, the same ceiling),
one client per mode for all its bursts (as the orchestrator keeps one for its run; the adaptive limit carries
over from burst to burst). Each client's first burst is traced every `--every` seconds: the client's in-flight
limit, its requests in flight, those held back in the client, beside the server's own load (its /metrics:
running rows, waiting requests, tokens per second). Then `--repeats` bursts per mode, alternating: makespan,
generated tokens per second, and how long a request spent at the server (from sending it to its answer: the
span the client's timeout runs over). Medians over those bursts.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from common import add_json_argument, start_server, write_json

from prime_rl.launch.supervise import stop_all

ROOT = Path(__file__).resolve().parents[1]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=8, help="the server's engine.max_batch_size")
    parser.add_argument("--requests", type=int, default=48, help="requests per burst")
    parser.add_argument("--tokens", type=int, default=600, help="most tokens per request")
    parser.add_argument("--floor", type=int, default=2, help="client.min_concurrency (adaptive)")
    parser.add_argument("--ceiling", type=int, default=32, help="client.max_concurrency (both modes)")
    parser.add_argument("--repeats", type=int, default=3, help="bursts per mode")
    parser.add_argument("--every", type=float, default=0.5, help="seconds between trace rows")
    parser.add_argument("--model", type=Path, default=ROOT / "assets" / "tiny-qwen3")
    add_json_argument(parser, "concurrency")
    args = parser.parse_args()
    import logging

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


if __name__ == "__main__":
    main()
