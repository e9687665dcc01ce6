"""The deployment guide's script paths (docs/usage.md: `uv run torchrun ... src/prime_rl/trainer/{sft,rl}/train.py`)
train, as their entrypoints do. They used to import their functions and exit 0 in seconds having done nothing.

Each test takes its line from the doc (so a changed line is what runs) and runs it from a scratch directory that
links the repo's configs/, assets/ and src/; only the reader's placeholders are filled in, as each test says."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
BIN = Path(sys.executable).parent
TIMEOUT_S = 300


def guide_line(script: str) -> str:
    """The first command line of docs/usage.md's bash blocks that runs `script` (continuations joined)."""
    text, in_bash, joined = (ROOT / "docs" / "usage.md").read_text().splitlines(), False, ""
    for line in text:
        if line.startswith("```"):
            in_bash = line.startswith("```bash")
            continue
        if not in_bash:
            continue
        joined += line.rstrip().removesuffix("\\") + " " if line.rstrip().endswith("\\") else line
        if not line.rstrip().endswith("\\"):
            command, joined = re.split(r"\s#\s", joined)[0].strip(), ""
            if script in command.split():
                return command
    raise AssertionError(f"docs/usage.md has no command line running {script}")


@pytest.fixture
def scratch(tmp_path) -> Path:
    for name in ("configs", "assets", "src"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def run(command: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    assert argv[:3] == ["uv", "run", "torchrun"], command
    argv = [str(BIN / "torchrun"), *argv[3:]]  # `uv run torchrun` is the venv's torchrun
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(argv, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=TIMEOUT_S)


def test_guide_sft_script_path_trains(scratch):
    """`uv run torchrun src/prime_rl/trainer/sft/train.py @ path/to/train.toml`, the reader's config being the
    debug one, cut to 2 steps."""
    line = guide_line("src/prime_rl/trainer/sft/train.py")
    assert line == "uv run torchrun src/prime_rl/trainer/sft/train.py @ path/to/train.toml"
    result = run(line.replace("path/to/train.toml", "configs/sft/debug.toml") + " --max-steps 2", scratch)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (scratch / "outputs/sft-debug/weights/final").resolve().name == "step_2"
    assert "steps        2/2" in result.stdout + result.stderr


def test_guide_rl_trainer_script_path_trains(scratch):
    """The multi-node trainer line, `... --output-dir $OUTPUT_DIR`: the reader's `...` is the debug trainer config on
    generated data (no orchestrator here), one step, and one rank instead of 8 (2 CPU cores)."""
    line = guide_line("src/prime_rl/trainer/rl/train.py")
    expected = (
        "uv run torchrun --nproc-per-node 8 --local-ranks-filter 0 src/prime_rl/trainer/rl/train.py ... "
        " --output-dir $OUTPUT_DIR"
    )
    assert line.split() == expected.split()
    fill = "@ configs/debug/train.toml --data.fake --max-steps 1 --data.fake-seq-len 64 --data.fake-micro-batches 1"
    command = line.replace("--nproc-per-node 8", "--nproc-per-node 1").replace(" ... ", f" {fill} ")
    output_dir = scratch / "shared-run"
    result = run(command.replace("$OUTPUT_DIR", str(output_dir)), scratch, {"OUTPUT_DIR": str(output_dir)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert (output_dir / "weights/step_1/STABLE").is_file(), sorted(p.name for p in output_dir.rglob("*"))
    assert "done: 1 steps" in result.stdout + result.stderr
