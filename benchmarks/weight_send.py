"""One weight broadcast from a sharded trainer at a real model size: 2 trainer ranks (FSDP2 over gloo) each send
their own rows of every tensor in the export dtype (a checkout from before that: both gather each tensor and rank 0
sends it) to one receiving seat, which copies every tensor as it arrives (a server loading it). Times one step
from the first piece to the receivers' acknowledgement (what "to served" holds beside the server's swap), and
counts the bytes of the rows each trainer rank is the source of (gloo's broadcast hands a sender's piece to every
other member, the other trainer rank too; nccl's ring passes it along).

    uv run python benchmarks/weight_send.py                                  # Qwen3-0.6B's shape, 8 layers
    uv run python benchmarks/weight_send.py --src /tmp/before/src --src src  # another checkout beside this one
    uv run python benchmarks/weight_send.py --transfer filesystem            # the file export instead

With `--transfer filesystem` the 2 ranks write `weights/step_n` (each its own file) instead, and the table gives
the export's time and the bytes the ranks moved between them over loopback (gloo's TCP: /proc/net/dev).

Each `--src` (a checkout's `src/`) runs its own code in the same way, alternating, `--repeats` steps each after
one warm-up; medians. The model is `tiny-model --preset` (random weights of the real shape) cut to `--layers`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import add_json_argument, markdown_table, write_json


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--src", action="append", help="a checkout's src/ to run (default: this one's)")
    p.add_argument("--transfer", choices=["broadcast", "filesystem"], default="broadcast")
    p.add_argument("--model-dir", type=Path)
    p.add_argument("--role", choices=["trainer", "exporter", "seat"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    add_json_argument(p, "weight_send")
    return p.parse_args(argv)


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
    import torch

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
    line = {"rank": world.rank, "seconds": times[1:], "sent_bytes": sent}
    os.write(1, (json.dumps(line) + "\n").encode())
    close_distributed()


def exporter(args) -> None:
    """One trainer rank under torchrun writing `weights/step_n`, `repeats` + 1 times; rank 0 counts the bytes
    that crossed loopback during each (the ranks' gathers, both ways)."""
    import torch

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
    line = {"rank": world.rank, "seconds": times[1:], "loopback_bytes": moved[1:]}
    os.write(1, (json.dumps(line) + "\n").encode())
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
    import torch

    from prime_rl.protocol.broadcast import Rendezvous, connect_store, join_group

    stream = stream_api()
    senders = 2 if senders_api() else 1
    rdv = Rendezvous("127.0.0.1", args.port, "bench", senders + 1, "gloo", 600.0)
    pg = join_group(connect_store(rdv, master=False), rdv, senders)
    for _ in range(args.repeats + 1):
        for _, tensor in stream.receive_step(pg, torch.device("cpu"), lambda step, specs: None, 600.0):
            if tensor is not None:
                tensor.clone()


def run(src: str, args) -> dict:
    from prime_rl.utils.net import free_port

    port = free_port()
    env = os.environ | {"PYTHONPATH": str(Path(src).resolve()), "OMP_NUM_THREADS": "1", "LOGLEVEL": "WARNING"}
    common = ["--model-dir", str(args.model_dir), "--port", str(port), "--repeats", str(args.repeats)]
    role = "trainer" if args.transfer == "broadcast" else "exporter"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           "--role", role, *common]  # fmt: skip
    trainers = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    receiver = None
    if args.transfer == "broadcast":
        receiver = subprocess.Popen([sys.executable, __file__, "--role", "seat", *common], env=env,
                                    stderr=subprocess.PIPE, text=True)  # fmt: skip
    out, err = trainers.communicate(timeout=1800)
    seat_rc = receiver.wait(timeout=60) if receiver else 0
    if trainers.returncode != 0 or seat_rc != 0:
        raise SystemExit(f"{src}: trainer rc {trainers.returncode}, seat rc {seat_rc}\n{err[-3000:]}")
    return {r["rank"]: r for r in map(json.loads, filter(None, out.splitlines()))}


def main() -> None:
    args = parse_args()
    if args.role:
        return {"trainer": trainer, "exporter": exporter, "seat": seat}[args.role](args)
    sources = args.src or [str(Path(__file__).resolve().parents[1] / "src")]
    args.model_dir = args.model_dir or Path(tempfile.mkdtemp()) / args.preset
    if not (args.model_dir / "config.json").is_file():
        build = [sys.executable, "-m", "prime_rl.utils.tiny_model", str(args.model_dir), "--preset", args.preset]
        subprocess.run([*build, "--num-layers", str(args.layers)], check=True, capture_output=True)
    results: dict[str, list[dict]] = {src: [] for src in sources}
    for _ in range(2):  # alternate: each source runs twice, interleaved
        for src in sources:
            results[src].append(run(src, args))
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


if __name__ == "__main__":
    main()
