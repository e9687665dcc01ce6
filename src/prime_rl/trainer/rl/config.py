"""Config of the RL `trainer`. Imports no torch."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from prime_rl.trainer.config import OptimConfig
from prime_rl.utils.config import (
    BaseConfig,
    CkptConfig,
    LogConfig,
    ModelConfig,
    OutputDir,
    Section,
    WeightBroadcastConfig,
    WeightTransfer,
)


class LossConfig(Section):
    type: Annotated[
        Literal["aipo", "ppo", "gspo"],
        Field(
            description="aipo = token ratio pi/mu truncated at max_ratio (default); ppo = GRPO/PPO two-sided clip "
            "of the token ratio; gspo = two-sided clip of the sequence-level ratio"
        ),
    ] = "aipo"
    max_ratio: Annotated[
        float, Field(gt=0, description="aipo: importance ratio pi/mu is truncated at this value (token level)")
    ] = 8.0
    clip_low: Annotated[
        float, Field(ge=0, lt=1, description="ppo/gspo: ratio clipped below at 1 - clip_low (GSPO paper: 3e-4)")
    ] = 0.2
    clip_high: Annotated[
        float, Field(ge=0, description="ppo/gspo: ratio clipped above at 1 + clip_high (GSPO paper: 4e-4)")
    ] = 0.2
    norm: Annotated[
        Literal["token", "sequence"],
        Field(description="token = every loss token of the step weighs the same; sequence = every sample does"),
    ] = "token"
    kl_coef: Annotated[float, Field(ge=0, description="weight of a k3 KL(pi||mu) penalty per token; 0 = off")] = 0.0
    entropy_coef: Annotated[float, Field(ge=0, description="weight of an entropy bonus per token; 0 = off")] = 0.0


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


class TrainerConfig(BaseConfig):
    """FSDP2 RL trainer: reads packed rollouts, updates the policy, writes HF weights every step."""

    model: Annotated[ModelConfig, Field(description="the policy model")] = ModelConfig()
    output_dir: OutputDir
    max_steps: Annotated[int, Field(ge=1, description="optimizer steps to run")] = 20
    async_level: Annotated[
        int, Field(ge=0, description="orchestrator lag; the newest async_level + 1 weight steps are kept")
    ] = 1
    device: Annotated[Literal["auto", "cpu", "cuda"], Field(description="auto = CUDA when present")] = "auto"
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16"], Field(description="parameter dtype; auto = fp32 on CPU, bf16 on CUDA")
    ] = "auto"
    seed: Annotated[int, Field(description="torch seed")] = 0
    activation_checkpointing: Annotated[
        bool, Field(description="recompute each decoder layer's activations in backward (less memory, ~30% slower)")
    ] = False
    compile: Annotated[
        bool,
        Field(description="torch.compile each decoder layer (fused elementwise ops; the first step compiles, ~30 s)"),
    ] = False
    cpu_offload: Annotated[
        bool, Field(description="CUDA: keep sharded params, grads and optimizer state in host memory")
    ] = False
    optim: Annotated[OptimConfig, Field(description="optimizer")] = OptimConfig()
    loss: Annotated[LossConfig, Field(description="RL loss")] = LossConfig()
    data: Annotated[DataConfig, Field(description="reading rollouts")] = DataConfig()
    keep_weights: Annotated[
        int | None, Field(ge=1, description="newest weight steps kept on disk; unset = async_level + 1")
    ] = None
    ckpt: Annotated[CkptConfig | None, Field(description="checkpointing; off unless --ckpt is given")] = None
    weight_transfer: WeightTransfer = "filesystem"
    weight_broadcast: Annotated[WeightBroadcastConfig, Field(description="weight_transfer = broadcast")] = (
        WeightBroadcastConfig()
    )
    bench: Annotated[
        bool, Field(description="benchmark: no weights or checkpoints written; print step time, tokens/s, MFU")
    ] = False
    bench_peak_tflops: Annotated[
        float | None, Field(gt=0, description="device peak TFLOP/s for MFU; unset = known GPUs only")
    ] = None
    log: Annotated[LogConfig, Field(description="logging")] = LogConfig()
