"""One weight update at a real model size: how long until the server answers with the new step, and how much
memory the server takes on the way.

    uv run python benchmarks/weight_update.py                                  # qwen3-0.6b, vLLM (CPU build)
    uv run python benchmarks/weight_update.py --preset qwen3-micro --backend builtin --repeats 3
    uv run python benchmarks/weight_update.py --python OTHER/.venv/bin/python --stagings -   # another checkout's server

Builds the preset's model offline (`tiny-model --preset`: random bf16 weights of the real shapes), starts one
real `inference` server per weight staging (`--weight-staging device` and `stream`; vLLM only, the built-in
engine swaps whole), and times, `--repeats` times each: a filesystem update (POST /update_weights of a
`weights/step_n` dir written beforehand) and a broadcast update (this process plays trainer rank 0 over gloo,
as the trainer does on CPU, sending the same tensors). "seconds" is the request until the server answered
(serving the step); "peak +RSS" the server's process tree's resident memory above its idle level while it
took the update, sampled every 20 ms. Medians over the repeats. `--python` runs the servers with another
environment's interpreter (an older checkout's, to compare; `--stagings -` passes no staging flag).

    uv run python benchmarks/weight_update.py --checksum [--dtype bfloat16] [--layers 28]   # seconds, no server

`--checksum`: what the weight checksum (protocol.parity, the parity gate's) costs on a Qwen3-0.6B-shaped set of
tensors on this machine's CPU: parameters, seconds (best of `--repeats`) and GB/s (the figure in
docs/design.md §4).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import torch
from common import add_json_argument, write_json

from prime_rl.launch.supervise import Service, ServiceFailed, stop_all, wait_for_inference
from prime_rl.protocol import mark_stable, weights_dir
from prime_rl.protocol.broadcast import Rendezvous, connect_store, join_group, ready_key
from prime_rl.protocol.parity import checksum_of
from prime_rl.protocol.weight_stream import send_step
from prime_rl.utils.hf_layout import iter_safetensors
from prime_rl.utils.net import free_port
from prime_rl.utils.tiny_model import create_tiny_model


def qwen3_06b(layers: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Qwen3-0.6B's tensor shapes (hidden 1024, MLP 3072, 16 query / 8 key-value heads of 128, vocab 151,936)."""
    h, mlp, q, kv, vocab = 1024, 3072, 2048, 1024, 151936
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (q, h), f"{p}.self_attn.k_proj.weight": (kv, h),
            f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, q),
            f"{p}.self_attn.q_norm.weight": (128,), f"{p}.self_attn.k_norm.weight": (128,),
            f"{p}.mlp.gate_proj.weight": (mlp, h), f"{p}.mlp.up_proj.weight": (mlp, h),
            f"{p}.mlp.down_proj.weight": (h, mlp), f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
        }  # fmt: skip
    return {name: torch.randn(shape).to(dtype) for name, shape in shapes.items()}


def checksum_cost(args: argparse.Namespace) -> dict:
    tensors = qwen3_06b(args.layers, getattr(torch, args.dtype))
    params = sum(t.numel() for t in tensors.values())
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        checksum = checksum_of(tensors.items())
        times.append(time.perf_counter() - start)
    best = min(times)
    print(
        f"{params:,} parameters ({nbytes / 1e9:.2f} GB {args.dtype}), {torch.get_num_threads()} threads: "
        f"checksum {checksum.hex} in {best:.2f} s (best of {args.repeats}), {nbytes / best / 1e9:.2f} GB/s"
    )
    return {"params": params, "bytes": nbytes, "threads": torch.get_num_threads(), "seconds": best}


class Server:
    """One real `inference` process, started, awaited and stopped as `rl` does (launch.supervise)."""

    def __init__(self, python: str, model: Path, out: Path, backend: str, staging: str | None):
        port = free_port()
        cmd = [python, "-m", "prime_rl.entrypoints.inference", "--model.name", str(model),
               "--backend", backend, "--server.port", str(port), "--output-dir", str(out), "--no-log.file",
               "--weight-transfer", "broadcast", "--max-model-len", "512"]  # fmt: skip
        if backend == "vllm":
            cmd += ["--enforce-eager", *(["--weight-staging", staging] if staging else [])]
        self.service = Service("inference", cmd, out / "server.out", {})
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float = 900) -> None:
        try:
            wait_for_inference([self.service], f"{self.url}/health", timeout)
        except (ServiceFailed, TimeoutError) as e:
            sys.exit(str(e))

    def rss(self) -> int:
        procs = [psutil.Process(self.service.proc.pid)]
        procs += procs[0].children(recursive=True)
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def measured(self, update) -> tuple[float, int]:
        """(seconds until `update()` returned, peak RSS above the level before it)."""
        base, peak, done = self.rss(), [0], threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], self.rss())
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        start = time.perf_counter()
        update()
        seconds = time.perf_counter() - start
        done.set()
        sampler.join()
        return seconds, max(0, peak[0] - base)

    def post(self, body: dict | None, route: str = "/update_weights") -> None:
        response = httpx.post(f"{self.url}{route}", json=body, timeout=900)
        if response.status_code != 200:
            sys.exit(f"{route}: HTTP {response.status_code}: {response.text[:500]}")

    def stop(self) -> None:
        stop_all([self.service], timeout=30)


def broadcast(server: Server, tensors: dict, step: int) -> None:
    """Trainer rank 0 of a fresh gloo group of two: the server's request, then the step's tensors."""
    rdv = Rendezvous("127.0.0.1", free_port(), f"bench-{step}", 2, "gloo", 600.0)
    store = connect_store(rdv, master=True)
    body = {"broadcast": {"host": rdv.host, "port": rdv.port, "group": rdv.group, "world_size": 2, "rank": 1,
                          "step": step, "timeout": rdv.timeout}}  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(server.post, body)
        while store.add(ready_key(rdv, step), 0) < 1:
            if answer.done():
                answer.result()
            time.sleep(0.005)
        pg = join_group(store, rdv, 0)
        specs = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
        send_step(pg, step, specs, tensors.values(), torch.device("cpu"))
        answer.result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--backend", default="vllm", choices=["vllm", "builtin"])
    parser.add_argument("--stagings", default="device,stream", help="vLLM --weight-staging values to run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs the servers")
    parser.add_argument("--checksum", action="store_true", help="only the weight checksum's cost (no server)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="--checksum's")
    parser.add_argument("--layers", type=int, default=28, help="--checksum's Qwen3-0.6B layers")
    add_json_argument(parser, "weight_update")
    args = parser.parse_args()
    if args.checksum:
        write_json(args, "weight_update", {"checksum": checksum_cost(args)})
        return
    stagings = [None if s == "-" else s for s in args.stagings.split(",")] if args.backend == "vllm" else [None]

    with tempfile.TemporaryDirectory(prefix="bench-update-") as tmp:
        work = Path(tmp)
        model = create_tiny_model(work / args.preset, preset=args.preset)
        step_dirs = []
        for step in (1, 2):  # the model's own tensors, as two steps
            d = weights_dir(work / "out", step)
            d.mkdir(parents=True)
            for f in model.iterdir():
                if f.is_file():
                    (d / f.name).write_bytes(f.read_bytes())
            mark_stable(d)
            step_dirs.append(d)
        tensors = dict(iter_safetensors(model))
        gib = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**30
        print(f"{args.preset}: {len(tensors)} tensors, {gib:.2f} GiB as sent", file=sys.stderr)
        rows = []
        for staging in stagings:
            server = Server(args.python, model, work / f"serve-{staging}", args.backend, staging)
            try:
                server.wait_ready()
                times: dict[str, list] = {"filesystem": [], "broadcast": []}
                for i in range(args.repeats):
                    body = {"weight_dir": str(step_dirs[i % 2])}
                    times["filesystem"].append(server.measured(lambda b=body, s=server: s.post(b)))
                    times["broadcast"].append(server.measured(lambda n=i + 10, s=server: broadcast(s, tensors, n)))
                for transfer, measured in times.items():
                    seconds = statistics.median(s for s, _ in measured)
                    rss = statistics.median(r for _, r in measured) / 2**30
                    rows.append((staging or "-", transfer, seconds, rss))
                    print(f"{staging} {transfer}: {[round(s, 2) for s, _ in measured]} s", file=sys.stderr)
            finally:
                server.stop()
                phases = [line for line in server.service.log_path.read_text().splitlines() if "weights step" in line]
                print("\n".join(phases), file=sys.stderr)  # the server's own account of each update

    print(f"| model | backend | staging | transfer | seconds (median of {args.repeats}) | peak +RSS |")
    print("|---|---|---|---|---|---|")
    for staging, transfer, seconds, rss in rows:
        print(f"| {args.preset} | {args.backend} | {staging} | {transfer} | {seconds:.2f} s | {rss:.2f} GiB |")
    keys = ("staging", "transfer", "seconds", "peak_rss_gib")
    write_json(args, "weight_update", {"rows": [dict(zip(keys, r, strict=True)) for r in rows]})


if __name__ == "__main__":
    main()
