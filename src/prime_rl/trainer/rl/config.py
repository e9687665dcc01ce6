"""Config of the RL `trainer`. Imports no torch."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from prime_rl.utils.config import BaseConfig, CkptConfig, LogConfig, ModelConfig, Section


class OptimConfig(Section):
    lr: Annotated[float, Field(gt=0, description="AdamW learning rate")] = 1e-6
    weight_decay: Annotated[float, Field(ge=0, description="AdamW weight decay")] = 0.0
    betas: Annotated[tuple[float, float], Field(description="AdamW betas")] = (0.9, 0.999)
    max_norm: Annotated[float, Field(gt=0, description="gradient-norm clipping threshold")] = 1.0


class LossConfig(Section):
    max_ratio: Annotated[
        float, Field(gt=0, description="importance ratio pi/mu is truncated at this value (token level)")
    ] = 8.0


class DataConfig(Section):
    timeout: Annotated[float, Field(gt=0, description="seconds to wait for a step's rank file")] = 3600.0
    heartbeat_timeout: Annotated[
        float, Field(gt=0, description="an orchestrator heartbeat older than this means it is dead")
    ] = 120.0
    keep_rollouts: Annotated[int, Field(ge=1, description="newest rollout steps kept on disk")] = 2


class TrainerConfig(BaseConfig):
    """FSDP2 RL trainer: reads packed rollouts, updates the policy, writes HF weights every step."""

    model: Annotated[ModelConfig, Field(description="the policy model")] = ModelConfig()
    output_dir: Annotated[Path, Field(description="shared output directory")] = Path("outputs")
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
    optim: Annotated[OptimConfig, Field(description="optimizer")] = OptimConfig()
    loss: Annotated[LossConfig, Field(description="RL loss")] = LossConfig()
    data: Annotated[DataConfig, Field(description="reading rollouts")] = DataConfig()
    keep_weights: Annotated[
        int | None, Field(ge=1, description="newest weight steps kept on disk; unset = async_level + 1")
    ] = None
    ckpt: Annotated[CkptConfig | None, Field(description="checkpointing; off unless --ckpt is given")] = None
    log: Annotated[LogConfig, Field(description="logging")] = LogConfig()
