"""What each service of an RL run starts with: its devices, its command line, and its config as the launcher
adjusts it. One place for `rl` (one node) and the renderers that start it across machines (`prime_rl.slurm`,
`prime_rl.k8s`, `prime_rl.cloud`)."""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

from prime_rl.configs.base import BaseConfig
from prime_rl.configs.rl import SERVICES, RLConfig
from prime_rl.utils.net import free_port

logger = logging.getLogger("prime_rl")


# A node without these has no device torch.cuda could see (NVIDIA's driver, ROCm's, WSL2's GPU bridge).
GPU_DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def count_gpus() -> int:
    """The CUDA devices this process sees; 0 at once on a node with no GPU driver (importing torch to learn that
    costs ~2 s of a CPU run's start)."""
    if not any(os.path.exists(p) for p in GPU_DRIVER_PATHS):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _gpu_ids(config: RLConfig) -> list[tuple[str, list[int] | None]]:
    return [("inference_gpu_ids", config.inference_gpu_ids), ("trainer_gpu_ids", config.trainer_gpu_ids)]


def assign_devices(config: RLConfig, num_gpus: int) -> tuple[dict[str, dict[str, str]], int]:
    """Per-service env additions and the trainer world size."""
    if num_gpus == 0:
        if given := [f"--{k.replace('_', '-')} {','.join(map(str, v))}" for k, v in _gpu_ids(config) if v]:
            raise ValueError(f"{' '.join(given)}: no CUDA device is visible on this node; drop them to run on CPU")
        cpu = {"CUDA_VISIBLE_DEVICES": ""}
        return {s: dict(cpu) for s in SERVICES}, config.trainer_cpu_ranks
    inference_ids = config.inference_gpu_ids or [0]
    trainer_ids = config.trainer_gpu_ids or [1 if num_gpus > 1 else 0]
    for ids in (inference_ids, trainer_ids):
        if bad := [i for i in ids if not 0 <= i < num_gpus]:
            raise ValueError(f"GPU ids {bad} do not exist (this node has {num_gpus})")
    env = {
        "inference": {"CUDA_VISIBLE_DEVICES": ",".join(map(str, inference_ids))},
        "orchestrator": {"CUDA_VISIBLE_DEVICES": ""},
        "trainer": {"CUDA_VISIBLE_DEVICES": ",".join(map(str, trainer_ids))},
    }
    return env, len(trainer_ids)


def wait_passively_beside_the_trainer(config: RLConfig, env: dict[str, str]) -> dict[str, str]:
    """The CPU server's env: OMP_WAIT_POLICY=passive while it computes beside the trainer on the same cores (steps
    overlap: async_level >= 1), unless the user or the shell chose. OpenMP threads that spin between parallel
    regions hold cores the other service's threads need: with the server spinning (inference/server.py lets
    it), a third of the debug run's steps stalled 0.5-0.9 s in generation, against 0.07-0.17 s passive. A
    synchronous loop takes turns, and spinning makes its generation faster (the 0.8 M loop beside TRL: step
    0.69x spinning, 0.92x passive); so does a server with cores of its own (--inference-cpus apart from
    --trainer-cpus), as on a machine of its own."""
    inference, trainer = set(config.inference_cpus or ()), set(config.trainer_cpus or ())
    apart = bool(inference and trainer and not inference & trainer)
    if apart or config.orchestrator.async_level == 0 or "OMP_WAIT_POLICY" in os.environ:
        return env
    return {"OMP_WAIT_POLICY": "passive"} | env


def service_commands(
    run_dir: Path, trainer_procs: int, teacher: bool = False, torchrun: bool = False
) -> dict[str, list[str]]:
    """Each service's command line; with `teacher`, also the teacher server's (an `inference` of its own).

    Several trainer ranks run under torchrun (`--standalone`: the Slurm renderer puts its nodes' rendezvous
    there, and asks for torchrun even for one rank a node); one rank is the trainer process itself, a
    one-process group without a port (trainer/parallel.py): torchrun's agent would only add a Python process
    that imports torch before the trainer starts (~2 s of a small run's 10 s on two cores) and outlives it."""
    py = sys.executable
    extra = {"teacher": [py, "-m", "prime_rl.entrypoints.inference", "@", str(run_dir / "teacher.toml")]}
    launcher = ["-m", "prime_rl.launch.torchrun", "--standalone", "--nproc-per-node", str(trainer_procs)]
    return ({} if not teacher else extra) | {
        "inference": [py, "-m", "prime_rl.entrypoints.inference", "@", str(run_dir / "inference.toml")],
        "orchestrator": [py, "-m", "prime_rl.entrypoints.orchestrator", "@", str(run_dir / "orchestrator.toml")],
        "trainer": [
            py, *(launcher if torchrun or trainer_procs > 1 else []),
            "-m", "prime_rl.entrypoints.trainer", "@", str(run_dir / "trainer.toml"),
        ],
    }  # fmt: skip


def pin_cpus(config: RLConfig, commands: dict[str, list[str]]) -> dict[str, list[str]]:
    """`commands` with each service given cores (--inference-cpus, --trainer-cpus) run under `taskset` on them; a
    teacher server shares the policy server's, the orchestrator and an unpinned service every core of `rl`'s."""
    cores = {"inference": config.inference_cpus, "teacher": config.inference_cpus, "trainer": config.trainer_cpus}
    if not any(cores.values()):
        return commands
    mine = os.sched_getaffinity(0)
    for flag, ids in (("--inference-cpus", config.inference_cpus), ("--trainer-cpus", config.trainer_cpus)):
        if ids and (bad := sorted(set(ids) - mine)):
            raise ValueError(f"{flag} {','.join(map(str, ids))}: cores {bad} are not among this node's {sorted(mine)}")
    if (taskset := shutil.which("taskset")) is None:
        raise ValueError("--inference-cpus / --trainer-cpus start the services under taskset (util-linux): not found")
    return {
        name: [taskset, "--cpu-list", ",".join(map(str, cores[name])), *cmd] if cores.get(name) else cmd
        for name, cmd in commands.items()
    }


def prometheus_ports(config: RLConfig) -> tuple[RLConfig, str]:
    """`config` with a free port for the orchestrator's and the trainer's Prometheus endpoints where none is set,
    and the line naming every scrape URL of the run (the servers' /metrics too)."""
    updates, urls = {}, [f"inference http://127.0.0.1:{config.inference.server.port}/metrics"]
    if config.teacher is not None:
        urls.append(f"teacher http://127.0.0.1:{config.teacher.server.port}/metrics")
    for name in ("orchestrator", "trainer"):
        sub = getattr(config, name)
        port = sub.prometheus.port or free_port()
        updates[name] = sub.model_copy(update={"prometheus": sub.prometheus.model_copy(update={"port": port})})
        urls.append(f"{name} http://127.0.0.1:{port}/metrics")
    return config.model_copy(update=updates), "Prometheus: " + ", ".join(urls) + " (and /health)"


def service_configs(
    config: RLConfig,
    trainer_ranks: int,
    *,
    key_in_env: bool,
    layout: str = "",
    host: str | None = None,
    self_watch: bool = False,
    env: dict[str, dict[str, str]] | None = None,
) -> dict[str, BaseConfig]:
    """The inference, orchestrator and trainer configs as the launcher runs them; `config` is left as it is.

    - orchestrator.num_train_workers = `trainer_ranks` (ValueError if the user set another value; `layout`
      says in the message how the ranks come about);
    - log.file off: the launcher captures each service's output into its log file;
    - `key_in_env`: the API key travels in the environment under the orchestrator's client.api_key_var (the
      written configs never hold it), so the server reads it from there too (inference.api_key_var);
    - `host`: where the server listens, when the layout needs another address than the config's.
    - `self_watch`: no `rl` watches the services (multi-node Slurm): the orchestrator and the trainer exit
      when hung themselves, after `rl`'s --hang-timeout (`protocol.liveness.Heartbeat`).
    - `env` (assign_devices'): a weight broadcast between a trainer and a server on one GPU goes over gloo, and
      a vLLM server beside the trainer on one GPU gets a share of its memory (`gpu_memory_shares`).
    Copies, not re-validated: the server's key is only in the environment where the services run.
    """
    orchestrator, inference = config.orchestrator, config.inference
    if orchestrator.num_train_workers != trainer_ranks and "num_train_workers" in orchestrator.model_fields_set:
        raise ValueError(
            f"orchestrator.num_train_workers={orchestrator.num_train_workers} but the trainer "
            f"runs {trainer_ranks} ranks{layout}"
        )
    updates: dict[str, dict] = {"inference": {}, "orchestrator": {"num_train_workers": trainer_ranks}, "trainer": {}}
    if config.startup_timeout > orchestrator.client.health_timeout:  # it starts with the server and waits as long
        client = orchestrator.client.model_copy(update={"health_timeout": config.startup_timeout})
        updates["orchestrator"]["client"] = client
    if key_in_env:
        updates["inference"]["api_key_var"] = orchestrator.client.api_key_var
    if host is not None:
        updates["inference"]["server"] = inference.server.model_copy(update={"host": host})
    shared = shared_gpus(env or {})
    transfer = config.trainer.weight_transfer
    if shared and transfer.type == "broadcast" and transfer.backend == "auto":
        updates["trainer"]["weight_transfer"] = transfer.model_copy(update={"backend": "gloo"})
        logger.info(f"the trainer and the inference server share GPU {','.join(shared)}: weights travel over gloo")
    for name, share in gpu_memory_shares(config, shared).items():
        updates.setdefault(name, {})["gpu_memory_utilization"] = share
    if self_watch:
        for name in ("orchestrator", "trainer"):
            if getattr(config, name).hang_timeout is None:
                updates[name]["hang_timeout"] = config.hang_timeout
    configs = {}
    for name in SERVICES:
        sub = getattr(config, name)
        configs[name] = sub.model_copy(update={"log": sub.log.model_copy(update={"file": False}), **updates[name]})
    if config.teacher is not None:  # its own output dir: its run record must not replace the policy server's
        log = config.teacher.log.model_copy(update={"file": False})
        teacher_dir = config.orchestrator.output_dir / "teacher"
        teacher = {"log": log, "output_dir": teacher_dir, **updates.get("teacher", {})}
        configs["teacher"] = config.teacher.model_copy(update=teacher)
    return configs


def remote_configs(
    config: RLConfig,
    machines: int,
    procs: int,
    *,
    kind: str,
    output_dir: Path,
    metrics_port: int,
    key_in_env: bool = True,
    base_urls: list[str] | None = None,
) -> dict[str, BaseConfig]:
    """`service_configs` for services on machines of their own, no `rl` beside them (Kubernetes pods, cloud
    nodes): `machines` x `procs` trainer ranks (`kind` names the machines in a mismatch's message), servers on
    every interface, each service watching itself; every service writes under `output_dir` (the shared volume
    as each machine mounts it) and the orchestrator and the trainer serve Prometheus on `metrics_port`;
    `base_urls`, where the servers' addresses are known before the run, become the orchestrator's."""
    layout = f" ({machines} {kind}(s) x {procs})"
    subs = service_configs(config, machines * procs, key_in_env=key_in_env, layout=layout, host="0.0.0.0",
                           self_watch=True)  # fmt: skip
    for name, sub in subs.items():
        update: dict = {"output_dir": output_dir}
        if name == "orchestrator" and base_urls:
            update["client"] = sub.client.model_copy(update={"base_url": base_urls})
        if name in ("orchestrator", "trainer"):
            update["prometheus"] = sub.prometheus.model_copy(update={"port": metrics_port})
        subs[name] = sub.model_copy(update=update)
    return subs


# The trainer's part of a GPU it shares with vLLM servers: upstream's single-GPU deployment runs vLLM at
# --gpu-memory-utilization 0.5 beside the trainer (vLLM's own default, 0.92, leaves the trainer nothing).
TRAINER_GPU_SHARE = 0.5


def gpu_memory_shares(config: RLConfig, shared: list[str]) -> dict[str, float]:
    """`gpu_memory_utilization` for each server `rl` starts on the GPU(s) the trainer uses too, where the user set
    none: the servers split what the trainer leaves, equally (the teacher server runs on the policy server's
    GPUs). One log line says what was chosen and why. Empty when no GPU is shared."""
    if not shared:
        return {}
    servers = {"inference": config.inference} | ({"teacher": config.teacher} if config.teacher is not None else {})
    servers = {name: server for name, server in servers.items() if server.backend != "builtin"}
    unset = [name for name, server in servers.items() if server.gpu_memory_utilization is None]
    if not unset:
        return {}
    taken = sum(s.gpu_memory_utilization for s in servers.values() if s.gpu_memory_utilization is not None)
    share = round(max(1 - TRAINER_GPU_SHARE - taken, 0.05) / len(unset), 2)
    keys = " and ".join(f"--{name}.gpu-memory-utilization" for name in unset)
    logger.info(
        f"the trainer and {' and '.join(unset)} share GPU {','.join(shared)}: vLLM gets gpu_memory_utilization "
        f"{share} each, leaving the trainer {TRAINER_GPU_SHARE:.0%} of the GPU's memory (vLLM's own default, 0.92, "
        f"would leave it nothing); set {keys} to choose"
    )
    return dict.fromkeys(unset, share)


def shared_gpus(env: dict[str, dict[str, str]]) -> list[str]:
    """The GPUs both the trainer and the inference server see (assign_devices' CUDA_VISIBLE_DEVICES)."""
    seen = [
        set(filter(None, env.get(s, {}).get("CUDA_VISIBLE_DEVICES", "").split(","))) for s in ("inference", "trainer")
    ]
    return sorted(seen[0] & seen[1])


def resume_step(config: RLConfig) -> int | None:
    """The orchestrator checkpoint step the run resumes at, or None for a fresh run; ValueError if missing."""
    from prime_rl.protocol import resolve_resume_step

    ckpt = config.orchestrator.ckpt
    step = ckpt.resume_step if ckpt is not None else None
    return resolve_resume_step(config.orchestrator.output_dir, step, "orchestrator")
