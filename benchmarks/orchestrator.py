"""Orchestrator overhead: the share of step time not spent waiting for generation, at batch 256.

    uv run python benchmarks/orchestrator.py                 # both servers below, side by side
    uv run python benchmarks/orchestrator.py --server real   # or --server fake

Runs the real orchestrator loop in-process (reverse-text, async_level = steps so no trainer is needed)
against two servers, and reports medians over the steps after the first:
- `real`: the real inference server (built-in engine) with the tiny model on this machine's CPU. This is
  the share a user sees: overhead / step time.
- `fake`: a separate process that answers every chat request at once with canned completions of
  `--tokens` tokens. Generation costs nothing there, so the absolute seconds of everything else
  (HTTP + JSON parsing of the responses, scoring, advantages, packing, writing rank files) stand alone.

Overhead = step time - time waiting for weights - time in generation requests (the `generate` timer,
which includes the client's own parsing of the responses and the environment's scoring, which runs as
each group arrives while the server works on the others; `score_s` is that scoring time, overlapped).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx


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


def start_server(kind: str, model: Path, port: int, tokens: int, log: Path) -> subprocess.Popen:
    if kind == "fake":
        cmd = [sys.executable, __file__, "--serve-fake", str(port), "--tokens", str(tokens)]
    else:
        cmd = [sys.executable, "-m", "prime_rl.entrypoints.inference", "--model.name", str(model),
               "--server.port", str(port), "--output-dir", str(log.parent), "--no-log.file",
               "--engine.max-batch-size", "256"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{kind} server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)


def measure(kind: str, model: Path, args, root: Path) -> dict:
    from prime_rl.configs.orchestrator import OrchestratorConfig
    from prime_rl.orchestrator.orchestrator import orchestrate
    from prime_rl.utils.metrics import read_metrics
    from prime_rl.utils.net import free_port

    port = free_port()
    out = root / kind
    out.mkdir()
    proc = start_server(kind, model, port, args.tokens, out / "server.log")
    try:
        config = OrchestratorConfig(
            model={"name": str(model)}, output_dir=out, max_steps=args.steps, async_level=args.steps,
            batch_size=args.batch_size, rollouts_per_example=8, seq_len=1024, progress=False,
            sampling={"max_tokens": args.tokens}, client={"base_url": [f"http://127.0.0.1:{port}/v1"]},
        )  # fmt: skip
        asyncio.run(orchestrate(config))
    finally:
        proc.terminate()
        proc.wait()
    steps = read_metrics(out, "orchestrator")[1:]  # the first step warms up connections and caches
    med = lambda key: statistics.median(m[key] for m in steps)  # noqa: E731
    overhead = [m["time/step"] - m["time/generate"] - m["time/wait_weights"] for m in steps]
    return {
        "server": kind, "step_s": med("time/step"), "generate_s": med("time/generate"),
        "score_s": med("time/score"), "advantage_s": med("time/advantage"), "pack_s": med("time/pack"),
        "write_s": med("time/write"),
        "overhead_s": statistics.median(overhead),
        "overhead_share": statistics.median(o / m["time/step"] for o, m in zip(overhead, steps, strict=True)),
        "tokens_per_s": med("tokens_per_s"),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=["real", "fake", "both"], default="both")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per rollout")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--model", type=Path, default=None, help="model dir; default: a fresh tiny Qwen3")
    parser.add_argument("--serve-fake", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake is not None:
        return serve_fake(args.serve_fake, args.tokens)
    import logging

    from prime_rl.utils.logging import setup_logging
    from prime_rl.utils.tiny_model import create_tiny_model

    setup_logging("bench", None, "WARNING")
    logging.getLogger("prime_rl").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = args.model or create_tiny_model(root / "tiny", "qwen3")
        kinds = ["real", "fake"] if args.server == "both" else [args.server]
        rows = [measure(kind, model, args, root) for kind in kinds]
    print(f"batch {args.batch_size}, {args.tokens} completion tokens, medians over steps 1..{args.steps - 1}")
    keys = list(rows[0])
    print(" | ".join(f"{k:>14}" for k in keys))
    for r in rows:
        print(" | ".join(f"{r[k]:>14.4f}" if isinstance(r[k], float) else f"{r[k]:>14}" for k in keys))


if __name__ == "__main__":
    main()
