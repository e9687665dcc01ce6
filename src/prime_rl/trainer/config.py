"""Config sections shared by the RL trainer and SFT (optimizer, schedule). Imports no torch."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from prime_rl.utils.config import Section


class OptimConfig(Section):
    lr: Annotated[float, Field(gt=0, description="AdamW learning rate (peak, after warmup)")] = 1e-6
    weight_decay: Annotated[float, Field(ge=0, description="AdamW weight decay")] = 0.0
    betas: Annotated[tuple[float, float], Field(description="AdamW betas")] = (0.9, 0.999)
    max_norm: Annotated[float, Field(gt=0, description="gradient-norm clipping threshold")] = 1.0
    scheduler: Annotated[
        Literal["constant", "linear", "cosine"],
        Field(description="learning-rate schedule after warmup: constant, or decay to 0 at max_steps"),
    ] = "constant"
    warmup_steps: Annotated[int, Field(ge=0, description="steps of linear warmup from 0 to lr")] = 0
