"""Every service's config, and the `rl` composition of three of them (docs/design.md §1).

Torch-free by contract (`lint-imports`): an entrypoint parses its config and answers `--help` before it
imports anything heavy. The service configs live in their own modules (`configs.inference`,
`configs.orchestrator`, `configs.trainer`, `configs.sft`, `configs.eval`, `configs.slurm`, `configs.rl`);
this package exports the bases, the command line and the sections they share.
"""

from prime_rl.configs.base import (
    ENV_PREFIX,
    OUTPUT_DIR_VAR,
    SECRET_FIELDS,
    BaseConfig,
    ConfigError,
    OutputDir,
    OutputPath,
    Section,
    default_output_dir,
    to_toml_dict,
)
from prime_rl.configs.cli import (
    deep_merge,
    format_validation_error,
    help_text,
    load_config,
    parse_args,
    parse_config,
)
from prime_rl.configs.shared import (
    LORA_TARGETS,
    CkptConfig,
    LogConfig,
    LoraConfig,
    ModelConfig,
    PrometheusConfig,
    WeightTransferConfig,
)

__all__ = [
    "ENV_PREFIX",
    "LORA_TARGETS",
    "OUTPUT_DIR_VAR",
    "SECRET_FIELDS",
    "BaseConfig",
    "CkptConfig",
    "ConfigError",
    "LogConfig",
    "LoraConfig",
    "ModelConfig",
    "PrometheusConfig",
    "OutputDir",
    "OutputPath",
    "Section",
    "WeightTransferConfig",
    "deep_merge",
    "default_output_dir",
    "format_validation_error",
    "help_text",
    "load_config",
    "parse_args",
    "parse_config",
    "to_toml_dict",
]
