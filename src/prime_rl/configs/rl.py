"""`rl`: inference, orchestrator and trainer as one config, with the keys they share set once.

A shared key (SHARED_KEYS) given at the top goes to every sub-config that carries it; given in several
sub-configs, the values must agree. The launcher (`prime_rl.launch`) and the Slurm renderer both start from here.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Annotated, Any, ClassVar
from urllib.parse import urlsplit

from pydantic import Field, model_validator
from pydantic_settings import NoDecode

from prime_rl.configs.base import ENV_PREFIX, BaseConfig, FieldError, OutputPath, Section
from prime_rl.configs.cloud import CloudConfig
from prime_rl.configs.fields import expand_shorthands
from prime_rl.configs.inference import InferenceConfig
from prime_rl.configs.k8s import K8sConfig
from prime_rl.configs.orchestrator import OrchestratorConfig
from prime_rl.configs.shared import (
    WEIGHT_BROADCAST_MOVED,
    CkptConfig,
    LogConfig,
    LoraConfig,
    ModelName,
    ParityConfig,
    WandbConfig,
    WeightTransferConfig,
)
from prime_rl.configs.slurm import SlurmConfig
from prime_rl.configs.trainer import TrainerConfig

SERVICES = ("inference", "orchestrator", "trainer")
# Shared key -> the sub-configs that carry it. A value set at the top goes to all of them;
# values set in several sub-configs must agree.
SHARED_KEYS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("output_dir",): SERVICES,
    ("model", "name"): SERVICES,
    ("model", "lora"): SERVICES,
    ("max_steps",): ("orchestrator", "trainer"),
    ("async_level",): ("orchestrator", "trainer"),
    ("ckpt",): ("orchestrator", "trainer"),
    ("weight_transfer",): SERVICES,  # a server reads its `type` only
    ("wandb",): ("orchestrator",),  # the one W&B run of the rl run is the orchestrator's
    ("parity",): ("orchestrator", "trainer"),
}


class SharedModelConfig(Section):
    name: Annotated[
        ModelName | None, Field(description="policy model for all three services (hub id or local path)")
    ] = None
    lora: Annotated[LoraConfig | None, Field(description="LoRA adapter training, for all three services")] = None


class PlanConfig(Section):
    """`rl --plan`: print what each process needs in memory on this cluster shape and whether it fits, then exit
    (0: fits, 1: does not); nothing starts (docs/usage.md, memory plan)."""

    nodes: Annotated[int, Field(ge=1, description="nodes of the cluster")] = 1
    gpus_per_node: Annotated[int, Field(ge=1, description="GPUs per node")] = 8
    gpu_memory_gib: Annotated[float, Field(gt=0, description="memory of one GPU (GiB)")] = 80.0
    host_memory_gib: Annotated[
        float | None, Field(gt=0, description="host memory per node (GiB); unset: not planned")
    ] = None
    inference_gpus: Annotated[
        int | None,
        Field(ge=1, description="GPUs serving inference; unset: half of one node's, or a whole node with 2+ nodes"),
    ] = None


class RLConfig(BaseConfig):
    """Runs inference, orchestrator and trainer together on one node."""

    moved_keys: ClassVar[dict[str, str]] = WEIGHT_BROADCAST_MOVED

    # Factories, not instances: a service config reads PRIME_* env vars when built, which must happen inside
    # load_config (a bad value is then a config error) and not at import (it was a traceback).
    inference: Annotated[InferenceConfig, Field(default_factory=InferenceConfig, description="inference server config")]
    orchestrator: Annotated[
        OrchestratorConfig, Field(default_factory=OrchestratorConfig, description="orchestrator config")
    ]
    trainer: Annotated[TrainerConfig, Field(default_factory=TrainerConfig, description="trainer config")]
    output_dir: Annotated[OutputPath | None, Field(description="shared output directory for all services")] = None
    model: Annotated[SharedModelConfig, Field(description="shared model")] = SharedModelConfig()
    max_steps: Annotated[int | None, Field(ge=1, description="training steps (orchestrator and trainer)")] = None
    async_level: Annotated[int | None, Field(ge=0, description="max policy lag of the rollouts")] = None
    ckpt: Annotated[CkptConfig | None, Field(description="checkpointing of trainer and orchestrator")] = None
    wandb: Annotated[
        WandbConfig | None,
        Field(
            description="log to W&B (needs `uv sync --extra wandb`): one run for the whole rl run, with the "
            "orchestrator's, trainer's, evals' and inference servers' numbers (the orchestrator logs them all)"
        ),
    ] = None
    weight_transfer: Annotated[
        WeightTransferConfig,
        NoDecode,
        Field(description="how weights reach inference, for all services (broadcast: the trainer's rendezvous)"),
    ] = WeightTransferConfig()
    parity: Annotated[
        ParityConfig | None,
        Field(description="the parity gate, for orchestrator and trainer (interval, max_kl, num_canaries)"),
    ] = None
    inference_gpu_ids: Annotated[list[int] | None, Field(description="GPUs for inference; default [0]")] = None
    trainer_gpu_ids: Annotated[list[int] | None, Field(description="GPUs for the trainer; default [1]")] = None
    trainer_cpu_ranks: Annotated[int, Field(ge=1, description="trainer processes when running on CPU")] = 1
    inference_cpus: Annotated[
        list[int] | None, Field(description="CPU cores the inference server runs on (taskset); default: all")
    ] = None
    trainer_cpus: Annotated[list[int] | None, Field(description="CPU cores the trainer runs on; default: all")] = None
    startup_timeout: Annotated[float, Field(gt=0, description="seconds to wait for the inference server")] = 600.0
    restart: Annotated[
        int,
        Field(ge=0, description="restart a service that dies or hangs, alone, up to this many times each (needs ckpt)"),
    ] = 0
    hang_timeout: Annotated[
        float,
        Field(
            gt=0,
            description="a service that makes no progress this long (3x in long work: loading a model, writing a "
            "checkpoint) is hung: it is killed, named, and restarted like a death (--restart)",
        ),
    ] = 600.0
    stop_timeout: Annotated[
        float,
        Field(
            gt=0,
            description="seconds trainer and orchestrator get to save and exit after a stop signal (USR1, "
            "SIGTERM), before they are killed",
        ),  # fmt: skip
    ] = 600.0
    teacher: Annotated[
        InferenceConfig | None,
        Field(
            description="on-policy distillation: a second inference server rl starts for the teacher model "
            "([teacher.model] name; port: inference's + 1 unless set; log: logs/teacher.log); its weight is set "
            "in [orchestrator.teacher], which rl points at it"
        ),
    ] = None
    log: Annotated[LogConfig, Field(description="logging of the launcher itself")] = LogConfig()
    slurm: Annotated[SlurmConfig | None, Field(description="submit as a Slurm job instead (docs/slurm.md)")] = None
    k8s: Annotated[
        K8sConfig | None, Field(description="write the run's Kubernetes manifests instead (docs/deploy.md)")
    ] = None
    cloud: Annotated[
        CloudConfig | None, Field(description="write the run as a SkyPilot or dstack task instead (docs/deploy.md)")
    ] = None
    plan: Annotated[
        PlanConfig | None, Field(description="print the run's memory plan for a cluster shape and exit")
    ] = None

    @classmethod
    def prepare_args(cls, values: dict, sources: dict) -> dict:
        """A shared key given as a top-level flag (in a shared section: each key of it the flags set) overrides
        what the sub-config files say."""
        for key, services in SHARED_KEYS.items():
            for path, source in [(p, str(s)) for p, s in sources.items() if p[: len(key)] == key]:
                for service in services:
                    node = _get(values, (service, *path[:-1]))
                    sub_source = str(sources.get((service, *path), ""))
                    # A sub-config flag is kept, so two flags that disagree are refused as inconsistent.
                    if source.startswith("flag") and isinstance(node, dict) and not sub_source.startswith("flag"):
                        node.pop(path[-1], None)
                    # A sub-config env var is below any file or flag: the top value wins (it was a conflict, blamed
                    # on the file). pydantic-settings puts these values over the env var's.
                    if not sub_source and ENV_PREFIX + "__".join((service, *path)).upper() in os.environ:
                        _put(values, (service, *path), _get(values, path))
        # An orchestrator file (the split form `--orchestrator @ orch.toml`) names the server a lone orchestrator
        # talks to; under `rl` a local server is the one rl starts, so its URL is left to `propagate_shared`,
        # which points it at that server's port. A local URL given as a flag is kept: a different port is refused.
        client = _get(values, ("orchestrator", "client"))
        urls = client.get("base_url") if isinstance(client, dict) else None
        flagged_url = str(sources.get(("orchestrator", "client", "base_url"), "")).startswith("flag")
        if isinstance(urls, list) and len(urls) == 1 and local_port(str(urls[0])) is not None and not flagged_url:
            del client["base_url"]
        return values

    @classmethod
    def shared_copies(cls, loc: tuple) -> list[tuple]:
        """The keys a shared key's value is copied to or from (`model.name` <-> `trainer.model.name`, ...): an
        error at a copy is reported where the user set the value (configs/cli.py)."""
        for key, services in SHARED_KEYS.items():
            if loc[: len(key)] == key:
                return [(service, *loc) for service in services]
            if loc and loc[0] in services and loc[1 : 1 + len(key)] == key:
                return [loc[1:], *((service, *loc[1:]) for service in services if service != loc[0])]
        return []

    @model_validator(mode="before")
    @classmethod
    def _share_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = expand_shorthands(cls, data)  # `weight_transfer = "broadcast"` (an env var, a Python caller)
            propagate_shared(data)
            wire_teacher(data)
        return data

    @model_validator(mode="after")
    def _same_output_dir(self) -> RLConfig:
        dirs = {str(getattr(self, s).output_dir) for s in SERVICES}
        if len(dirs) > 1:
            raise ValueError(f"the services' output_dir differ ({sorted(dirs)}); set --output-dir once")
        if self.restart and self.trainer.ckpt is None:
            raise FieldError(
                "restart", "--restart resumes a dead service from its checkpoint: also set --ckpt.interval N"
            )
        return self

    @model_validator(mode="after")
    def _rl_assigns_devices(self) -> RLConfig:
        for service in SERVICES:
            if "CUDA_VISIBLE_DEVICES" in getattr(self, service).env_vars:
                how = "runs the orchestrator on none" if service == "orchestrator" else f"takes --{service}-gpu-ids"
                raise FieldError(
                    f"{service}.env_vars.CUDA_VISIBLE_DEVICES", f"rl assigns each service its devices: it {how}"
                )
        return self

    @model_validator(mode="after")
    def _orchestrator_fits_the_server(self) -> RLConfig:
        """rl starts the server: the orchestrator must reach it, and ask for no longer sequences than it takes."""
        port = self.inference.server.port
        if port == 0:  # rl would wait startup_timeout for port 0, then fail
            raise FieldError(
                "inference.server.port",
                "rl must know the port of the server it starts: give a free one (e.g. 8000); 0 (any free port) is "
                "for a lone `inference`",
            )
        for url in self.orchestrator.client.base_url:
            if local_port(url) not in (None, port):
                raise FieldError(
                    "orchestrator.client.base_url",
                    f"{url} is a local port rl starts no server on (its server listens on {port}); leave "
                    "client.base_url unset and rl points the orchestrator at its server",
                    also=("inference.server.port",),
                )
        seq_len, max_len = self.orchestrator.seq_len, self.inference.max_model_len
        if seq_len > max_len:  # a multi-turn episode fills seq_len, and the server refuses it past max_model_len
            raise FieldError(
                "orchestrator.seq_len",
                f"{seq_len} is more than inference.max_model_len ({max_len}), the longest sequence the server "
                "takes: lower seq_len or raise max_model_len",
                also=("inference.max_model_len",),
            )
        return self

    @model_validator(mode="after")
    def _trainer_shares_what_the_rows_count_once(self) -> RLConfig:
        """Rows that count a shared prompt once hold more tokens than seq_len: only a trainer that computes
        such a prompt once (share_prompts, on the CPU) keeps to seq_len's compute and memory."""
        trainer = self.trainer
        if self.orchestrator.share_prompts and (not trainer.share_prompts or trainer.device == "cuda"):
            why = "trainer.share_prompts is off" if not trainer.share_prompts else "trainer.device is cuda"
            raise FieldError(
                "orchestrator.share_prompts",
                f"counts a prompt that several samples of a row share once toward seq_len, but {why}: the trainer "
                "would compute those rows whole (the CPU trainer alone computes shared prompts once); set it false",
                also=("trainer.share_prompts" if not trainer.share_prompts else "trainer.device",),
            )
        return self

    @model_validator(mode="after")
    def _backend_can_replay_the_sampling(self) -> RLConfig:
        """top-p / top-k training replays each token's kept set, which vLLM returns only when started with
        `--return-sampling-mask` (a GPU: vLLM's CPU build cannot, and its server refuses the flag at start)."""
        sampling = self.orchestrator.sampling
        flags = {name.replace("_", "-"): value for name, value in self.inference.vllm.items()}
        if sampling.filtered and self.inference.backend == "vllm" and not flags.get("return-sampling-mask"):
            key = "orchestrator.sampling.top_p" if sampling.top_p < 1 else "orchestrator.sampling.top_k"
            raise FieldError(
                key,
                "training with top_p < 1 or top_k > 0 replays each sampled token's kept set, which vLLM returns "
                "only with inference.vllm.return-sampling-mask = true (GPU only: vLLM's CPU build cannot return "
                "sampling masks): set it, or use inference.backend = builtin, or top_p = 1 and top_k = 0",
                also=("inference.backend",),
            )
        return self

    @model_validator(mode="after")
    def _one_launcher(self) -> RLConfig:
        chosen = [name for name in ("slurm", "k8s", "cloud") if getattr(self, name) is not None]
        if len(chosen) > 1:
            raise FieldError(chosen[1], f"one launcher at a time: {' and '.join(chosen)} are both set",
                             also=tuple(chosen[:1]))  # fmt: skip
        pinned = [name for name in ("inference_cpus", "trainer_cpus") if getattr(self, name)]
        if chosen and pinned:
            raise FieldError(pinned[0], f"pins a service of a one-node rl; {chosen[0]} places the services itself")
        return self

    @model_validator(mode="after")
    def _teacher_server_fits(self) -> RLConfig:
        """The teacher server rl starts: a named model, a port of its own, room to score a whole sample."""
        teacher = self.teacher
        if teacher is None:
            return self
        if "name" not in teacher.model.model_fields_set:
            raise FieldError("teacher.model.name", "[teacher] starts a teacher server: name its model")
        if self.slurm is not None:
            raise FieldError(
                "teacher", "under Slurm rl starts no teacher server: run one and give [orchestrator.teacher] base_url"
            )
        if teacher.server.port in (0, self.inference.server.port):
            raise FieldError(
                "teacher.server.port",
                f"{teacher.server.port}: the teacher server needs a free port of its own (not 0, not the policy "
                f"server's {self.inference.server.port})",
                also=("inference.server.port",),
            )
        sampling = self.orchestrator.sampling
        if teacher.backend == "vllm" and (sampling.temperature != 1 or sampling.filtered):
            raise FieldError(  # vLLM scores prompts from raw logits only (inference/vllm/server.py PROMPT_SCORING)
                "teacher.backend",
                f"vllm cannot score the teacher at the student's sampling (temperature {sampling.temperature}, top_p "
                f"{sampling.top_p}, top_k {sampling.top_k}): its prompt logprobs are raw logits over the whole "
                "vocabulary; use backend builtin, or temperature 1 with top_p = 1 and top_k = 0",
                also=("orchestrator.sampling.temperature", "orchestrator.sampling.top_p"),
            )
        seq_len = self.orchestrator.seq_len
        if teacher.max_model_len <= seq_len:  # a scoring request asks one token past the sample
            raise FieldError(
                "teacher.max_model_len",
                f"{teacher.max_model_len} leaves no room to score a sample of orchestrator.seq_len ({seq_len}) "
                "tokens: make it at least seq_len + 1",
                also=("orchestrator.seq_len",),
            )
        return self


def wire_teacher(data: dict) -> None:
    """`[teacher]` (a server rl starts): its port defaults to the policy server's + 1, and
    [orchestrator.teacher] gets its URL and model name unless given (created with its defaults if absent).

    {"teacher": {"model": {"name": "big"}}} -> teacher.server.port 8001, orchestrator.teacher =
    {"base_url": ["http://127.0.0.1:8001/v1"], "model": "big"}
    """
    teacher = data.get("teacher")
    if not isinstance(teacher, dict) or not isinstance(data.get("orchestrator", {}), dict):
        return  # none, or of the wrong type: validation reports it
    server = teacher.setdefault("server", {})
    if not isinstance(server, dict):
        return
    if "port" not in server:
        try:
            server["port"] = int(_get(data, ("inference", "server", "port")) or 8000) + 1
        except (TypeError, ValueError):
            return  # the policy server's port is invalid: validation reports it
    wired = data.setdefault("orchestrator", {}).setdefault("teacher", {})
    if isinstance(wired, dict):
        wired.setdefault("base_url", [f"http://127.0.0.1:{server['port']}/v1"])
        if (name := _get(teacher, ("model", "name"))) is not None:
            wired.setdefault("model", str(name))


def local_port(url: str) -> int | None:
    """The port of `url` when it names this machine (localhost, a loopback address, 0.0.0.0), else None."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = parts.hostname or ""
        local = host == "localhost" or (ip := ipaddress.ip_address(host)).is_loopback or ip.is_unspecified
    except ValueError:  # not a URL, a bad port, a host name (remote)
        return None
    return port if local else None


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for part in path:
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _put(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        tree = tree.setdefault(part, {})
    tree[path[-1]] = value


def propagate_shared(data: dict) -> None:
    """Copy shared keys into each sub-config in place; raise ValueError on inconsistent values.

    {"max_steps": 5, "trainer": {}} -> {"max_steps": 5, "trainer": {"max_steps": 5}, "orchestrator": {"max_steps": 5}}
    A shared section (`ckpt`) switched on anywhere is switched on everywhere and shared leaf by leaf.
    """
    for key, services in SHARED_KEYS.items():
        subs = [data.setdefault(s, {}) for s in services]
        if not all(isinstance(sub, dict) for sub in subs):
            continue  # a sub-config of the wrong type: validation reports it
        sections = [v for v in [_get(data, key), *(_get(sub, key) for sub in subs)] if isinstance(v, dict)]
        if sections:
            for sub in subs:
                _put(sub, key, dict(_get(sub, key) or {}))
            _put(data, key, dict(_get(data, key) or {}))
            for leaf in {leaf for section in sections for leaf in section}:
                _share(data, (*key, leaf), services)
        else:
            _share(data, key, services)
    # The orchestrator talks to the server `rl` starts unless told otherwise.
    port = _get(data, ("inference", "server", "port"))
    if port is not None and _get(data, ("orchestrator", "client", "base_url")) is None:
        _put(data.setdefault("orchestrator", {}), ("client", "base_url"), [f"http://127.0.0.1:{port}/v1"])


def _share(data: dict, key: tuple[str, ...], services: tuple[str, ...]) -> None:
    """One shared leaf: the top-level value, else the one value the sub-configs agree on, goes everywhere."""
    name = ".".join(key)
    top = _get(data, key)
    explicit = {s: v for s in services if (v := _get(data[s], key)) is not None}
    if top is not None:
        for service, value in explicit.items():
            if str(value) != str(top):
                message = f"{name} is {top!r} but {service}.{name} is {value!r}; set it once at the top"
                raise FieldError(name, message, also=(f"{service}.{name}",))
        value = top
    elif len({str(v) for v in explicit.values()}) > 1:
        found = ", ".join(f"{s}.{name}={v!r}" for s, v in explicit.items())
        first, *others = (f"{s}.{name}" for s in explicit)
        raise FieldError(first, f"inconsistent {name}: {found}", also=tuple(others))
    elif explicit:
        value = next(iter(explicit.values()))
    else:
        return
    for service in services:
        _put(data[service], key, value)
    _put(data, key, value)
