"""Config shared by the RL trainer and SFT: the optimizer and every common field (`TrainingConfig`).
Imports no torch."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from prime_rl.configs import BaseConfig, CkptConfig, LogConfig, ModelConfig, PrometheusConfig, Section


class OptimConfig(Section):
    type: Annotated[
        Literal["adamw", "muon"],
        Field(
            description="adamw: fused AdamW for every trainable parameter; muon: torch's Muon for the 2-D weight "
            "matrices of the decoder layers and fused AdamW for the rest (embeddings, head, norms, biases)"
        ),
    ] = "adamw"
    lr: Annotated[float, Field(gt=0, description="AdamW learning rate (peak, after warmup)")] = 1e-6
    weight_decay: Annotated[float, Field(ge=0, description="AdamW weight decay")] = 0.0
    betas: Annotated[tuple[float, float], Field(description="AdamW betas")] = (0.9, 0.999)
    max_norm: Annotated[float, Field(gt=0, description="gradient-norm clipping threshold")] = 1.0
    scheduler: Annotated[
        Literal["constant", "linear", "cosine"],
        Field(description="learning-rate schedule after warmup: constant, or decay to 0 at max_steps"),
    ] = "constant"
    warmup_steps: Annotated[int, Field(ge=0, description="steps of linear warmup from 0 to lr")] = 0
    muon_lr: Annotated[
        float | None,
        Field(gt=0, description="Muon learning rate (peak, after warmup; same schedule as lr); unset = lr"),
    ] = None
    muon_weight_decay: Annotated[
        float | None, Field(ge=0, description="Muon decoupled weight decay; unset = weight_decay")
    ] = None
    muon_momentum: Annotated[float, Field(ge=0, lt=1, description="Muon momentum")] = 0.95
    muon_nesterov: Annotated[bool, Field(description="Muon: Nesterov momentum")] = True
    muon_ns_steps: Annotated[
        int, Field(ge=1, lt=100, description="Muon: Newton–Schulz iterations orthogonalizing each update")
    ] = 5
    muon_adjust_lr_fn: Annotated[
        Literal["original", "match_rms_adamw"],
        Field(
            description="Muon's per-matrix lr scale: match_rms_adamw (0.2·sqrt(max(rows, cols)), Moonshot) gives "
            "updates of AdamW's size, so AdamW's lr and weight decay carry over; original (sqrt(max(1, rows/cols)), "
            "Keller Jordan) wants a lr around 0.02"
        ),
    ] = "match_rms_adamw"

    @model_validator(mode="after")
    def _muon_settings_need_muon(self):
        # Compared with the defaults, not `model_fields_set`: `rl` hands each service its resolved config as a
        # file with every field written out.
        fields = type(self).model_fields
        muon_only = sorted(k for k in fields if k.startswith("muon_") and getattr(self, k) != fields[k].default)
        if self.type != "muon" and muon_only:
            keys = ", ".join("optim." + k.replace("_", "-") for k in muon_only)
            raise ValueError(f"{keys} apply only with optim.type = 'muon' (it is {self.type!r})")
        return self


class TrainParallelConfig(Section):
    replicate: Annotated[
        int,
        Field(
            ge=1,
            description="HSDP: replicas of the sharded model; the ranks form replicate x (world / replicate), each "
            "replica sharding over consecutive ranks (a node's GPUs), so only gradients cross between replicas",
        ),
    ] = 1


class TrainingConfig(BaseConfig):
    """The fields every trainer (RL `trainer`, `sft`) has, from this one place: the model and how it is
    placed, parallelized and optimized, checkpoints and logging."""

    model: Annotated[ModelConfig, Field(description="the policy model (and its LoRA adapter, if any)")] = ModelConfig()
    device: Annotated[Literal["auto", "cpu", "cuda"], Field(description="auto = CUDA when present")] = "auto"
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16"], Field(description="parameter dtype; auto = fp32 on CPU, bf16 on CUDA")
    ] = "auto"
    seed: Annotated[int, Field(description="torch seed (SFT: also the data order)")] = 0
    activation_checkpointing: Annotated[
        bool, Field(description="recompute each decoder layer's activations in backward (less memory, ~30% slower)")
    ] = False
    compile: Annotated[
        bool,
        Field(description="torch.compile each decoder layer (fused elementwise ops; the first step compiles, ~30 s)"),
    ] = False
    share_prompts: Annotated[
        bool,
        Field(
            description="compute a prompt that several samples of a micro batch share (an RL group's) once, its "
            "completions attending to it; CPU (trainer/prefix.py)"
        ),
    ] = True
    cpu_offload: Annotated[
        bool, Field(description="CUDA: keep sharded params, grads and optimizer state in host memory")
    ] = False
    parallel: Annotated[TrainParallelConfig, Field(description="how the ranks shard the model")] = TrainParallelConfig()
    optim: Annotated[OptimConfig, Field(description="optimizer")] = OptimConfig()
    ckpt: Annotated[CkptConfig | None, Field(description="checkpointing; off unless --ckpt is given")] = None
    log: Annotated[LogConfig, Field(description="logging")] = LogConfig()
    prometheus: Annotated[PrometheusConfig, Field(description="Prometheus /metrics and /health (rank 0)")] = (
        PrometheusConfig()
    )
