"""No value a user gives can become shell in the rendered job script, or a #SBATCH option of its own, and the
script holds no API key. Every value that reaches the script (each `[slurm]` field, the output dir, the working
directory, the Python path, the `# Rendered by` command line) is given shell syntax: `$(...)`, backticks, quotes,
`;`, `&`, `#SBATCH`, a backslash, spaces; the script is then checked by `bash -n`, by sbatch's own parser where
sbatch is installed (`--test-only`: nothing is submitted), and run by bash with srun and scontrol as stubs."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from prime_rl.configs import ConfigError, load_config
from prime_rl.configs.rl import RLConfig
from prime_rl.configs.sft import SFTConfig
from prime_rl.slurm.launch import render, write_job

ROOT = Path(__file__).parents[3]
# Shell that would create MARKER in the directory bash runs in, were any of it run; no "/" so it can name a folder.
HOSTILE = "a b $(touch MARKER) `touch MARKER` 'q' \"dq\" ; touch MARKER & #SBATCH --uid=0 \\ $HOME *"
KEY, OTHER_KEY, ENV_KEY = "sk-flag-0123456789", "sk-inline-9876543210", "sk-env-5555555555"

LAYOUTS = {
    "rl": ("rl", []),
    "rl-nodes-ckpt": ("rl", ["--slurm.inference-nodes", "1", "--slurm.trainer-nodes", "1", "--ckpt.interval", "5",
                             "--slurm.requeue", "--inference.env-vars.HOSTILE_VALUE", HOSTILE]),
    "sft": ("sft", ["--slurm.nodes", "2", "--ckpt.interval", "5"]),
}  # fmt: skip


def hostile_flags(tmp_path: Path) -> list[str]:
    return ["--slurm.job-name", HOSTILE, "--slurm.partition", HOSTILE, "--slurm.account", HOSTILE,
            "--slurm.time", HOSTILE, f"--slurm.extra-sbatch=--comment={HOSTILE}",
            f"--slurm.srun-args=--comment={HOSTILE}", "--slurm.python", str(tmp_path / f"py {HOSTILE}" / "python"),
            "--output-dir", str(tmp_path / f"out {HOSTILE}")]  # fmt: skip


def stubs(tmp_path: Path) -> Path:
    """srun records its arguments (NUL-separated) and runs nothing; scontrol names two nodes; the configured
    Python (at a hostile path) prints a key for the job's `python -c`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {
        "srun": 'printf "%s\\0" "$@" >> "$RECORD/srun.args"; echo >> "$RECORD/srun.args"\n',
        "scontrol": "printf 'n1\\nn2\\n'\n",
    }.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + text)
        (bin_dir / name).chmod(0o755)
    python = tmp_path / f"py {HOSTILE}" / "python"
    python.parent.mkdir()
    python.write_text("#!/bin/bash\necho stub-key\n")
    python.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hostile_values_stay_data_in_the_job_script(tmp_path, monkeypatch, layout):
    service, flags = LAYOUTS[layout]
    cwd = tmp_path / f"cwd {HOSTILE}"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # the job's --chdir
    monkeypatch.setenv("INFERENCE_SERVER_API_KEY", ENV_KEY)  # the orchestrator's client.api_key_var
    if service == "rl":
        base = ["@", str(ROOT / "configs/debug/rl.toml"), "--inference.api-key", KEY]
        config = load_config(RLConfig, [*base, *hostile_flags(tmp_path), *flags])
    else:
        config = load_config(SFTConfig, ["@", str(ROOT / "configs/sft/debug.toml"), *hostile_flags(tmp_path), *flags])
    # The command line as typed: secrets in both flag forms and in another value, and a newline that would end
    # the `# Rendered by` comment and start lines of its own.
    argv = [*hostile_flags(tmp_path), "--inference.api-key", KEY, f"--inference.api-key={OTHER_KEY}",
            "--orchestrator.wandb.name", f"run-{ENV_KEY}",
            "--model.name", "m\n#SBATCH --uid=0\ntouch MARKER"]  # fmt: skip
    job = render(config, service, argv)
    script_path = write_job(job)
    script = script_path.read_text()

    assert subprocess.run(["bash", "-n", str(script_path)], capture_output=True).returncode == 0
    lines = script.splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.strip() and not line.startswith("#"))
    assert max(i for i, line in enumerate(lines) if line.startswith("#SBATCH")) < first_command
    assert sum(line.startswith("# Rendered by") for line in lines) == 1
    for secret in (KEY, OTHER_KEY, ENV_KEY):  # nowhere in the script, nor in the configs beside it
        for path in script_path.parent.iterdir():
            assert secret not in path.read_text(), (secret, path.name)

    if shutil.which("sbatch"):  # sbatch's own reading of the #SBATCH lines; --test-only never submits
        parsed = tmp_path / "parsed.sbatch"  # without --time, which sbatch checks before anything else
        parsed.write_text("\n".join(line for line in lines if not line.startswith('#SBATCH "--time=')))
        shown = subprocess.run(["sbatch", "--test-only", "-vv", str(parsed)], capture_output=True, text=True,
                               timeout=60).stderr  # fmt: skip
        for option in ("job-name", "partition", "account", "comment"):
            assert f"sbatch: {option:<20}: {HOSTILE}" in shown.splitlines(), shown

    env = {**os.environ, "PATH": f"{stubs(tmp_path)}:{os.environ['PATH']}", "RECORD": str(tmp_path),
           "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "42"}  # fmt: skip
    result = subprocess.run(["bash", str(script_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert not list(tmp_path.rglob("MARKER")), "a value ran as shell"
    steps = (tmp_path / "srun.args").read_text().split("\n")
    assert all(f"\0--comment={HOSTILE}\0" in "\0" + step for step in steps if step), steps  # one literal argument


@pytest.mark.parametrize("flag", ["--slurm.job-name", "--slurm.partition", "--slurm.account", "--slurm.time",
                                  "--slurm.python", "--slurm.extra-sbatch", "--slurm.srun-args"])  # fmt: skip
def test_a_newline_in_a_slurm_value_is_a_config_error_naming_the_flag(flag):
    key = flag.removeprefix("--").replace("-", "_")
    with pytest.raises(ConfigError, match=rf"^{key}: contains a control character .*\[flag {flag}\]$"):
        load_config(RLConfig, [f"{flag}=--x\n#SBATCH --uid=0\ntouch MARKER"])


def test_an_output_dir_or_working_dir_that_would_end_a_script_line_is_refused(tmp_path, monkeypatch):
    config = load_config(RLConfig, ["--slurm", "--output-dir", str(tmp_path / "out\ntouch MARKER")])
    with pytest.raises(ValueError, match="output_dir contains a control character"):
        render(config, "rl", [])
    cwd = tmp_path / "cwd\n#SBATCH --uid=0"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    with pytest.raises(ValueError, match="the working directory contains a control character"):
        render(load_config(RLConfig, ["--slurm", "--output-dir", str(tmp_path / "out")]), "rl", [])


def test_extra_sbatch_entries_are_options_and_key_variables_are_names():
    with pytest.raises(ConfigError, match=r"slurm.extra_sbatch: each entry is one #SBATCH option"):
        load_config(RLConfig, ["--slurm.extra-sbatch", "exclusive"])
    # The job script assigns the key's variable (`export NAME=...`): only a name may stand there.
    with pytest.raises(ConfigError, match=r"orchestrator.client.api_key_var: must be an env var name"):
        load_config(RLConfig, ["--orchestrator.client.api-key-var", "X=1; touch MARKER #"])
