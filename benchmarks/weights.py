"""Weights on the move at a real model size: one update of a server (and what the weight checksum costs), and one
step sent by a 2-rank sharded trainer (or written as files).

    uv run python benchmarks/weights.py update                                  # qwen3-0.6b, vLLM (CPU build)
    uv run python benchmarks/weights.py update --preset qwen3-micro --backend builtin --repeats 3
    uv run python benchmarks/weights.py update --python OTHER/.venv/bin/python --stagings -  # another checkout's server
    uv run python benchmarks/weights.py update --checksum [--dtype bfloat16] [--layers 28]   # seconds, no server
    uv run python benchmarks/weights.py send                                    # Qwen3-0.6B's shape, 8 layers
    uv run python benchmarks/weights.py send --src /tmp/before/src --src src    # another checkout beside this one
    uv run python benchmarks/weights.py send --transfer filesystem              # the file export instead

`update`: one weight update at a real model size, how long until the server answers with the new step and how much
memory the server takes on the way.
Builds the preset's model offline (`tiny-model --preset`: random bf16 weights of the real shapes), starts one
real `inference` server per weight staging (`--weight-staging device` and `stream`; vLLM only, the built-in
engine swaps whole), and times, `--repeats` times each: a filesystem update (POST /update_weights of a
`weights/step_n` dir written beforehand) and a broadcast update (this process plays trainer rank 0 over gloo,
as the trainer does on CPU, sending the same tensors). "seconds" is the request until the server answered
(serving the step); "peak +RSS" the server's process tree's resident memory above its idle level while it
took the update, sampled every 20 ms. Medians over the repeats. `--python` runs the servers with another
environment's interpreter (an older checkout's, to compare; `--stagings -` passes no staging flag).

`--checksum`: what the weight checksum (protocol.parity, the parity gate's) costs on a Qwen3-0.6B-shaped set of
tensors on this machine's CPU: parameters, seconds (best of `--repeats`) and GB/s (the figure in
docs/design.md §4).

`send`: one weight broadcast from a sharded trainer at a real model size: 2 trainer ranks (FSDP2 over gloo) each
send their own rows of every tensor in the export dtype (a checkout from before that: both gather each tensor and
rank 0 sends it) to one receiving seat, which copies every tensor as it arrives (a server loading it). Times one
step from the first piece to the receivers' acknowledgement (what "to served" holds beside the server's swap), and
counts the bytes of the rows each trainer rank is the source of (gloo's broadcast hands a sender's piece to every
other member, the other trainer rank too; nccl's ring passes it along).
With `--transfer filesystem` the 2 ranks write `weights/step_n` (each its own file) instead, and the table gives
the export's time and the bytes the ranks moved between them over loopback (gloo's TCP: /proc/net/dev).

Each `--src` (a checkout's `src/`) runs its own code in the same way, alternating, `--repeats` steps each after
one warm-up; medians. The model is `tiny-model --preset` (random weights of the real shape) cut to `--layers`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import torch
from common import (
    ROOT,
    add_json_argument,
    add_question,
    markdown_table,
    preset_model,
    print_line,
    question_parser,
    write_json,
)

# Only lazy imports of prime_rl here: `send --src DIR` runs another checkout's src/, whose modules may differ.


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
    from prime_rl.protocol.parity import checksum_of

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
        from prime_rl.launch.supervise import Service
        from prime_rl.utils.net import free_port

        port = free_port()
        cmd = [python, "-m", "prime_rl.entrypoints.inference", "--model.name", str(model),
               "--backend", backend, "--server.port", str(port), "--output-dir", str(out), "--no-log.file",
               "--weight-transfer", "broadcast", "--max-model-len", "512"]  # fmt: skip
        if backend == "vllm":
            cmd += ["--enforce-eager", *(["--weight-staging", staging] if staging else [])]
        self.service = Service("inference", cmd, out / "server.out", {})
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float = 900) -> None:
        from prime_rl.launch.supervise import ServiceFailed, wait_for_inference

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
        from prime_rl.launch.supervise import stop_all

        stop_all([self.service], timeout=30)


def broadcast(server: Server, tensors: dict, step: int) -> None:
    """Trainer rank 0 of a fresh gloo group of two: the server's request, then the step's tensors."""
    from prime_rl.protocol.broadcast import Rendezvous, connect_store, join_group, ready_key
    from prime_rl.protocol.weight_stream import send_step
    from prime_rl.utils.net import free_port

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


def main_update(args: argparse.Namespace) -> None:
    if args.checksum:
        write_json(args, "weight_update", {"checksum": checksum_cost(args)})
        return
    from prime_rl.protocol import mark_stable, weights_dir
    from prime_rl.utils.hf_layout import iter_safetensors
    from prime_rl.utils.tiny_model import create_tiny_model

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


# ---- send -------------------------------------------------------------------------------------------------


def stream_api():
    try:  # where the bytes of a step live since the weight stream got its own module
        from prime_rl.protocol import weight_stream as stream
    except ImportError:
        from prime_rl.protocol import broadcast as stream
    return stream


def senders_api():
    """The per-rank sender (each trainer rank sends its own rows), where the checkout has it; else None (rank 0
    sends what all ranks gather)."""
    try:
        from prime_rl.trainer.broadcast import SendPlan
    except ImportError:
        return None
    return SendPlan


def trainer(args) -> None:
    """One trainer rank under torchrun: the sharded model, then `repeats` + 1 sends."""
    from prime_rl.configs.trainer import TrainerConfig
    from prime_rl.protocol.broadcast import Rendezvous, connect_store, join_group
    from prime_rl.trainer.loading import build_training
    from prime_rl.trainer.parallel import close_distributed, init_distributed
    from prime_rl.trainer.weights import checkpoint_parts, export_specs, gathered

    stream, plan_of = stream_api(), senders_api()
    world = init_distributed("cpu")
    config = TrainerConfig(model={"name": str(args.model_dir)}, output_dir=tempfile.mkdtemp())
    model = build_training(config, world, 1)[0]
    dtype = torch.bfloat16
    senders = world.world_size if plan_of else 1
    rdv = Rendezvous("127.0.0.1", args.port, "bench", senders + 1, "gloo", 600.0)
    store = connect_store(rdv, master=world.is_main)
    pg = join_group(store, rdv, world.rank) if world.rank < senders else None
    plan = plan_of.of(model, dtype, world) if plan_of else None
    parts = checkpoint_parts(model, export_specs(model, dtype)[1])
    times = []
    for step in range(args.repeats + 1):
        torch.distributed.barrier()
        start = time.perf_counter()
        if plan is not None:
            from prime_rl.protocol.parity import RowSums

            sums = RowSums(torch.device("cpu"))
            pieces = plan.pieces(model, world.rank, sums)
            stream.send_step(pg, step, plan.specs, pieces, torch.device("cpu"), 600.0, plan.rows, world.rank)
            sums.checksum(lambda v: (torch.distributed.all_reduce(v), v)[1])
            specs = plan.specs
        else:
            state, exported = export_specs(model, dtype)
            specs = [spec for name in exported for spec in parts[name]]
            tensors = (tensor for _, tensor in gathered(model, state, exported, parts, list(exported)))
            stream.send_step(pg, step, specs, tensors, torch.device("cpu"), 600.0)
        times.append(time.perf_counter() - start)
    if plan is not None:  # the bytes of the rows this rank is the source of
        sent = sum(r[world.rank] * torch.Size(shape[1:]).numel() * d.itemsize
                   for (_, d, shape), r in zip(plan.specs, plan.rows, strict=True))  # fmt: skip
    else:
        sent = sum(torch.Size(shape).numel() * d.itemsize for _, d, shape in specs) if world.is_main else 0
    print_line({"rank": world.rank, "seconds": times[1:], "sent_bytes": sent})
    close_distributed()


def exporter(args) -> None:
    """One trainer rank under torchrun writing `weights/step_n`, `repeats` + 1 times; rank 0 counts the bytes
    that crossed loopback during each (the ranks' gathers, both ways)."""
    from prime_rl.configs.trainer import TrainerConfig
    from prime_rl.trainer.loading import build_training
    from prime_rl.trainer.parallel import close_distributed, init_distributed
    from prime_rl.trainer.weights import build_model_files, save_weights

    world = init_distributed("cpu")
    out = Path(tempfile.mkdtemp()) if world.is_main else None
    box = [str(out)]
    torch.distributed.broadcast_object_list(box)
    config = TrainerConfig(model={"name": str(args.model_dir)}, output_dir=box[0])
    model = build_training(config, world, 1)[0]
    files = build_model_files(str(args.model_dir))
    times, moved = [], []
    for step in range(args.repeats + 1):
        torch.distributed.barrier()
        start, before = time.perf_counter(), loopback_bytes()
        save_weights(model, files, Path(box[0]), step + 1)
        torch.distributed.barrier()
        times.append(time.perf_counter() - start)
        moved.append(loopback_bytes() - before)
    print_line({"rank": world.rank, "seconds": times[1:], "loopback_bytes": moved[1:]})
    close_distributed()


def loopback_bytes() -> int:
    """Bytes received on loopback so far (this machine's, all processes)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        if line.strip().startswith("lo:"):
            return int(line.split(":", 1)[1].split()[0])
    raise SystemExit("no loopback interface in /proc/net/dev")


def seat(args) -> None:
    """The receiving seat: joins the group (after the trainer's senders), copies every tensor of every step as
    it arrives."""
    from prime_rl.protocol.broadcast import Rendezvous, connect_store, join_group

    stream = stream_api()
    senders = 2 if senders_api() else 1
    rdv = Rendezvous("127.0.0.1", args.port, "bench", senders + 1, "gloo", 600.0)
    pg = join_group(connect_store(rdv, master=False), rdv, senders)
    for _ in range(args.repeats + 1):
        for _, tensor in stream.receive_step(pg, torch.device("cpu"), lambda step, specs: None, 600.0):
            if tensor is not None:
                tensor.clone()


def send_run(src: str, args) -> dict:
    from prime_rl.utils.net import free_port

    port = free_port()
    env = os.environ | {"PYTHONPATH": str(Path(src).resolve()), "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING"}
    flags = ["--model-dir", str(args.model_dir), "--port", str(port), "--repeats", str(args.repeats)]
    role = "trainer" if args.transfer == "broadcast" else "exporter"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "send", "--role", role, *flags]  # fmt: skip
    trainers = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    receiver = None
    if args.transfer == "broadcast":
        receiver = subprocess.Popen([sys.executable, __file__, "send", "--role", "seat", *flags], env=env,
                                    stderr=subprocess.PIPE, text=True)  # fmt: skip
    out, err = trainers.communicate(timeout=1800)
    seat_rc = receiver.wait(timeout=60) if receiver else 0
    if trainers.returncode != 0 or seat_rc != 0:
        raise SystemExit(f"{src}: trainer rc {trainers.returncode}, seat rc {seat_rc}\n{err[-3000:]}")
    return {r["rank"]: r for r in map(json.loads, filter(None, out.splitlines()))}


def main_send(args: argparse.Namespace) -> None:
    if args.role:
        return {"trainer": trainer, "exporter": exporter, "seat": seat}[args.role](args)
    sources = args.src or [str(ROOT / "src")]
    args.model_dir = preset_model(args.model_dir or Path(tempfile.mkdtemp()) / args.preset, args.preset, args.layers)
    results: dict[str, list[dict]] = {src: [] for src in sources}
    for _ in range(2):  # alternate: each source runs twice, interleaved
        for src in sources:
            results[src].append(send_run(src, args))
            print(src, [round(s, 2) for s in results[src][-1][0]["seconds"]], file=sys.stderr)
    rows = []
    for src, runs in results.items():
        seconds = [s for r in runs for s in r[0]["seconds"]]
        if args.transfer == "filesystem":
            moved = [b / 2**30 for r in runs for b in r[0]["loopback_bytes"]]
            rows.append([src, f"{statistics.median(seconds):.2f}", f"{statistics.median(moved):.2f}"])
            continue
        sent = [runs[0][rank]["sent_bytes"] / 2**30 for rank in sorted(runs[0])]
        rows.append([src, f"{statistics.median(seconds):.2f}", " / ".join(f"{g:.2f}" for g in sent)])
    if args.transfer == "filesystem":
        header = ["src", "export, s (median)", "GiB between the ranks over loopback per export (median)"]
    else:
        header = ["src", "step to acknowledged, s (median)", "GiB sent per trainer rank"]
    print(markdown_table(header, rows))
    record = {"preset": args.preset, "layers": args.layers, "transfer": args.transfer, "runs": results}
    write_json(args, "weight_send", record)


def main() -> None:
    parser, sub = question_parser(__doc__)
    u = add_question(sub, __doc__, "update", "one weight update of a real server: seconds, peak memory; the checksum")
    u.add_argument("--preset", default="qwen3-0.6b")
    u.add_argument("--backend", default="vllm", choices=["vllm", "builtin"])
    u.add_argument("--stagings", default="device,stream", help="vLLM --weight-staging values to run")
    u.add_argument("--repeats", type=int, default=3)
    u.add_argument("--python", default=sys.executable, help="the interpreter that runs the servers")
    u.add_argument("--checksum", action="store_true", help="only the weight checksum's cost (no server)")
    u.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="--checksum's")
    u.add_argument("--layers", type=int, default=28, help="--checksum's Qwen3-0.6B layers")
    add_json_argument(u, "weight_update")
    s = add_question(sub, __doc__, "send", "one step from 2 sharded trainer ranks: seconds, bytes per rank")
    s.add_argument("--preset", default="qwen3-0.6b")
    s.add_argument("--layers", type=int, default=8)
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--src", action="append", help="a checkout's src/ to run (default: this one's)")
    s.add_argument("--transfer", choices=["broadcast", "filesystem"], default="broadcast")
    s.add_argument("--model-dir", type=Path)
    s.add_argument("--role", choices=["trainer", "exporter", "seat"], help=argparse.SUPPRESS)
    s.add_argument("--port", type=int, help=argparse.SUPPRESS)
    add_json_argument(s, "weight_send")
    args = parser.parse_args()
    {"update": main_update, "send": main_send}[args.question](args)


if __name__ == "__main__":
    main()
