"""`env_vars` per service (`[inference.env_vars]`, `[orchestrator.env_vars]`, `[trainer.env_vars]`): what the config
takes and refuses, `rl` starting each service with its own, each entrypoint setting them for itself before it imports
anything heavy (panes), and Slurm job steps exporting them as data."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prime_rl.configs import ConfigError, load_config
from prime_rl.configs.inference import InferenceConfig
from prime_rl.configs.rl import RLConfig
from prime_rl.launch.run import service_env
from prime_rl.slurm.launch import render
from prime_rl.slurm.script import in_step

HOSTILE = "a b $(touch MARKER) `touch MARKER` 'q' \"dq\" ; touch MARKER & \\ $HOME *"


def test_tables_and_flags_set_each_services_own(tmp_path):
    toml = tmp_path / "rl.toml"
    toml.write_text('[inference.env_vars]\nOMP_NUM_THREADS = 2\nVLLM_LOGGING_LEVEL = "DEBUG"\n'
                    '[trainer.env_vars]\nNCCL_DEBUG = "INFO"\n')  # fmt: skip
    rl = load_config(RLConfig, ["@", str(toml), "--orchestrator.env-vars.MY_FLAG", "x y", "--inference.env-vars.A=1"])
    assert rl.inference.env_vars == {"OMP_NUM_THREADS": "2", "VLLM_LOGGING_LEVEL": "DEBUG", "A": "1"}  # text
    assert rl.orchestrator.env_vars == {"MY_FLAG": "x y"} and rl.trainer.env_vars == {"NCCL_DEBUG": "INFO"}
    assert load_config(InferenceConfig, ["--env-vars.OMP_NUM_THREADS", "4"]).env_vars == {"OMP_NUM_THREADS": "4"}


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--inference.env-vars.A-B", "1"], "inference.env_vars.A-B: not an env var name: letters, digits and _, "
         "not starting with a digit [flag --inference.env-vars.A-B]"),
        (["--trainer.env-vars.PRIME_MAX_STEPS", "3"], "trainer.env_vars.PRIME_MAX_STEPS: PRIME_* env vars are config "
         "keys: set the key in the config instead [flag --trainer.env-vars.PRIME_MAX_STEPS]"),
        (["--orchestrator.env-vars.HF_TOKEN", "hf_x"], "orchestrator.env_vars.HF_TOKEN: looks like a secret, and "
         "env_vars are written to disk (OUTPUT_DIR/run/*.toml, Slurm job scripts): export it in the environment that "
         "starts the run instead (every service inherits it) [flag --orchestrator.env-vars.HF_TOKEN]"),
        (["--trainer.env-vars.CUDA_VISIBLE_DEVICES", "1"], "trainer.env_vars.CUDA_VISIBLE_DEVICES: rl assigns each "
         "service its devices: it takes --trainer-gpu-ids [flag --trainer.env-vars.CUDA_VISIBLE_DEVICES]"),
        (["--inference.env-vars.X"], "option --inference.env-vars.X expects a value"),
    ],
)  # fmt: skip
def test_names_that_are_no_names_config_keys_secrets_or_rls_own_are_refused_in_one_line(argv, line):
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, argv)
    assert e.value.lines == [line]


def test_secret_words_are_whole_words_of_the_name():
    env = {"TOKENIZERS_PARALLELISM": "false", "NCCL_IB_PKEY": "0", "WANDB_API_KEY": None, "AWS_SECRET_ACCESS_KEY": None}
    for name, value in env.items():
        if value is not None:
            assert load_config(InferenceConfig, [f"--env-vars.{name}", value]).env_vars == {name: value}
        else:
            with pytest.raises(ConfigError, match="looks like a secret"):
                load_config(InferenceConfig, [f"--env-vars.{name}", "x"])


def test_rl_starts_each_service_with_its_own_under_what_rl_sets(tmp_path):
    rl = load_config(RLConfig, ["--inference.env-vars.OMP_NUM_THREADS", "1", "--trainer.env-vars.NCCL_DEBUG", "INFO",
                                "--output-dir", str(tmp_path)])  # fmt: skip
    env, _ = service_env(rl, "lock-token")
    assert env["inference"]["OMP_NUM_THREADS"] == "1" and "OMP_NUM_THREADS" not in env["trainer"]
    assert env["trainer"]["NCCL_DEBUG"] == "INFO" and "NCCL_DEBUG" not in env["orchestrator"]
    assert env["trainer"]["RL_RUN_LOCK_TOKEN"] == "lock-token" and env["trainer"]["CUDA_VISIBLE_DEVICES"] == ""


def test_a_cpu_server_computing_beside_the_trainer_waits_passively_and_one_with_its_own_cores_spins(
    tmp_path, monkeypatch
):
    """OpenMP threads spinning between regions hold cores the other service needs (generation stalled 0.5-0.9 s
    in a third of the debug run's steps): passive while the server computes beside the trainer on its cores."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    base = ["--output-dir", str(tmp_path), "--async-level", "1"]
    shared, _ = service_env(load_config(RLConfig, base), "t")
    assert shared["inference"]["OMP_WAIT_POLICY"] == "passive" and "OMP_WAIT_POLICY" not in shared["trainer"]
    overlapping, _ = service_env(load_config(RLConfig, [*base, "--inference-cpus", "0,1", "--trainer-cpus", "1"]), "t")
    assert overlapping["inference"]["OMP_WAIT_POLICY"] == "passive"
    apart, _ = service_env(load_config(RLConfig, [*base, "--inference-cpus", "0", "--trainer-cpus", "1"]), "t")
    assert "OMP_WAIT_POLICY" not in apart["inference"]
    sync, _ = service_env(load_config(RLConfig, [*base, "--async-level", "0"]), "t")
    assert "OMP_WAIT_POLICY" not in sync["inference"]  # the services take turns
    chosen, _ = service_env(load_config(RLConfig, [*base, "--inference.env-vars.OMP_WAIT_POLICY", "active"]), "t")
    assert chosen["inference"]["OMP_WAIT_POLICY"] == "active"
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")  # the shell's choice: the service inherits it
    assert "OMP_WAIT_POLICY" not in service_env(load_config(RLConfig, base), "t")[0]["inference"]


def test_rl_gives_its_services_the_output_dir_it_resolved_over_an_exported_one(tmp_path, monkeypatch):
    """$OUTPUT_DIR outranks the run/*.toml a service reads: `rl --output-dir B` under an exported OUTPUT_DIR=A
    must still run every service in B."""
    monkeypatch.setenv("OUTPUT_DIR", str(tmp_path / "exported"))
    rl = load_config(RLConfig, ["--output-dir", str(tmp_path / "flag")])
    env, _ = service_env(rl, "lock-token")
    assert {env[s]["OUTPUT_DIR"] for s in ("inference", "orchestrator", "trainer")} == {str(tmp_path / "flag")}


@pytest.mark.parametrize("command", ["inference", "orchestrator", "trainer"])
def test_each_entrypoint_sets_them_for_itself_before_importing_anything_heavy(command, tmp_path):
    """A pane: the service's own entrypoint sets them right after parsing its config (torch, vLLM and NCCL read
    theirs when loaded); the run itself is stubbed out."""
    script = textwrap.dedent(f"""
        import os, sys
        import prime_rl.entrypoints.{command} as entry
        apply = entry.apply_env_vars
        def recording(env_vars):
            print("heavy before:", sorted(m for m in ("torch", "vllm", "transformers") if m in sys.modules))
            apply(env_vars)
        entry.apply_env_vars = recording
        entry.run_service = lambda *a, **k: print("MY_VAR in the service:", os.environ.get("MY_VAR"))
        sys.argv = ["{command}", "--env-vars.MY_VAR", {HOSTILE!r}, "--output-dir", {str(tmp_path)!r}]
        entry.main()
    """)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=clean,
                         cwd=tmp_path).stdout  # fmt: skip
    assert "heavy before: []" in out and f"MY_VAR in the service: {HOSTILE}" in out, out


def test_a_slurm_step_exports_its_services_own_as_data(tmp_path):
    rl = load_config(RLConfig, ["--slurm.inference-nodes", "1", "--slurm.trainer-nodes", "1",
                                "--inference.env-vars.MY_VAR", HOSTILE, "--trainer.env-vars.NCCL_DEBUG", "INFO",
                                "--output-dir", str(tmp_path / "out")])  # fmt: skip
    lines = render(rl, "rl", []).script.splitlines()
    inference = next(line for line in lines if "logs/inference-%N.log" in line)
    trainer = next(line for line in lines if "logs/trainer-%N.log" in line)
    assert "MY_VAR" in inference and "MY_VAR" not in trainer and "NCCL_DEBUG=INFO" in trainer
    # The step's program, run as the step runs it: the value arrives as it was given, and nothing of it runs.
    step = in_step(["printenv", "MY_VAR"], {"MY_VAR": HOSTILE, "CUDA_VISIBLE_DEVICES": ""})
    result = subprocess.run(step, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert result.stdout == HOSTILE + "\n" and not list(Path(tmp_path).rglob("MARKER"))
    newline = load_config(RLConfig, ["--slurm.inference-nodes", "1", "--slurm.trainer-nodes", "1",
                                     "--inference.env-vars.MY_VAR", "a\ntouch MARKER"])  # fmt: skip
    with pytest.raises(ValueError, match="env var MY_VAR contains a control character"):
        render(newline, "rl", [])
