"""The rendered job scripts of `rl --slurm` / `sft --slurm`: their #SBATCH lines, the configs the job runs, and
the multi-node script itself run by bash against fake `scontrol` / `srun` / Python (the steps it starts, with
their $VARS expanded as on the nodes; a failed step ends the job naming it)."""

import contextlib
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from prime_rl.configs import ConfigError, load_config
from prime_rl.configs.rl import RLConfig
from prime_rl.configs.sft import SFTConfig
from prime_rl.slurm.launch import render, write_job

ROOT = Path(__file__).parents[3]


def rl(tmp_path, *flags: str) -> RLConfig:
    return load_config(RLConfig, ["@", str(ROOT / "configs/debug/rl.toml"), "--output-dir", str(tmp_path / "out"),
                                  *flags])  # fmt: skip


def test_single_node_rl_runs_rl_on_the_resolved_config_with_the_sbatch_options(tmp_path):
    config = rl(tmp_path, "--slurm.partition", "gpu", "--slurm.account", "proj", "--slurm.time", "01:00:00",
                "--slurm.gpus-per-node", "2", "--slurm.job-name", "exp1", "--slurm.extra-sbatch=--exclusive",
                "--slurm.setup", "module load cuda/12.4")  # fmt: skip
    job = render(config, "rl", ["@", "configs/debug/rl.toml"])
    lines = job.script.splitlines()
    for option in ("--job-name=exp1", "--nodes=1", "--partition=gpu", "--account=proj", "--time=01:00:00",
                   "--gpus-per-node=2", "--exclusive", "--no-requeue", f"--output={tmp_path}/out/logs/slurm-%j.log",
                   f"--chdir={Path.cwd()}"):  # fmt: skip
        assert f"#SBATCH {option}" in lines
    assert lines.index("module load cuda/12.4") > lines.index("set -euo pipefail")
    assert (
        'srun --nodes=1 --ntasks=1 "$PY" -m prime_rl.entrypoints.rl @ "$OUTPUT_DIR/run/slurm/rl.toml" || rc=$?' in lines
    )
    assert lines[-1] == "exit $rc" and not any(line.startswith("#SBATCH --signal") for line in lines)  # no ckpt
    write_job(job)
    toml = tmp_path / "out/run/slurm/rl.toml"
    data = tomllib.loads(toml.read_text())
    assert "slurm" not in data and data["output_dir"] == str(tmp_path / "out")
    again = load_config(RLConfig, ["@", str(toml)])  # the job runs exactly the user's config, minus `slurm`
    for service in ("inference", "orchestrator", "trainer"):
        assert getattr(again, service).model_dump() == getattr(config, service).model_dump()
    assert again.slurm is None
    assert (tmp_path / "out/run/slurm/job.sbatch").read_text() == job.script


def test_multi_node_rl_puts_servers_trainer_and_one_orchestrator_on_their_nodes(tmp_path):
    config = rl(tmp_path, "--slurm.inference-nodes", "2", "--slurm.trainer-nodes", "2", "--slurm.gpus-per-node", "8",
                "--slurm.traffic-share", "3,1", "--slurm.srun-args=--container-image=img.sqsh")  # fmt: skip
    job = render(config, "rl", [])
    script = job.script
    assert "#SBATCH --nodes=4" in script and "#SBATCH --gpus-per-node=8" in script
    assert 'INFERENCE_NODES=("${NODES[@]:0:2}")' in script and 'TRAINER_NODES=("${NODES[@]:2:2}")' in script
    assert 'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")' in script
    assert "--nnodes 2 --node-rank \"$SLURM_PROCID\" --rdzv-endpoint \"$TRAINER_HEAD:$RDZV_PORT\" --nproc-per-node 8 " \
           "-m prime_rl.entrypoints.trainer" in script  # fmt: skip
    assert '--client.base-url "$BASE_URLS" --client.traffic-share 3.0,1.0' in script
    # Three steps, and one that clears an earlier attempt's outputs first when there is nothing to resume.
    assert script.count("\nsrun ") == 3 and script.count("--container-image=img.sqsh") == 4
    assert script.count("prime_rl.entrypoints.orchestrator") == 1 and '"--nodelist=$TRAINER_HEAD"' in script
    assert "export INFERENCE_SERVER_API_KEY=$(" in script  # generated in the job, never a literal
    assert job.configs["orchestrator.toml"]["num_train_workers"] == 16
    assert job.configs["inference.toml"]["api_key_var"] == "INFERENCE_SERVER_API_KEY"
    assert job.configs["inference.toml"]["server"]["host"] == "0.0.0.0"
    assert all(data["log"]["file"] is False for data in job.configs.values())  # srun writes one log per node
    # No `rl` watches these steps: a hung orchestrator or trainer ends itself after rl's --hang-timeout.
    assert job.configs["orchestrator.toml"]["hang_timeout"] == job.configs["trainer.toml"]["hang_timeout"] == 600


def test_multi_node_sft_runs_torchrun_over_every_node(tmp_path):
    config = load_config(SFTConfig, ["@", str(ROOT / "configs/sft/debug.toml"), "--output-dir", str(tmp_path),
                                     "--slurm.nodes", "2", "--slurm.gpus-per-node", "4"])  # fmt: skip
    job = render(config, "sft", [])
    assert "#SBATCH --nodes=2" in job.script and "#SBATCH --job-name=sft" in job.script
    assert 'srun --nodes=2 --ntasks=2 --ntasks-per-node=1 "--output=$OUTPUT_DIR/logs/sft-%N.log"' in job.script
    assert "--nnodes 2 --node-rank \"$SLURM_PROCID\" --rdzv-endpoint \"$TRAINER_HEAD:$RDZV_PORT\" --nproc-per-node 4 " \
           "-m prime_rl.entrypoints.sft @ \"$OUTPUT_DIR/run/slurm/sft.toml\"" in job.script  # fmt: skip
    assert "slurm" not in job.configs["sft.toml"]
    with pytest.raises(ValueError, match="RL layouts"):
        render(load_config(SFTConfig, ["@", str(ROOT / "configs/sft/debug.toml"), "--slurm.trainer-nodes", "2"]),
               "sft", [])  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--slurm.inference-nodes", "2", "--slurm.nodes", "4"], "slurm.nodes=4 but the layout has 2 inference"),
        (["--slurm.inference-nodes", "2", "--slurm.traffic-share", "1,1,1"], "3 entries for 2 node"),
        (["--slurm.traffic-share", "1,1"], "also set slurm.inference_nodes"),
    ],
)
def test_inconsistent_layouts_are_config_errors(tmp_path, flags, message):
    with pytest.raises(ConfigError, match=message):
        rl(tmp_path, *flags)


FAKE_SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do echo "$1" >> "$RECORD/srun.$$"; shift; done
SLURM_PROCID=0 exec "$@"
"""
FAKE_PY = """#!/bin/bash
echo $$ >> "$RECORD/pids"
echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset} $*" >> "$RECORD/commands"
[[ $* == *entrypoints.inference* ]] && exec sleep "${SERVE_SECONDS:-60}"
[[ -n ${HANG:-} && $* == *prime_rl.entrypoints.[ot]* ]] && exec sleep 30
[[ -n ${TOUCH:-} ]] && mkdir -p "$(dirname "$TOUCH")" && touch "$TOUCH"
if [[ -n ${AWAIT_TERM:-} && $* == *prime_rl.entrypoints.[ot]* ]]; then  # as trainer and orchestrator on Slurm's SIGTERM
  [[ $* == *trainer* ]] && trap 'touch "$OUTPUT_DIR/run/trainer.stopped"; kill $!; exit 1' TERM \\
    || trap 'kill $!; exit 3' TERM
  sleep 30 & wait
fi
[[ $* == *$FAIL* ]] && exit 3
exit 0
"""
FAKE_SCONTROL = """#!/bin/bash
[[ $1 == requeue ]] && { echo "$*" >> "$RECORD/requeued"; exit 0; }
printf 'n1\\nn2\\nn3\\nn4\\n'
"""


def run_script(tmp_path, script: str, fail: str = "never", touch: str = "", term: bool = False, **env: str):
    """Run a job script against fake srun / scontrol / Python; the fake Python exits 3 when its command line
    contains `fail` (else 0) and creates the file `touch` first; `env` e.g. SERVE_SECONDS (the server's life), HANG
    (trainer and orchestrator never end). `term`: once the three steps run, SIGTERM to
    their processes (not the batch shell), as Slurm on preemption (the fakes then stop as our services do)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in {"srun": FAKE_SRUN, "python": FAKE_PY, "scontrol": FAKE_SCONTROL}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(tmp_path), "FAIL": fail,
           "TOUCH": touch, "SLURM_JOB_NODELIST": "n[1-4]", "SLURM_JOB_ID": "42",
           "AWAIT_TERM": "1" if term else "", **env}  # fmt: skip
    proc = subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    if term:
        commands, deadline = tmp_path / "commands", time.monotonic() + 20
        modules = ("entrypoints.inference", "entrypoints.trainer", "entrypoints.orchestrator")
        while not commands.exists() or not all(m in commands.read_text() for m in modules):
            assert time.monotonic() < deadline, "the steps never started"
            time.sleep(0.05)
        time.sleep(0.5)  # the fakes set their traps
        for pid in (tmp_path / "pids").read_text().split():
            with contextlib.suppress(ProcessLookupError):  # the key's one-off Python
                os.kill(int(pid), signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_multi_node_script_starts_each_step_on_its_nodes_with_the_key_only_in_the_environment(tmp_path):
    config = rl(tmp_path, "--slurm.inference-nodes", "2", "--slurm.trainer-nodes", "2",
                "--slurm.python", str(tmp_path / "bin/python"))  # fmt: skip
    result = run_script(tmp_path, render(config, "rl", []).script)
    assert result.returncode == 0, result.stderr
    assert "step trainer done" in result.stdout and "step orchestrator done" in result.stdout
    commands = (tmp_path / "commands").read_text().splitlines()
    out = tmp_path / "out"
    assert f"CUDA_VISIBLE_DEVICES= -m prime_rl.entrypoints.inference @ {out}/run/slurm/inference.toml" in commands
    assert (f"CUDA_VISIBLE_DEVICES= -m prime_rl.launch.torchrun --nnodes 2 --node-rank 0 --rdzv-endpoint n3:29500 "
            f"--nproc-per-node 1 -m prime_rl.entrypoints.trainer @ {out}/run/slurm/trainer.toml"
            ) in commands  # fmt: skip
    assert (f"CUDA_VISIBLE_DEVICES= -m prime_rl.entrypoints.orchestrator @ {out}/run/slurm/orchestrator.toml "
            "--client.base-url http://n1:8000/v1,http://n2:8000/v1") in commands  # fmt: skip
    # The steps run at once: each srun's options were recorded in a file of its own, named by its log.
    steps = {}
    for record in tmp_path.glob("srun.*"):
        options = record.read_text().splitlines()
        if log := next((o for o in options if o.startswith("--output=")), None):
            steps[log.removeprefix(f"--output={out}/logs/")] = options
    assert "--nodelist=n1,n2" in steps["inference-%N.log"]
    assert "--nodelist=n3,n4" in steps["trainer-%N.log"]
    assert "--nodelist=n3" in steps["orchestrator.log"]
    # Nothing to resume: an earlier attempt's rollouts and weights are cleared before any step starts.
    cleared = next(i for i, c in enumerate(commands) if "prepare_output_dir" in c)
    assert cleared < min(i for i, c in enumerate(commands) if "-m prime_rl." in c)


def test_a_failed_step_stops_the_others_and_ends_the_job_naming_it(tmp_path):
    config = rl(tmp_path, "--slurm.inference-nodes", "1", "--slurm.trainer-nodes", "1",
                "--slurm.python", str(tmp_path / "bin/python"))  # fmt: skip
    result = run_script(tmp_path, render(config, "rl", []).script, fail="entrypoints.trainer")
    assert result.returncode == 3
    assert "step trainer failed (exit 3); stopping the others" in result.stderr


def test_a_server_that_ends_while_nothing_stops_fails_the_job_after_the_grace(tmp_path):
    """A server ends at once on preemption's SIGTERM, before the trainer and orchestrator report their stop:
    the job judges it only after the grace (shortened here), then fails naming it."""
    config = rl(tmp_path, "--slurm.inference-nodes", "1", "--slurm.trainer-nodes", "1",
                "--slurm.python", str(tmp_path / "bin/python"))  # fmt: skip
    script = render(config, "rl", []).script.replace("INFERENCE_GRACE=30", "INFERENCE_GRACE=2")
    start = time.monotonic()
    result = run_script(tmp_path, script, SERVE_SECONDS="1", HANG="1")
    assert result.returncode == 1 and "step inference ended (exit 0); stopping the others" in result.stderr
    assert 3 <= time.monotonic() - start < 15


def test_dry_run_prints_the_script_and_submits_nothing(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/bash\ntouch {tmp_path}/submitted\n")
    (bin_dir / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "prime_rl.entrypoints.rl", "@", "configs/debug/rl.toml",
                             "--output-dir", str(out), "--slurm.dry-run"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("#!/bin/bash\n#SBATCH --job-name=rl\n")
    assert not (tmp_path / "submitted").exists() and not out.exists()


def test_requeue_needs_checkpoints(tmp_path):
    with pytest.raises(ValueError, match="also set ckpt"):
        render(rl(tmp_path, "--slurm.requeue"), "rl", [])


def checkpoint(out: Path, step: int) -> None:
    (out / f"checkpoints/step_{step}/trainer").mkdir(parents=True)
    (out / f"checkpoints/step_{step}/trainer/STABLE").touch()


def test_a_stopped_single_node_run_is_requeued_and_the_requeued_job_resumes(tmp_path):
    """`rl` exits 3 (stopped on a signal, progress saved): the job requeues itself; the next start finds the
    trainer's checkpoint and resumes from it. Without --slurm.requeue it ends with status 3 and says how to resume."""
    out, py = tmp_path / "out", str(tmp_path / "bin/python")
    config = rl(
        tmp_path, "--ckpt.interval", "4", "--slurm.requeue", "--slurm.signal-seconds", "90", "--slurm.python", py
    )
    script = render(config, "rl", []).script
    assert "#SBATCH --signal=USR1@90" in script and "#SBATCH --requeue" in script
    assert "#SBATCH --open-mode=append" in script  # the requeued run's lines follow the first's in slurm-%j.log

    first = run_script(tmp_path, script, fail="prime_rl.entrypoints.rl")
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "requeued").read_text() == "requeue 42\n"
    assert (tmp_path / "commands").read_text().splitlines()[-1].endswith(f"@ {out}/run/slurm/rl.toml")  # fresh

    checkpoint(out, 4)
    again = run_script(tmp_path, script)
    assert again.returncode == 0, again.stderr
    assert "resuming from the newest checkpoint" in again.stdout
    assert (tmp_path / "commands").read_text().splitlines()[-1].endswith("rl.toml --ckpt.resume-step=latest")

    no_requeue = render(rl(tmp_path, "--ckpt.interval", "4", "--slurm.python", py), "rl", []).script
    assert "#SBATCH --no-requeue" in no_requeue and "#SBATCH --signal=USR1@300" in no_requeue
    stopped = run_script(tmp_path, no_requeue, fail="prime_rl.entrypoints.rl")
    assert stopped.returncode == 3
    assert f"resume it with: sbatch {out}/run/slurm/job.sbatch" in stopped.stderr


def test_multi_node_orchestrator_stopped_on_a_signal_ends_the_job_as_stopped_and_resumes_both(tmp_path):
    out = tmp_path / "out"
    config = rl(tmp_path, "--ckpt.interval", "4", "--slurm.requeue", "--slurm.inference-nodes", "1",
                "--slurm.trainer-nodes", "1", "--slurm.python", str(tmp_path / "bin/python"))  # fmt: skip
    script = render(config, "rl", []).script
    assert script.count('trap "" USR1; exec') == 3  # torchrun's agent and the server never die of USR1
    checkpoint(out, 4)
    result = run_script(tmp_path, script, fail="prime_rl.entrypoints.orchestrator")
    assert result.returncode == 0, result.stderr
    assert "step orchestrator stopped on a signal" in result.stdout and "step trainer done" in result.stdout
    assert "step orchestrator done" not in result.stdout
    assert (tmp_path / "requeued").exists()
    commands = (tmp_path / "commands").read_text().splitlines()
    for module in ("prime_rl.entrypoints.trainer", "prime_rl.entrypoints.orchestrator"):
        assert any(module in c and "--ckpt.resume-step=latest" in c for c in commands), commands
    assert not any("entrypoints.inference" in c and "resume" in c for c in commands)
    assert not any("prepare_output_dir" in c for c in commands)  # the checkpoint's run goes on


def test_sft_stopped_on_a_signal_ends_with_status_3(tmp_path):
    """torchrun exits 0 after the ranks stopped; the trainer's run/sft.stopped tells the script."""
    config = load_config(SFTConfig, ["@", str(ROOT / "configs/sft/debug.toml"), "--output-dir", str(tmp_path / "out"),
                                     "--ckpt", "--slurm.python", str(tmp_path / "bin/python")])  # fmt: skip
    script = render(config, "sft", []).script
    assert run_script(tmp_path, script).returncode == 0
    stopped = run_script(tmp_path, script, touch=str(tmp_path / "out/run/sft.stopped"))
    assert stopped.returncode == 3 and "stopped on a signal" in stopped.stderr


def test_a_sigterm_to_the_services_of_a_multi_node_job_ends_it_as_stopped_not_failed(tmp_path):
    """Preemption (GraceTime): Slurm sends SIGTERM to the tasks of every step. The server dies at once; the job
    waits for the trainer (torchrun exits 1 after passing SIGTERM on; the trainer recorded its stop) and the
    orchestrator (exit 3), and requeues."""
    config = rl(tmp_path, "--ckpt", "--slurm.requeue", "--slurm.inference-nodes", "1", "--slurm.trainer-nodes", "1",
                "--slurm.python", str(tmp_path / "bin/python"))  # fmt: skip
    (tmp_path / "out/run").mkdir(parents=True)
    result = run_script(tmp_path, render(config, "rl", []).script, term=True)
    assert result.returncode == 0, result.stderr
    assert "step inference ended on the stop signal" in result.stdout
    assert "step trainer stopped on a signal" in result.stdout, result.stdout
    assert "step orchestrator stopped on a signal" in result.stdout
    assert (tmp_path / "requeued").read_text() == "requeue 42\n"


def test_no_cli_value_becomes_a_shell_line_or_leaks_a_secret_through_the_rendered_by_comment(tmp_path):
    """Any CLI value lands in the `# Rendered by` comment: a newline there would end it and run the rest."""
    marker = tmp_path / "injected"
    argv = ["--model.name", f"x\ntouch {marker}", "--inference.api-key", "s3cret", "--orchestrator.client.api-key=k2"]
    script = render(rl(tmp_path, "--slurm"), "rl", argv).script
    comment = next(line for line in script.splitlines() if line.startswith("# Rendered by"))
    assert f"touch {marker}" in comment and "\\x0a" in comment  # still readable, on its one line
    assert not any(line.startswith("touch") for line in script.splitlines())
    assert "s3cret" not in script and "k2" not in script and "--inference.api-key '***'" in comment


def test_srun_args_are_passed_as_data_not_run_by_the_shell(tmp_path):
    config = rl(tmp_path, "--slurm.inference-nodes", "1", "--slurm.trainer-nodes", "1",
                "--slurm.srun-args=--comment=$(touch injected)")  # fmt: skip
    script = render(config, "rl", []).script
    assert "'--comment=$(touch injected)'" in script and '"--comment=$(touch injected)"' not in script
