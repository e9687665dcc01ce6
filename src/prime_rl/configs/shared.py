"""Sections every service shares: the model (and LoRA), logging, checkpoints, weight transfer, env vars."""

from __future__ import annotations

import difflib
import re
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from prime_rl.configs.base import ENV_PREFIX, FieldError, Section
from prime_rl.configs.fields import FLAG_TABLE

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(Section):
    """Train a LoRA adapter instead of every weight. The trainer ships the adapter only (a peft dir in
    `weights/step_n`); servers serve base + adapter under `name`, which the orchestrator's requests name."""

    rank: Annotated[int, Field(ge=1, description="rank r of each adapter pair (A: r x in, B: out x r)")] = 16
    alpha: Annotated[float, Field(gt=0, description="scale: the update is (alpha / rank) * B A")] = 32.0
    dropout: Annotated[
        float,
        Field(ge=0, lt=1, description="dropout on the adapter's input (SFT only: RL needs the policy's own logprobs)"),
    ] = 0.0
    target_modules: Annotated[
        list[str], Field(min_length=1, description="names of the linear layers that get an adapter")
    ] = LORA_TARGETS
    name: Annotated[str, Field(min_length=1, description="name the servers serve the adapter under")] = "policy-lora"


# Set while a command parses its own config (`parse_config`), unless it submits to Slurm (the job checks on its
# node): only then must a local model path (and `sft`'s data.path) exist. A Python caller may name a path an
# earlier step writes.
CHECK_MODEL_PATHS: ContextVar[bool] = ContextVar("CHECK_MODEL_PATHS", default=False)


class ShowsValue(ValueError):
    """A validator's message that already names the value: the error line adds no "(got ...)"."""


def looks_local(name: str) -> bool:
    """A model name that means a local path rather than a hub id (`name` or `org/name`): it starts like a path,
    has more than one `/`, its first component is a local directory (`assets/...`, `outputs/...`), or it exists.
    Relative paths are the cwd's."""
    if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:
        return True
    return Path(name.split("/")[0]).is_dir() or Path(name).exists()


def local_model_problem(name: str) -> str | None:
    """Why the local model path `name` cannot be loaded (no such directory, no config.json), else None."""
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        return f"{name} is a directory without a config.json: not a model (a Hugging Face checkpoint dir has one)"
    problem = f"no such directory: {name} (a local model path; a Hugging Face id looks like org/name)"
    parent = path.parent
    if parent.is_dir():
        siblings = [p.name for p in parent.iterdir() if p.is_dir()]
        if close := difflib.get_close_matches(path.name, siblings, n=1):
            problem += f"; did you mean {Path(name).parent / close[0] if '/' in name else close[0]}?"
    return problem


def _names_a_model(name: str) -> str:
    if not name.strip():  # `--model.name ""` got as far as loading the model: the hub's "Repo id must use ..."
        raise ValueError("must name a model: a Hugging Face hub id or a local path")
    # A local path that is not there was taken for a hub id: minutes of retries, then "Repo id must be ...".
    if CHECK_MODEL_PATHS.get() and looks_local(name) and (problem := local_model_problem(name)):
        raise ShowsValue(problem)
    return name


# The model's name: every config that takes one (the services and `rl`'s shared one) refuses a blank one alike.
ModelName = Annotated[str, AfterValidator(_names_a_model)]


def _names_an_env_var(name: str) -> str:
    # The Slurm job script assigns it (`export NAME=...`): anything else there would be shell, not a name.
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError("must be an env var name: letters, digits and _, not starting with a digit")
    return name


EnvVarName = Annotated[str, AfterValidator(_names_an_env_var)]

# A name with one of these words (split at `_`) names a secret: HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY.
SECRET_WORDS = frozenset({"KEY", "APIKEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS"})


def looks_secret(name: str) -> bool:
    return not SECRET_WORDS.isdisjoint(name.upper().split("_"))


def _numbers_as_text(table: Any) -> Any:
    """`OMP_NUM_THREADS = 4` in TOML is the env var's text "4" (a bool stays an error: "1"/"true"/"yes"?)."""
    if not isinstance(table, dict):
        return table
    return {k: str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v for k, v in table.items()}


def _env_vars_are_safe(table: dict[str, str]) -> dict[str, str]:
    """Names only (the Slurm job script sets them), no config keys (PRIME_*: the config holds those), no secrets
    (the table is written to OUTPUT_DIR/run/*.toml and into Slurm job scripts)."""
    for name in table:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise FieldError(name, "not an env var name: letters, digits and _, not starting with a digit")
        if name.upper().startswith(ENV_PREFIX):
            raise FieldError(name, f"{ENV_PREFIX}* env vars are config keys: set the key in the config instead")
        if looks_secret(name):
            raise FieldError(
                name,
                "looks like a secret, and env_vars are written to disk (OUTPUT_DIR/run/*.toml, Slurm job scripts): "
                "export it in the environment that starts the run instead (every service inherits it)",
            )
    return table


# Env vars one service runs with (`[inference.env_vars]`, `--env-vars.OMP_NUM_THREADS 4`): `rl` starts the
# service with them, the service's own entrypoint sets them before it loads anything heavy, Slurm job steps export
# them. Over the inherited environment.
EnvVars = Annotated[
    dict[str, str],
    FLAG_TABLE,
    BeforeValidator(_numbers_as_text),
    AfterValidator(_env_vars_are_safe),
    Field(
        description='env vars this service runs with, over the inherited ones (NAME = "value"; never secrets: '
        "they are written to OUTPUT_DIR/run/ and Slurm job scripts)"
    ),
]


class ModelConfig(Section):
    name: Annotated[ModelName, Field(description="HF hub id or local path of the policy model")] = "Qwen/Qwen3-0.6B"
    lora: Annotated[LoraConfig | None, Field(description="LoRA: train an adapter only; off unless --model.lora")] = None

    @property
    def adapter(self) -> str | None:
        """The name requests give a trained LoRA adapter (None: full fine-tuning)."""
        return self.lora.name if self.lora is not None else None


class LogConfig(Section):
    level: Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], Field(description="log level")] = "INFO"
    file: Annotated[
        bool, Field(description="also write OUTPUT_DIR/logs/<service>.log (off when `rl` captures the output)")
    ] = True


class PrometheusConfig(Section):
    """Prometheus `/metrics` (each number of the last step's metrics line as a gauge, the step, the process's
    memory and CPU) and `/health`, served by the service itself (the trainer's rank 0) from a thread of its own."""

    port: Annotated[
        int | None,
        Field(ge=1, le=65535, description="port to serve them on; unset: not served (`rl` gives each a free port)"),
    ] = None
    host: Annotated[str, Field(description="address to listen on")] = "0.0.0.0"


class StepLogConfig(LogConfig):
    """Logging of a trainer, which prints a line per step it logs (metrics/*.jsonl still gets every step)."""

    interval: Annotated[
        int,
        Field(
            ge=1,
            description="print the step line every n steps (and always the first, held-out-loss and last steps)",
        ),
    ] = 10


class WeightTransferConfig(Section):
    """How new weights reach inference, and the trainer's broadcast rendezvous (trainer rank 0 hosts it; the
    orchestrator sends it to the servers with each broadcast request, so a server reads `type` only). The group's
    size is not configured: the orchestrator counts its servers' seats (their /health) and the receivers tell the
    trainer through the rendezvous.

    A bare string is the type: `weight_transfer = "broadcast"` / `--weight-transfer broadcast` mean
    `type = "broadcast"` with default settings. A service config's field is `NoDecode`, so that
    `PRIME_WEIGHT_TRANSFER=broadcast` reaches the validator as that string (pydantic-settings would parse an env
    value for a section as JSON); `PRIME_WEIGHT_TRANSFER__PORT` sets one setting."""

    shorthand: ClassVar[str] = "type"  # the field a bare value sets (read by configs/fields.py and cli.py)

    type: Annotated[
        Literal["filesystem", "broadcast"],
        Field(
            description="filesystem = the trainer writes weights/step_n every step and servers read it; "
            "broadcast = the trainer sends them over a process group the servers join "
            "(nccl on CUDA, gloo on CPU; weights/step_n only at checkpoint steps and the last)"
        ),
    ] = "filesystem"
    backend: Annotated[
        Literal["auto", "nccl", "gloo"],
        Field(
            description='type = "broadcast": the process group\'s transport; auto = nccl on CUDA, gloo on CPU, and '
            "gloo where `rl` puts the trainer and a server on one GPU (NCCL refuses two ranks of a group on one GPU)"
        ),
    ] = "auto"
    host: Annotated[
        str, Field(description='type = "broadcast": address of trainer rank 0 that inference workers can reach')
    ] = "127.0.0.1"
    port: Annotated[
        int, Field(ge=1, le=65535, description='type = "broadcast": TCP port trainer rank 0 hosts the rendezvous on')
    ] = 29600
    timeout: Annotated[
        float,
        Field(gt=0, description='type = "broadcast": seconds a broadcast may take (forming the group, one transfer)'),
    ] = 600.0

    @model_validator(mode="before")
    @classmethod
    def _bare_string_is_the_type(cls, data: Any) -> Any:
        return {cls.shorthand: data} if isinstance(data, str) else data


class ParityConfig(Section):
    """The parity gate (docs/orchestrator.md): fixed canary sequences, chosen from the run's first batch, are
    scored by every server right after it loads the weights of a gate step and by the trainer with the same
    weights (the servers' prefill path); a gate step is also sampled on-policy, and the trainer's k3 of those
    sampled tokens is each server's decode path against the trainer. Either trimmed-mean KL above `max_kl`
    stops the run, naming the server. Weight checksums are compared at every update whatever this says."""

    interval: Annotated[
        int,
        Field(
            ge=0,
            description="compare at weight step 0 and every this many weight steps (each such step sampled "
            "on-policy); 0 = no canaries, no sampled-token check",
        ),
    ] = 10
    max_kl: Annotated[
        float,
        Field(
            gt=0,
            description="stop the run when a server's mismatch KL against the trainer's logprobs (k3, a trimmed "
            "mean over the canaries' or the sampled tokens: the worst 1% of sequences, at least one, left out) "
            "exceeds this; honest bf16 noise is 3e-5 to ~1e-3 (docs/orchestrator.md)",
        ),
    ] = 1e-2
    num_canaries: Annotated[
        int, Field(ge=1, le=64, description="canary sequences (the first sample of as many groups, across envs)")
    ] = 4


# The `[weight_broadcast]` section of earlier versions: an unknown-key error for it says where its settings went.
WEIGHT_BROADCAST_MOVED = {"weight_broadcast": "weight_transfer.host/port/timeout"}


class CkptConfig(Section):
    """Checkpointing, shared by trainer and orchestrator so both save and resume at the same steps."""

    interval: Annotated[
        int | None, Field(ge=1, description="save every n steps; unset = only at the end of the run")
    ] = None
    keep: Annotated[int | None, Field(ge=1, description="newest checkpoints kept on disk; unset = all")] = None
    resume_step: Annotated[
        int | Literal["latest"] | None,
        Field(description="resume from checkpoints/step_N (a number or 'latest'); unset = start fresh"),
    ] = None
    async_save: Annotated[
        bool,
        Field(
            description="trainer: write checkpoints in the background (a step waits only for a copy of the "
            "state in host memory: 12 B per parameter over all ranks with AdamW); false = write before going on, "
            "where host memory is short"
        ),
    ] = True


# The orchestrator's and the trainer's own hang watch (protocol.liveness.Heartbeat), for where no `rl` watches.
SelfHangTimeout = Annotated[
    float | None,
    Field(
        gt=0,
        description="exit (status 5, every thread's stack in the log) after this long without progress (3x "
        "in long work): for panes and multi-node Slurm; under `rl` its --hang-timeout watches instead",
    ),
]


class WandbConfig(Section):
    """A W&B run (`uv sync --extra wandb`): the orchestrator's, one for a whole `rl` run, or `sft`'s."""

    project: Annotated[str, Field(description="W&B project")] = "prime-rl"
    name: Annotated[str | None, Field(description="W&B run name; unset = W&B's default")] = None
    entity: Annotated[str | None, Field(description="W&B entity (team or user); unset = your default")] = None
    offline: Annotated[
        bool, Field(description="log offline, into OUTPUT_DIR/wandb/ (upload later with `wandb sync`)")
    ] = False
