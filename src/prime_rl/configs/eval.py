"""Config of the `eval` entrypoint. Imports no torch."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from prime_rl.configs import BaseConfig, LogConfig, ModelConfig, OutputPath
from prime_rl.configs.orchestrator import ClientConfig, SamplingConfig


class EvalConfig(BaseConfig):
    """Evaluates environments against an inference server, optionally for every weights/step_n."""

    model: Annotated[ModelConfig, Field(description="the model the server serves")] = ModelConfig()
    output_dir: Annotated[OutputPath, Field(description="where eval/ results go")] = Path("outputs/eval")
    env_ids: Annotated[
        list[str], Field(min_length=1, description="environments to evaluate (built-in names or module:function)")
    ] = ["arithmetic"]
    env_args: Annotated[
        dict[str, dict[str, Any]], Field(description="keyword arguments per environment id ([env_args.<id>])")
    ] = {}
    num_examples: Annotated[int, Field(ge=1, description="examples per environment")] = 32
    rollouts_per_example: Annotated[int, Field(ge=1, description="samples per example (k of pass@k)")] = 1
    seed: Annotated[int, Field(description="seed of the examples drawn")] = 1234
    seq_len: Annotated[int, Field(ge=1, description="most tokens of a multi-turn conversation")] = 4096
    max_turns: Annotated[int | None, Field(ge=1, description="most model turns; unset = the env's")] = None
    sampling: Annotated[SamplingConfig, Field(description="sampling parameters")] = SamplingConfig()
    client: Annotated[ClientConfig, Field(description="inference client")] = ClientConfig()
    weights_dir: Annotated[
        Path | None,
        Field(description="a weights/ folder: evaluate every STABLE step_n in it (or --steps); unset = as served"),
    ] = None
    steps: Annotated[list[int] | None, Field(description="only these steps of --weights-dir (0 = the base model)")] = (
        None
    )
    serve: Annotated[
        bool,
        Field(description="start a local inference server for model.name (built-in engine on CPU) and stop it after"),
    ] = False
    log: Annotated[LogConfig, Field(description="logging")] = LogConfig()
