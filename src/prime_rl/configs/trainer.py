"""Config of the RL `trainer`. Imports no torch."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, StrictBool, model_validator
from pydantic_settings import NoDecode

from prime_rl.configs import OutputDir, Section, WeightTransferConfig
from prime_rl.configs.base import FieldError
from prime_rl.configs.fields import FLAG_TABLE
from prime_rl.configs.shared import WEIGHT_BROADCAST_MOVED, EnvVars, ParityConfig, SelfHangTimeout
from prime_rl.configs.training import TrainingConfig

# A custom loss's keyword argument: a flag's text that reads as a number or a bool becomes one (tried in order)
KwargValue = Annotated[
    StrictBool | int | float | bool | str | list[Any] | dict[str, Any], Field(union_mode="left_to_right")
]


GSPO_CLIP = (3e-4, 4e-4)  # the GSPO paper's clip range, left and right (Zheng et al. 2025, §5.1)


class MaskConfig(Section):
    """Masks on the importance ratio r = pi/mu (trained policy over sampling policy), for every loss type: a
    masked token gets no gradient (its whole per-token term is dropped) but still counts in the normaliser N.
    All off by default."""

    token_low: Annotated[
        float | None,
        Field(ge=0, description="token band: tokens with r below this are masked (IcePop-style); unset = 0"),
    ] = None
    token_high: Annotated[
        float | None, Field(gt=0, description="token band: tokens with r above this are masked; unset = no upper bound")
    ] = None
    sequence_low: Annotated[
        float | None,
        Field(
            ge=0,
            description="sequence band: a sample whose geometric-mean ratio exp(mean log r over its loss tokens) is "
            "below this is masked whole (masked importance sampling); unset = 0",
        ),
    ] = None
    sequence_high: Annotated[
        float | None,
        Field(gt=0, description="sequence band: a sample whose geometric-mean ratio is above this is masked whole"),
    ] = None
    tv_max: Annotated[
        float | None,
        Field(
            gt=0,
            le=1,
            description="binary-TV mask: tokens with |pi_t - mu_t| (the sampled token's probability under each "
            "policy: the total variation over {sampled token, rest}) above this are masked; unset = off",
        ),
    ] = None

    @model_validator(mode="after")
    def _bands_ordered(self):
        for name in ("token", "sequence"):
            low, high = getattr(self, f"{name}_low"), getattr(self, f"{name}_high")
            if low is not None and high is not None and not low < high:
                raise ValueError(f"loss.mask.{name}_low ({low}) must be below loss.mask.{name}_high ({high})")
            # A band that leaves out r = 1 masks every token of an on-policy step (r is 1 up to engine noise):
            # the gradient is 0 while AdamW keeps stepping on its momentum.
            if low is not None and low > 1:
                raise FieldError(f"{name}_low", f"{low} > 1 masks every token whose ratio pi/mu is 1 (all of an "
                                 "on-policy step's): the band must hold 1")  # fmt: skip
            if high is not None and high < 1:
                raise FieldError(f"{name}_high", f"{high} < 1 masks every token whose ratio pi/mu is 1 (all of an "
                                 "on-policy step's): the band must hold 1")  # fmt: skip
        return self


class LossConfig(Section):
    type: Annotated[
        Literal["aipo", "ppo", "gspo", "custom"],
        Field(
            description="aipo = token ratio pi/mu truncated at max_ratio (default); ppo = GRPO/PPO two-sided clip "
            "of the token ratio; gspo = two-sided clip of the sequence-level ratio; custom = the function at "
            "loss.import_path (docs/trainer.md: its signature)"
        ),
    ] = "aipo"
    max_ratio: Annotated[
        float, Field(gt=0, description="aipo: importance ratio pi/mu is truncated at this value (token level)")
    ] = 8.0
    clip_low: Annotated[
        float,
        Field(ge=0, lt=1, description="ppo/gspo: ratio clipped below at 1 - clip_low (default: ppo 0.2, gspo 3e-4 "
              "as in the GSPO paper)"),
    ] = 0.2  # fmt: skip
    clip_high: Annotated[
        float,
        Field(ge=0, description="ppo/gspo: ratio clipped above at 1 + clip_high (default: ppo 0.2, gspo 4e-4 as in "
              "the GSPO paper)"),
    ] = 0.2  # fmt: skip
    norm: Annotated[
        Literal["token", "sequence"],
        Field(description="token = every loss token of the step weighs the same; sequence = every sample does "
              "(gspo: always sequence)"),
    ] = "token"  # fmt: skip
    kl_coef: Annotated[
        float, Field(ge=0, description="weight of a KL(pi||mu) penalty per token (kl_type); 0 = off")
    ] = 0.0
    kl_type: Annotated[
        Literal["k3", "k2"],
        Field(description="KL penalty estimator: k3 = mu/pi - 1 - log(mu/pi); k2 = (log pi/mu)^2 / 2"),
    ] = "k3"
    entropy_coef: Annotated[float, Field(ge=0, description="weight of an entropy bonus per token; 0 = off")] = 0.0
    max_token_lag: Annotated[
        int | None,
        Field(
            ge=0,
            description="tokens sampled by a policy more than this many steps older than the trained step are "
            "masked (counted in is_masked/lag); unset = off",
        ),
    ] = None
    mask: Annotated[MaskConfig, Field(description="importance-ratio masks (token band, sequence band, binary TV)")] = (
        MaskConfig()
    )
    import_path: Annotated[
        str | None,
        Field(
            pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
            description="custom: 'package.module:function', imported once at trainer start, called with "
            "(LossInputs, **kwargs) for the per-token loss [1, L]",
        ),
    ] = None
    kwargs: Annotated[
        dict[str, KwargValue],
        FLAG_TABLE,
        Field(
            description="custom: keyword arguments passed to the function (flags: --loss.kwargs.NAME VALUE; a "
            "value that reads as a number or true/false is one)"
        ),
    ] = {}

    @model_validator(mode="after")
    def _gspo_is_the_papers(self):
        """GSPO (Zheng et al. 2025) averages each sample's clipped sequence-ratio term over its tokens and the
        samples equally (norm "sequence": 1/|y_i| per token), with clip range [1 - 3e-4, 1 + 4e-4] (a geometric
        mean ratio sits far closer to 1 than a token's). Unset, `norm` and the clips take those values; a token
        norm, which would weigh a sample by its length, is refused."""
        if self.type != "gspo":
            return self
        if "norm" in self.model_fields_set and self.norm == "token":
            raise FieldError(
                "norm",
                "'token' with loss.type = 'gspo' weighs each sample by its length, which GSPO's sequence-level "
                "objective does not (every sample weighs the same): drop loss.norm (gspo uses 'sequence') or use "
                "loss.type = 'ppo'",
                also=("type",),
            )
        self.__dict__["norm"] = "sequence"
        for name, paper in (("clip_low", GSPO_CLIP[0]), ("clip_high", GSPO_CLIP[1])):
            if name not in self.model_fields_set:
                self.__dict__[name] = paper
        return self

    @model_validator(mode="after")
    def _custom_has_path(self):
        if self.type == "custom" and self.import_path is None:
            raise ValueError("loss.type = 'custom' needs loss.import_path = 'package.module:function'")
        if self.type != "custom" and (self.import_path is not None or self.kwargs):
            raise ValueError(f"loss.import_path / loss.kwargs are for loss.type = 'custom', not '{self.type}'")
        return self


class DataConfig(Section):
    timeout: Annotated[float, Field(gt=0, description="seconds to wait for a step's rank file")] = 3600.0
    heartbeat_timeout: Annotated[
        float, Field(gt=0, description="an orchestrator heartbeat older than this means it is dead")
    ] = 120.0
    keep_rollouts: Annotated[int, Field(ge=1, description="newest rollout steps kept on disk")] = 2
    fake: Annotated[
        bool, Field(description="train on generated packed rows instead of rollouts (benchmarks, smoke tests)")
    ] = False
    fake_seq_len: Annotated[int, Field(ge=1, description="fake data: tokens per packed row")] = 2048
    fake_micro_batches: Annotated[int, Field(ge=1, description="fake data: packed rows per rank and step")] = 2
    fake_min_len: Annotated[int, Field(ge=2, description="fake data: shortest sample")] = 16
    fake_max_len: Annotated[int, Field(ge=2, description="fake data: longest sample")] = 512


class TrainerConfig(TrainingConfig):
    """FSDP2 RL trainer: reads packed rollouts, updates the policy, writes HF weights every step."""

    moved_keys: ClassVar[dict[str, str]] = WEIGHT_BROADCAST_MOVED

    output_dir: OutputDir
    max_steps: Annotated[int, Field(ge=1, description="optimizer steps to run")] = 20
    async_level: Annotated[
        int, Field(ge=0, description="orchestrator lag; the newest async_level + 1 weight steps are kept")
    ] = 1
    loss: Annotated[LossConfig, Field(description="RL loss")] = LossConfig()
    data: Annotated[DataConfig, Field(description="reading rollouts")] = DataConfig()
    hang_timeout: SelfHangTimeout = None
    env_vars: EnvVars = {}
    keep_weights: Annotated[
        int | None, Field(ge=1, description="newest weight steps kept on disk; unset = async_level + 1")
    ] = None
    weight_transfer: Annotated[
        WeightTransferConfig, NoDecode, Field(description="how new weights reach inference; broadcast: the rendezvous")
    ] = WeightTransferConfig()
    parity: Annotated[
        ParityConfig, Field(description="the parity gate: the trainer scores the canaries at gate steps")
    ] = ParityConfig()
    bench: Annotated[
        bool, Field(description="benchmark: no weights or checkpoints written; print step time, tokens/s, MFU")
    ] = False
    bench_peak_tflops: Annotated[
        float | None, Field(gt=0, description="device peak TFLOP/s for MFU; unset = known GPUs only")
    ] = None

    @model_validator(mode="after")
    def _lag_mask_keeps_tokens(self):
        # Step n's tokens come from policy n - async_level or older (the orchestrator loads newer weights only when
        # it must), so a smaller max_token_lag masks every token from step async_level on: grad norm 0 while AdamW
        # keeps stepping on its momentum.
        lag = self.loss.max_token_lag
        if lag is not None and lag < self.async_level:
            raise FieldError(
                "loss.max_token_lag",
                f"{lag} < async_level ({self.async_level}) masks every token from step {self.async_level} on (they "
                "are async_level steps old or older): set it to at least async_level, or unset it",
                also=("async_level",),
            )
        return self

    @model_validator(mode="after")
    def _lora_reproducible(self):
        lora = self.model.lora
        if lora is not None and lora.dropout > 0:
            raise ValueError(
                f"model.lora.dropout = {lora.dropout}: with adapter dropout the trainer's logprobs are not the "
                "served policy's, which RL's importance ratios need; set it to 0 (SFT accepts it)"
            )
        if lora is not None and self.weight_transfer.type == "broadcast":
            raise ValueError(
                "model.lora with weight_transfer = broadcast: adapters reach the servers as files (a few MB); "
                "use weight_transfer = filesystem"
            )
        return self
