"""The base classes every config is built from, and the shared output directory.

Sources, highest precedence first: CLI flags > TOML files (`@ a.toml @ b.toml`, later wins) >
`PRIME_A__B_C` env vars > field defaults (`configs/cli.py` reads the first two). One exception: `$OUTPUT_DIR`
outranks a file's `output_dir` (but not `--output-dir`). This package imports no torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "PRIME_"


class Section(BaseModel):
    """A nested group of settings; unknown keys are errors, and so are inf and nan for any float (an `lr = inf`
    read as a number trained to NaN; a timeout of inf never fires)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class BaseConfig(BaseSettings):
    """Top-level config of one entrypoint."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", validate_assignment=True, allow_inf_nan=False
    )

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, **_other_sources):
        # Init kwargs carry TOML merged with CLI, so they outrank the environment.
        return (init_settings, env_settings)


C = TypeVar("C", bound=BaseModel)


class ConfigError(Exception):
    """A problem with the user's config; `lines` are shown one per line."""

    def __init__(self, lines: list[str]):
        super().__init__("\n".join(lines))
        self.lines = lines


class FieldError(ValueError):
    """A cross-field check that failed at `key` (dotted, relative to the model whose validator raises it): the
    error line names that key and where its value came from, and the sources of the keys in `also` (the other
    side of the check), instead of a line with no key and no source."""

    def __init__(self, key: str, message: str, also: tuple[str, ...] = ()):
        super().__init__(message)
        self.key, self.also = key, also


OUTPUT_DIR_VAR = "OUTPUT_DIR"  # outranks a TOML file's output_dir, not a flag (configs/cli.py:_output_dir_from_env)


def default_output_dir() -> Path:
    """`$OUTPUT_DIR` when set (multi-node runs and scripts/tmux.sh export it), else `outputs`."""
    return Path(os.environ.get(OUTPUT_DIR_VAR) or "outputs")


def _names_a_dir(value: Any) -> Any:
    # Path("") is Path("."): an empty value (a blank `$X` in a script) would make the current directory the
    # output dir, and a fresh run clears rollouts/ and weights/ there.
    if isinstance(value, str) and not value.strip():
        raise ValueError("must name a directory: an empty path would be the current directory")
    return value


def _not_root_or_home(path: Path) -> Path:
    resolved = path.resolve()
    if resolved == Path(resolved.anchor) or resolved == Path.home().resolve():
        raise ValueError("is the filesystem root or the home directory: give a directory of its own for the run")
    return path


# Any output directory: never empty, `/` or the home directory (a run writes and clears step dirs there).
OutputPath = Annotated[Path, BeforeValidator(_names_a_dir), AfterValidator(_not_root_or_home)]

# The `output_dir` field of the three RL services: they must agree on it, so they share its default too
# ($OUTPUT_DIR is checked like a value given).
OutputDir = Annotated[
    OutputPath,
    Field(
        default_factory=default_output_dir,
        validate_default=True,
        description="shared output directory: --output-dir > $OUTPUT_DIR > a TOML file's > outputs",
    ),
]


SECRET_FIELDS = frozenset({"api_key"})  # never written to disk: `api_key_var` (the env var's name) is


def to_toml_dict(config: BaseModel) -> dict:
    """The config as TOML-ready data (TOML has no null, so unset optionals are left out), without secrets."""

    def public(tree: dict) -> dict:
        return {k: public(v) if isinstance(v, dict) else v for k, v in tree.items() if k not in SECRET_FIELDS}

    return public(config.model_dump(mode="json", exclude_none=True))
