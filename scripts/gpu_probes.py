"""Probes of `scripts/gpu_check.sh --quick` that need a CUDA GPU but not vLLM (the GPU machine has none).

    python scripts/gpu_probes.py fork MODEL_DIR      # the inference process, up to where vLLM starts its engine
    python scripts/gpu_probes.py nccl MODEL_DIR      # a one-rank NCCL weight group sends MODEL_DIR's tensors
    python scripts/gpu_probes.py loading MODEL_DIR   # the trainer reads its shards onto the GPU: = a whole load

fork: `inference --backend vllm` runs as users start it, but where vLLM would start (serve_vllm) the probe forks
instead: the child must not find CUDA initialised in its parent (`torch._C._cuda_isInBadFork()`: vLLM's
EngineCore and workers would die with "Cannot re-initialize CUDA in forked subprocess"), and vLLM must be
told to spawn its workers (`VLLM_WORKER_MULTIPROC_METHOD`). Exit 1 with one line per failure.

nccl: the weight broadcast's own group (protocol/broadcast.py) on NCCL with one rank, sending every tensor of
the model at its real size in bf16 through `send_step` (header, buckets, acknowledgement): NCCL initialises,
the collectives complete, and the time per GiB is printed. One GPU cannot hold two NCCL ranks ("Duplicate GPU
detected"), so nothing is received: what NCCL costs between GPUs is not measured here.

loading: the trainer's sharded load (trainer/loading.py: meta, FSDP2 in bf16, each rank's shards read from the
safetensors straight into CUDA memory) on one rank; every tensor and buffer must equal `build_model`'s whole
load on the CPU. Prints the time and the peak GPU memory.
"""

from __future__ import annotations

import os
import sys
import time
import types


def fork_probe(model: str) -> int:
    from prime_rl.configs.cli import load_config
    from prime_rl.configs.inference import InferenceConfig
    from prime_rl.inference import server

    seen: dict = {}

    def serve_vllm(config, host, cuda):  # stands in for the real one, at the moment vLLM would start its engine
        seen["cuda"], seen["method"] = cuda, os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
        read, write = os.pipe()
        if (pid := os.fork()) == 0:
            import torch

            os.write(write, b"1" if torch._C._cuda_isInBadFork() else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
        seen["bad_fork"] = os.read(read, 1) == b"1"

    stand_in = types.ModuleType("prime_rl.inference.vllm.server")
    stand_in.serve_vllm = serve_vllm
    sys.modules[stand_in.__name__] = stand_in
    server.vllm_importable = lambda: True  # no vLLM on the GPU machine: everything before it runs as it is
    server.run(load_config(InferenceConfig, ["--model.name", model, "--backend", "vllm"]))
    print(f"fork probe: cuda seen {seen['cuda']}, child's CUDA poisoned by the fork {seen['bad_fork']}, "
          f"VLLM_WORKER_MULTIPROC_METHOD={seen['method']}")  # fmt: skip
    failures = []
    if not seen["cuda"]:
        failures.append("the inference process did not see the GPU")
    if seen["bad_fork"]:
        failures.append("CUDA was initialised before vLLM starts: a forked EngineCore or worker cannot use it")
    if seen["method"] != "spawn":
        failures.append(f"vLLM would start its workers by {seen['method'] or 'its default (fork)'}, not spawn")
    for line in failures:
        print(f"fork probe FAILED: {line}", file=sys.stderr)
    return 1 if failures else 0


def nccl_probe(model: str) -> int:
    import torch
    from transformers import AutoConfig

    from prime_rl.protocol.broadcast import Rendezvous, connect_store, join_group
    from prime_rl.protocol.weight_stream import send_step
    from prime_rl.utils.net import free_port
    from prime_rl.utils.tiny_model import meta_model

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    specs = [
        (n, torch.bfloat16, tuple(p.shape))
        for n, p in meta_model(AutoConfig.from_pretrained(model)).state_dict().items()
    ]
    tensors = [torch.randn(shape, device=device, dtype=torch.float32) for _, _, shape in specs]  # fp32 masters
    gib = sum(t.numel() for t in tensors) * 2 / 2**30
    rdv = Rendezvous("127.0.0.1", free_port(), "probe", 1, "nccl", 120.0)
    pg = join_group(connect_store(rdv, master=True), rdv, 0)
    times = []
    for step in range(1, 4):
        torch.cuda.synchronize()
        start = time.perf_counter()
        send_step(pg, step, specs, tensors, device, rdv.timeout)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    print(
        f"nccl probe: one rank, {len(specs)} tensors, {gib:.2f} GiB in bf16 a step; send_step "
        f"{', '.join(f'{t:.3f}' for t in times)} s ({gib / min(times):.1f} GiB/s at best; the first sets NCCL up)"
    )
    return 0


def loading_probe(model: str) -> int:
    import tempfile

    import torch

    from prime_rl.configs.trainer import TrainerConfig
    from prime_rl.trainer.loading import build_sharded
    from prime_rl.trainer.model import build_model
    from prime_rl.trainer.parallel import close_distributed, init_distributed

    world = init_distributed("cuda")
    config = TrainerConfig(model={"name": model}, output_dir=tempfile.mkdtemp(), device="cuda", dtype="bfloat16")
    start = time.perf_counter()
    sharded = build_sharded(config, world)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    whole = build_model(model)
    ours = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sharded.state_dict().items()}
    differ = [k for k, v in whole.state_dict().items() if not torch.equal(ours[k].cpu(), v)]
    differ += [k for k, b in whole.named_buffers() if not torch.equal(sharded.get_buffer(k).cpu(), b)]
    devices = {str(p.device) for p in sharded.parameters()}
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"loading probe: {len(ours)} tensors read onto {devices} in {seconds:.2f} s, peak GPU memory "
          f"{peak:.2f} GiB; differing from a whole load: {differ or 'none'}")  # fmt: skip
    close_distributed()
    return 1 if differ or devices != {"cuda:0"} else 0


if __name__ == "__main__":
    probes = {"fork": fork_probe, "nccl": nccl_probe, "loading": loading_probe}
    if len(sys.argv) != 3 or sys.argv[1] not in probes:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(probes)}}} MODEL_DIR")
    sys.exit(probes[sys.argv[1]](sys.argv[2]))
