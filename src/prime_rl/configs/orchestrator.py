"""Config of the `orchestrator` service. Imports no torch."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BeforeValidator, Field, model_validator
from pydantic_settings import NoDecode

from prime_rl.configs import (
    BaseConfig,
    CkptConfig,
    LogConfig,
    ModelConfig,
    OutputDir,
    PrometheusConfig,
    Section,
    WeightTransferConfig,
)
from prime_rl.configs.shared import (
    WEIGHT_BROADCAST_MOVED,
    EnvVarName,
    EnvVars,
    ParityConfig,
    SelfHangTimeout,
    ShowsValue,
    WandbConfig,
)


def _http_url(url: str) -> str:
    # Checked here: httpx refuses another scheme per request (`UnsupportedProtocol`), which the client retried
    # until client.health_timeout (600 s) ran out.
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError on a bad port)
    except ValueError as e:
        raise ShowsValue(f"{url!r} is not a URL ({e}); e.g. http://host:8000/v1") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ShowsValue(f"{url!r} is not an http(s) URL with a host; e.g. http://host:8000/v1")
    return url


# A server's OpenAI-compatible base URL.
HttpUrl = Annotated[str, AfterValidator(_http_url)]


class FleetConfig(Section):
    """Which servers the pool holds and their shares: `client.base_url` at the start, then `run/servers.json`
    (the same two keys) while the run goes on (orchestrator/servers/fleet.py)."""

    base_url: Annotated[
        list[HttpUrl], Field(min_length=1, description="OpenAI-compatible base URL(s) of the inference server(s)")
    ] = ["http://localhost:8000/v1"]
    traffic_share: Annotated[
        list[float] | None,
        Field(description="relative share of requests per base_url (e.g. 2,1,1 = 50/25/25%); unset = equal"),
    ] = None

    @model_validator(mode="after")
    def _shares_match(self) -> FleetConfig:
        if self.traffic_share is not None:
            share, n = self.traffic_share, len(self.base_url)
            if len(share) != n:
                raise ValueError(f"client.traffic_share has {len(share)} entries for {n} base_url(s)")
            if any(w <= 0 for w in share):
                raise ValueError(f"client.traffic_share must all be > 0, got {share}")
        return self


class ClientConfig(FleetConfig):
    api_key_var: Annotated[
        EnvVarName, Field(description="name of the env var holding the inference API key (unset var = no key)")
    ] = "INFERENCE_SERVER_API_KEY"
    timeout: Annotated[float, Field(gt=0, description="seconds before one HTTP request is abandoned")] = 600.0
    max_concurrency: Annotated[
        int, Field(ge=1, description="most requests in flight at once per server (the ceiling when adaptive)")
    ] = 64
    concurrency: Annotated[
        Literal["fixed", "adaptive"],
        Field(
            description="fixed = max_concurrency requests per server; adaptive = each server's limit follows its "
            "own load (queue, KV-cache use from its /metrics) between min_concurrency and max_concurrency"
        ),
    ] = "fixed"
    min_concurrency: Annotated[
        int, Field(ge=1, description="adaptive concurrency: the floor of a server's in-flight limit")
    ] = 4
    max_retries: Annotated[
        int, Field(ge=0, description="retries of a request after a connection error, 5xx or 429 (with backoff)")
    ] = 3
    health_timeout: Annotated[
        float, Field(gt=0, description="seconds to wait at start for every server's /health to answer 200")
    ] = 600.0

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "weights" in data:  # a name that read like model weights
            raise ValueError("client.weights is now client.traffic_share (the share of requests per base_url)")
        return data


class SamplingConfig(Section):
    temperature: Annotated[float, Field(gt=0, le=2, description="sampling temperature (the servers take <= 2)")] = 1.0
    top_p: Annotated[
        float,
        Field(gt=0, le=1, description="nucleus sampling: draw from the smallest most-likely set of tokens reaching "
              "this mass (1 = off); in training the server reports each token's set and the trainer scores "
              "over it (built-in engine)"),
    ] = 1.0  # fmt: skip
    top_k: Annotated[
        int,
        Field(ge=-1, description="draw from the k most likely tokens only (0 or -1 = off); in training replayed "
              "like top_p"),
    ] = 0  # fmt: skip
    max_tokens: Annotated[int, Field(ge=1, description="most completion tokens per model turn")] = 128
    seed: Annotated[
        int | None, Field(description="seed for per-request sampling seeds (reproducible sampling); unset = none")
    ] = None

    @property
    def filtered(self) -> bool:
        """Whether top-p or top-k cut the distribution (then RL replays each token's kept set)."""
        return self.top_p < 1 or self.top_k > 0


class AdvantageConfig(Section):
    baseline: Annotated[
        Literal["mean", "leave_one_out"],
        Field(description="subtract the group's mean reward, or the mean of the other rollouts (RLOO)"),
    ] = "mean"
    std_norm: Annotated[
        bool, Field(description="divide each group's advantages by the group's reward std (GRPO-style)")
    ] = False
    length_penalty: Annotated[
        float,
        Field(ge=0, description="subtract this × (model tokens / max_tokens per turn × turns) from each reward"),
    ] = 0.0
    truncated: Annotated[
        Literal["keep", "mask", "zero_reward"],
        Field(description="completions cut at max_tokens: keep as is, mask from the loss, or give reward 0"),
    ] = "keep"
    skip_zero_advantage: Annotated[
        bool,
        Field(description="drop groups whose advantages are all zero and sample new prompts to refill the batch"),
    ] = False
    max_rounds: Annotated[
        int,
        Field(ge=1, description="most sampling rounds per step when refilling skipped groups (then keep them)"),
    ] = 8


class EnvConfig(Section):
    id: Annotated[str, Field(description="environment name from the registry")] = "reverse-text"
    args: Annotated[dict[str, Any], Field(description="keyword arguments for the environment")] = {}
    name: Annotated[
        str | None, Field(description="label in metrics (reward/<name>) and checkpoints; unset = the id")
    ] = None
    ratio: Annotated[float, Field(gt=0, description="relative share of the batch's groups from this env")] = 1.0
    max_tokens: Annotated[
        int | None, Field(ge=1, description="most completion tokens per model turn here; unset = sampling's")
    ] = None

    @property
    def label(self) -> str:
        return self.name or self.id


class EvalEnvConfig(EnvConfig):
    """An environment evaluated during training (`[[orchestrator.eval]]`); `ratio` is not used."""

    interval: Annotated[int, Field(ge=1, description="evaluate at steps 0, interval, 2·interval, ... and the end")] = 10
    num_examples: Annotated[int, Field(ge=1, description="examples per evaluation (the same ones each time)")] = 32
    rollouts_per_example: Annotated[int, Field(ge=1, description="samples per example (k of pass@k)")] = 1
    seed: Annotated[int, Field(description="seed of the examples drawn")] = 1234
    temperature: Annotated[
        float | None, Field(gt=0, le=2, description="sampling temperature here (<= 2); unset = sampling's")
    ] = None


class TeacherConfig(Section):
    """On-policy distillation (`[orchestrator.teacher]`): a teacher server scores every rollout's tokens, and on
    each model token t the advantage becomes reward_weight · A_env + kl_coef · (log p_teacher(t) − log μ(t)),
    μ being the student's sampling logprob (docs/design.md §6)."""

    base_url: Annotated[
        list[HttpUrl],
        Field(min_length=1, description="OpenAI-compatible base URL(s) of the teacher server(s); rl sets it to the "
              "teacher it starts ([teacher])"),
    ] = ["http://localhost:8001/v1"]  # fmt: skip
    model: Annotated[
        str | None,
        Field(description="the model name the teacher server serves (its tokenizer must be the student's); rl "
              "sets it from [teacher]"),
    ] = None  # fmt: skip
    kl_coef: Annotated[
        float, Field(ge=0, description="weight of the per-token reverse-KL term log p_teacher − log μ_student")
    ] = 1.0
    reward_weight: Annotated[
        float, Field(ge=0, description="weight of the environment's advantage (0 = pure distillation)")
    ] = 0.0
    max_concurrency: Annotated[
        int, Field(ge=1, description="most scoring requests in flight at once per teacher server")
    ] = 16
    api_key_var: Annotated[
        EnvVarName, Field(description="name of the env var holding the teacher's API key (unset var = no key)")
    ] = "TEACHER_SERVER_API_KEY"

    @model_validator(mode="after")
    def _some_signal(self) -> TeacherConfig:
        if self.model is None:
            raise ValueError("teacher.model is unset: name the model the teacher serves (rl: [teacher.model] name)")
        if self.kl_coef == 0 and self.reward_weight == 0:
            raise ValueError("teacher.kl_coef and teacher.reward_weight are both 0: no advantage would be left")
        return self


def _one_or_many(value: Any) -> Any:
    """`[env]` (one table, or --env.id on the CLI) or `[[env]]` (a list of tables) are both accepted."""
    return [value] if isinstance(value, dict) else value


def _unique_labels(entries: list[EnvConfig], key: str) -> None:
    labels = [e.label for e in entries]
    if len(set(labels)) != len(labels):
        raise ValueError(f"{key} entries need distinct names (set `name` where an id repeats): {labels}")


class OrchestratorConfig(BaseConfig):
    """Samples rollouts from the inference server, scores them and writes packed batches for the trainer."""

    moved_keys: ClassVar[dict[str, str]] = WEIGHT_BROADCAST_MOVED

    model: Annotated[ModelConfig, Field(description="the policy model (must match the server's)")] = ModelConfig()
    output_dir: OutputDir
    max_steps: Annotated[int, Field(ge=1, description="number of training steps to produce batches for")] = 20
    async_level: Annotated[
        int, Field(ge=0, description="step n samples from a policy no older than n - async_level (0 = on-policy)")
    ] = 1
    batch_size: Annotated[int, Field(ge=1, description="rollouts per step")] = 64
    rollouts_per_example: Annotated[int, Field(ge=1, description="samples per prompt (the advantage group)")] = 8
    seq_len: Annotated[int, Field(ge=1, description="tokens per packed micro batch row")] = 2048
    share_prompts: Annotated[
        bool,
        Field(
            description="count a prompt that several samples of a row share once toward seq_len, as a trainer "
            "with share_prompts computes it (CPU): rows hold more samples; a trainer that does not share computes "
            "such a row whole"
        ),
    ] = False
    num_train_workers: Annotated[int, Field(ge=1, description="trainer world size (one rank file per rank)")] = 1
    seed: Annotated[int, Field(description="seed for the data order")] = 0
    sampling: Annotated[SamplingConfig, Field(description="sampling parameters")] = SamplingConfig()
    env: Annotated[
        list[EnvConfig],
        BeforeValidator(_one_or_many),
        Field(min_length=1, description="training environments ([[env]] with ratio to mix several)"),
    ] = [EnvConfig()]
    eval: Annotated[
        list[EvalEnvConfig],
        BeforeValidator(_one_or_many),
        Field(description="environments evaluated during training ([[eval]]); results in metrics/eval.jsonl"),
    ] = []
    max_inflight: Annotated[
        int | None,
        Field(
            ge=1,
            description="continuous mode: at most this many rollouts generating or waiting, across weight updates "
            "(a step takes complete groups, earliest deadline first); unset = each step samples its own batch",
        ),
    ] = None
    max_off_policy_steps: Annotated[
        int | None,
        Field(
            ge=0,
            description="continuous mode: the lag bound of trained tokens: a group sampled from weight step w is "
            "trained by step w + this at the latest (admissions are paced so it can be; token_lag_max reports it); "
            "unset = async_level + 1",
        ),
    ] = None
    inflight_updates: Annotated[
        Literal["continue", "finish"],
        Field(
            description="continuous mode: continue = a weight update swaps inside running requests (their KV "
            "recomputed, each token labelled with its policy step) where the backend can; finish = it waits for "
            "them to end"
        ),
    ] = "continue"
    max_env_errors: Annotated[
        int,
        Field(ge=1, description="consecutive failed groups of one environment (an episode that verifiers failed or "
              "that left nothing to train) that end the run with the last one's error; a failure before that is "
              "logged, counted in env_errors/<env> and its group drawn again from a fresh example"),
    ] = 5  # fmt: skip
    max_turns: Annotated[
        int | None, Field(ge=1, description="most model turns of a multi-turn episode; unset = the env's max_turns")
    ] = None
    client: Annotated[ClientConfig, Field(description="inference client")] = ClientConfig()
    advantage: Annotated[AdvantageConfig, Field(description="advantage computation")] = AdvantageConfig()
    teacher: Annotated[
        TeacherConfig | None,
        Field(description="on-policy distillation from a teacher server; off unless [orchestrator.teacher] is given"),
    ] = None
    weights_timeout: Annotated[
        float, Field(gt=0, description="seconds to wait for the trainer's weights of a step")
    ] = 3600.0
    heartbeat_timeout: Annotated[
        float, Field(gt=0, description="a trainer heartbeat older than this means the trainer is dead")
    ] = 120.0
    hang_timeout: SelfHangTimeout = None
    env_vars: EnvVars = {}
    ckpt: Annotated[CkptConfig | None, Field(description="checkpointing; off unless --ckpt is given")] = None
    weight_transfer: Annotated[
        WeightTransferConfig,
        NoDecode,
        Field(description="how new weights reach inference; broadcast: the rendezvous servers are sent to"),
    ] = WeightTransferConfig()
    parity: Annotated[
        ParityConfig, Field(description="the parity gate: canaries scored by every server and the trainer")
    ] = ParityConfig()
    log: Annotated[LogConfig, Field(description="logging")] = LogConfig()
    prometheus: Annotated[PrometheusConfig, Field(description="Prometheus /metrics and /health")] = PrometheusConfig()
    wandb: Annotated[
        WandbConfig | None,
        Field(
            description="also log to W&B (needs `uv sync --extra wandb`): one run with the orchestrator's, the "
            "trainer's, the evals' and the inference servers' numbers"
        ),
    ] = None
    progress: Annotated[
        bool | None, Field(description="live progress line on the terminal; unset = only when stderr is a tty")
    ] = None

    @model_validator(mode="after")
    def _batch_divides(self) -> OrchestratorConfig:
        if self.batch_size % self.rollouts_per_example:
            raise ValueError(
                f"batch_size ({self.batch_size}) must be a multiple of "
                f"rollouts_per_example ({self.rollouts_per_example})"
            )
        return self

    @model_validator(mode="after")
    def _envs_consistent(self) -> OrchestratorConfig:
        _unique_labels(self.env, "env")
        _unique_labels(self.eval, "eval")
        if self.advantage.baseline == "leave_one_out" and self.rollouts_per_example < 2:
            raise ValueError("advantage.baseline = leave_one_out needs rollouts_per_example >= 2")
        if self.max_inflight is not None:
            if self.max_inflight < self.rollouts_per_example:
                raise ValueError(
                    f"max_inflight ({self.max_inflight}) must hold at least one group "
                    f"(rollouts_per_example = {self.rollouts_per_example})"
                )
            if self.max_off_policy_steps is not None and self.max_off_policy_steps < self.async_level:
                raise ValueError(
                    f"max_off_policy_steps ({self.max_off_policy_steps}) < async_level ({self.async_level}) would "
                    "drop rollouts of the very policy the step is allowed to use"
                )
        return self
