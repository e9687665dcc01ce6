"""Config of `sft` (supervised fine-tuning). Imports no torch."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from prime_rl.configs import OutputPath, Section
from prime_rl.configs.shared import CHECK_MODEL_PATHS, ShowsValue, StepLogConfig, WandbConfig
from prime_rl.configs.slurm import SlurmConfig
from prime_rl.configs.training import OptimConfig, TrainingConfig


class SFTDataConfig(Section):
    path: Annotated[Path | None, Field(description="local .jsonl or .parquet file of training rows")] = None
    name: Annotated[str | None, Field(description="Hugging Face datasets name (used when path is unset)")] = None
    env_id: Annotated[
        str | None,
        Field(description="an environment (as the orchestrator's env.id): its prompts with their reference answers"),
    ] = None
    env_args: Annotated[dict, Field(description="keyword arguments of the environment")] = {}
    env_examples: Annotated[int, Field(ge=1, description="rows drawn from the environment")] = 1000
    env_seed: Annotated[int, Field(description="seed of the environment's examples (not the RL or eval seed)")] = 1
    split: Annotated[str, Field(description="datasets split (with name)")] = "train"
    prompt_column: Annotated[str, Field(description="column with the prompt: a string or a list of messages")] = (
        "prompt"
    )
    completion_column: Annotated[
        str, Field(description="column with the completion: a string or a list of assistant messages")
    ] = "completion"
    messages_column: Annotated[
        str,
        Field(
            description="column with a whole conversation, used when a row has no prompt column; loss on every "
            "assistant turn"
        ),  # fmt: skip
    ] = "messages"
    shuffle: Annotated[bool, Field(description="reshuffle the rows every epoch (seeded)")] = True

    @field_validator("path")
    @classmethod
    def _readable(cls, path: Path | None) -> Path | None:
        # At parse (exit 2), not after the model loaded (it was exit 1, seconds later).
        if path is not None and path.suffix not in (".jsonl", ".parquet"):
            raise ValueError("expected a .jsonl or .parquet file")
        if path is not None and CHECK_MODEL_PATHS.get() and not path.is_file():
            raise ShowsValue(f"no such file: {path}")
        return path

    @model_validator(mode="after")
    def _one_source(self):
        if sum(x is not None for x in (self.path, self.name, self.env_id)) != 1:
            raise ValueError(
                "set exactly one of data.path (local file), data.name (HF datasets name) and data.env-id "
                "(an environment's reference answers)"
            )
        return self


class SFTValConfig(Section):
    """Held-out loss every `interval` steps, and optionally an early stop on it."""

    data: Annotated[SFTDataConfig, Field(description="held-out rows (any source `data` takes)")]
    interval: Annotated[int, Field(ge=1, description="steps between held-out evaluations (and at the last step)")] = 50
    stop_below: Annotated[
        float | None,
        Field(
            gt=0,
            description="end the run at the first evaluation whose held-out loss is below this: a quality "
            "target that holds on any machine, however many steps it takes there; unset = run all steps",
        ),
    ] = None


class SFTConfig(TrainingConfig):
    """FSDP2 supervised fine-tuning on prompt-completion data; loss only on completion tokens."""

    output_dir: Annotated[OutputPath, Field(description="weights/, checkpoints/, logs/sft.log, metrics/sft.jsonl")] = (
        Path("outputs/sft")
    )
    data: Annotated[SFTDataConfig, Field(description="training data")] = SFTDataConfig(path=Path("data.jsonl"))
    seq_len: Annotated[int, Field(ge=8, description="tokens per packed row; longer samples are truncated")] = 2048
    batch_size: Annotated[int, Field(ge=1, description="samples per optimizer step, over all ranks")] = 32
    max_steps: Annotated[int | None, Field(ge=1, description="optimizer steps; unset = epochs over the data")] = None
    epochs: Annotated[int, Field(ge=1, description="passes over the data when max_steps is unset")] = 1
    optim: Annotated[OptimConfig, Field(description="optimizer")] = OptimConfig(lr=1e-5)
    weights_interval: Annotated[
        int | None, Field(ge=1, description="write weights/step_n every n steps; unset = only at the end")
    ] = None
    keep_weights: Annotated[int | None, Field(ge=1, description="newest weight steps kept on disk; unset = all")] = None
    val: Annotated[SFTValConfig | None, Field(description="held-out loss and early stopping; off unless [val]")] = None
    log: Annotated[StepLogConfig, Field(description="logging")] = StepLogConfig()
    wandb: Annotated[
        WandbConfig | None,
        Field(description="also log each step's metrics and the config to W&B (needs `uv sync --extra wandb`)"),
    ] = None
    slurm: Annotated[SlurmConfig | None, Field(description="submit as a Slurm job instead (docs/slurm.md)")] = None
