"""The config system: precedence, flag syntax, readable errors (DESIGN §1)."""

import subprocess
import sys
from pathlib import Path
from typing import Annotated

import pytest
from pydantic import Field

from prime_rl.configs import BaseConfig, ConfigError, Section, load_config


class Optim(Section):
    lr: Annotated[float, Field(description="learning rate")] = 1e-3
    max_norm: Annotated[float, Field(description="clip")] = 1.0


class Ckpt(Section):
    interval: Annotated[int, Field(description="every n steps")] = 10


class Demo(BaseConfig):
    optim: Annotated[Optim, Field(description="optimizer")] = Optim()
    ckpt: Annotated[Ckpt | None, Field(description="checkpointing")] = None
    ids: Annotated[list[int], Field(description="ids")] = [0]
    verbose: Annotated[bool, Field(description="chatty")] = False
    name: Annotated[str, Field(description="name")] = "default"


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_precedence_is_cli_over_later_toml_over_earlier_toml_over_env_over_default(tmp_path, monkeypatch):
    a = write(tmp_path, "a.toml", 'name = "a"\n[optim]\nlr = 0.1\nmax_norm = 2.0\n')
    b = write(tmp_path, "b.toml", "[optim]\nlr = 0.2\n")
    monkeypatch.setenv("PRIME_OPTIM__MAX_NORM", "5.0")
    monkeypatch.setenv("PRIME_NAME", "env")
    monkeypatch.setenv("PRIME_VERBOSE", "true")
    config = load_config(Demo, ["@", a, "@", b, "--optim.lr", "0.3"])
    assert config.optim.lr == 0.3  # flag beats both files
    assert config.optim.max_norm == 2.0  # file beats env
    assert config.name == "a"
    assert config.verbose is True  # env beats default
    assert load_config(Demo, ["@", a, "@", b]).optim.lr == 0.2  # later file wins


def test_kebab_flags_booleans_lists_and_optional_sections():
    config = load_config(Demo, ["--optim.max-norm", "0.5", "--verbose", "--ids", "1,2", "--ids", "3", "--ckpt"])
    assert config.optim.max_norm == 0.5
    assert config.verbose is True
    assert config.ids == [1, 2, 3]
    assert config.ckpt == Ckpt()
    assert load_config(Demo, ["--verbose", "--no-verbose"]).verbose is False
    assert load_config(Demo, ["--ckpt.interval=3"]).ckpt.interval == 3
    # A bare --ckpt after one of its fields switches it on without dropping that field.
    assert load_config(Demo, ["--ckpt.interval", "3", "--ckpt"]).ckpt.interval == 3
    assert load_config(Demo, []).ckpt is None


def test_section_can_come_from_its_own_file(tmp_path):
    optim = write(tmp_path, "optim.toml", "lr = 0.5\n")
    assert load_config(Demo, ["--optim", "@", optim]).optim.lr == 0.5


def test_errors_name_key_and_source_one_line_each(tmp_path):
    bad = write(tmp_path, "bad.toml", "[optim]\nlr = 'fast'\nmomentum = 0.9\n")
    with pytest.raises(ConfigError) as err:
        load_config(Demo, ["@", bad, "--ids", "x", "--nope", "1"])
    lines = err.value.lines
    assert "unknown option --nope (flag); see --help" in lines
    assert any(line.startswith("optim.lr:") and f"[{bad}]" in line for line in lines)
    assert any(line.startswith("optim.momentum: unknown key") and f"[{bad}]" in line for line in lines)
    assert any(line.startswith("ids:") and "[flag --ids]" in line for line in lines)
    assert len(lines) == 4


def test_missing_file_and_invalid_toml_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: nowhere.toml"):
        load_config(Demo, ["@", "nowhere.toml"])
    broken = write(tmp_path, "broken.toml", "lr = = 1")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(Demo, ["@", broken])


@pytest.mark.parametrize("command", ["trainer", "orchestrator", "inference", "rl"])
def test_entrypoint_bad_config_exits_2_with_readable_lines(command, tmp_path):
    bad = write(tmp_path, "bad.toml", "max_stepz = 3\n")
    module = {"trainer": "prime_rl.entrypoints.trainer", "orchestrator": "prime_rl.entrypoints.orchestrator",
              "inference": "prime_rl.entrypoints.inference", "rl": "prime_rl.entrypoints.rl"}[command]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", module, "@", bad, "--no-such-flag", "1"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "unknown option --no-such-flag (flag)" in result.stderr
    assert "max_stepz: unknown key" in result.stderr


def test_help_lists_every_field_with_description_and_default():
    result = subprocess.run(
        [sys.executable, "-m", "prime_rl.entrypoints.trainer", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    assert "--optim.lr VALUE  AdamW learning rate (peak, after warmup) (default: 1e-06)" in result.stdout
    assert "--max-steps VALUE" in result.stdout


def test_every_shipped_toml_parses():
    from prime_rl.configs.eval import EvalConfig
    from prime_rl.configs.inference import InferenceConfig
    from prime_rl.configs.orchestrator import OrchestratorConfig
    from prime_rl.configs.rl import RLConfig
    from prime_rl.configs.sft import SFTConfig
    from prime_rl.configs.trainer import TrainerConfig

    by_prefix = {"rl": RLConfig, "infer": InferenceConfig, "orch": OrchestratorConfig, "train": TrainerConfig,
                 "eval": EvalConfig, "sft": SFTConfig}  # fmt: skip
    files = sorted(Path(__file__).parents[3].joinpath("configs").rglob("*.toml"))
    assert files
    for path in files:
        # configs/sft/ holds `sft` configs whatever their name; elsewhere the name says the entrypoint.
        cls = SFTConfig if "sft" in path.parts else next(c for p, c in by_prefix.items() if path.stem.startswith(p))
        load_config(cls, ["@", str(path)])


def test_run_configs_never_hold_the_api_key(tmp_path, monkeypatch):
    """run/*.toml records the env var's name, never the key (it was written in plain text, mode 0644)."""
    from prime_rl.configs.inference import InferenceConfig
    from prime_rl.utils.run_record import write_run_config

    monkeypatch.setenv("MY_KEY", "s3cr3t-from-env")
    for config in (InferenceConfig(api_key="s3cr3t-given"), InferenceConfig(api_key_var="MY_KEY")):
        path = write_run_config(config, "inference", tmp_path)
        assert "s3cr3t" not in path.read_text()
    assert 'api_key_var = "MY_KEY"' in path.read_text()


def test_mistyped_flag_exits_2_suggesting_the_nearest_key(capsys):
    from prime_rl.configs import parse_config  # here, not at the top: the import lines are shared
    from prime_rl.configs.rl import RLConfig

    with pytest.raises(SystemExit) as exit_:
        parse_config(Demo, ["--optim.max-nrom", "1", "--no-verbos", "--nope", "1"], prog="demo")
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "demo: config error: unknown option --optim.max-nrom (flag); see --help (did you mean --optim.max-norm?)",
        "demo: config error: unknown option --no-verbos (flag); see --help (did you mean --no-verbose?)",
        "demo: config error: unknown option --nope (flag); see --help",  # nothing close: no guess
    ]
    with pytest.raises(ConfigError) as err:  # at any depth of a real config, vLLM flag aliases included
        load_config(RLConfig, ["--trainer.optim.max-nrom", "1", "--inference.tensor-parallel-sise", "2"])
    assert err.value.lines == [
        "unknown option --trainer.optim.max-nrom (flag); see --help (did you mean --trainer.optim.max-norm?)",
        "unknown option --inference.tensor-parallel-sise (flag); see --help"
        " (did you mean --inference.tensor-parallel-size?)",
    ]


def test_mistyped_toml_key_exits_2_naming_the_file_and_the_nearest_key(tmp_path, capsys):
    from prime_rl.configs import parse_config  # here, not at the top: the import lines are shared

    bad = write(tmp_path, "bad.toml", "[optim]\nmax_nrom = 2.0\n")
    with pytest.raises(SystemExit) as exit_:
        parse_config(Demo, ["@", bad], prog="demo")
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"demo: config error: optim.max_nrom: unknown key [{bad}] (did you mean optim.max_norm?)"
    ]
