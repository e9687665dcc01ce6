"""Render the sbatch script of a run and submit it (`rl --slurm ...`, `sft --slurm ...`).

The job runs our own entrypoints on the exact config the user gave: the resolved config, without its `slurm`
section and with `output_dir` made absolute, is written to OUTPUT_DIR/run/slurm/ beside the script
(`job.sbatch`), so a job can be resubmitted as it is (`sbatch OUTPUT_DIR/run/slurm/job.sbatch`). Values only
known in the job (node names, the API key) are flags of the steps, computed by the script at run time.

Layouts:
- `rl`, one node: one srun step runs `rl @ run/slurm/rl.toml` (inference, orchestrator and trainer as `rl` runs
  them, logs in OUTPUT_DIR/logs/ as usual).
- `rl` across nodes (`slurm.inference_nodes` / `slurm.trainer_nodes`): nodes from `$SLURM_JOB_NODELIST`, the
  first ones each run an inference server (one srun step, logs/inference-<node>.log), the next ones the trainer
  (one srun step of torchrun with a static rendezvous on the first trainer node, logs/trainer-<node>.log), and
  exactly one orchestrator on the first trainer node (logs/orchestrator.log) with every server's URL. A fresh
  API key is generated in the job into an env var the steps inherit: it is never written to disk. With
  `slurm.nodes = 1` (and one node of each) all three steps share the node.
- `sft` on any number of nodes: one srun step of torchrun over all of them (logs/sft-<node>.log).
The script waits for the steps; the first one that fails stops the others and ends the job with its status,
naming it (the inference step ending at all is a failure; it is stopped once trainer and orchestrator are done).
The pieces every layout's script shares (the #SBATCH header, quoting, srun lines, the script's end) are script.py's.

Stopping and resuming (a run with `ckpt`): `#SBATCH --signal=USR1@N` (`slurm.signal_seconds`), `scancel
--signal=USR1` and Slurm's SIGTERM reach every process of the steps; the trainer checkpoints after its current
step and the orchestrator stops with its progress saved (`utils/process.py`), and the run ends with status 3.
With `slurm.requeue` the script then requeues the job; a requeued or resubmitted job finds the trainer's
checkpoint and passes `--ckpt.resume-step=latest`, so it goes on at the next step with none lost or repeated.
"""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from prime_rl.configs.slurm import SlurmConfig
from prime_rl.slurm.script import RESUME, finish, in_step, key_values, sbatch_header, sh, srun


@dataclass
class Job:
    """A rendered job: the script and the configs it runs (file name -> TOML data), all under run/slurm/."""

    output_dir: Path
    script: str
    configs: dict[str, dict] = field(default_factory=dict)


def job_dir(output_dir: Path) -> Path:
    from prime_rl.protocol import run_dir

    return run_dir(output_dir) / "slurm"


def _toml_data(config, output_dir: Path, services: tuple[str, ...] = ()) -> dict:
    """The config as the job runs it: no `slurm` section, an absolute output_dir (in each sub-config too)."""
    from prime_rl.configs import to_toml_dict

    data = to_toml_dict(config)
    data.pop("slurm", None)
    for node in [data, *(data[s] for s in services)]:
        node["output_dir"] = str(output_dir)
    return data


def torchrun_nodes(nodes: int) -> list[str]:
    """torchrun's static rendezvous across the step's nodes: rank 0 on $TRAINER_HEAD, the first
    node of the step (one task per node: the task rank is the node rank)."""
    return ["--nnodes", str(nodes), "--node-rank", "$SLURM_PROCID", "--rdzv-endpoint", "$TRAINER_HEAD:$RDZV_PORT"]


NODE_LISTS = """mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
{arrays}
join() {{ local IFS=,; echo "$*"; }}
export TRAINER_HEAD=${{TRAINER_NODES[0]}} RDZV_PORT={port}"""

# A fresh job's first step: the fresh case of `protocol.prepare_output_dir`, the one owner of that rule.
CLEAR_PREVIOUS_RUN = (
    "import pathlib, sys; from prime_rl.protocol import prepare_output_dir; "
    'print("prime-rl:", prepare_output_dir(pathlib.Path(sys.argv[1]), None, launcher=True) or "fresh start")'
)

# Bash that follows the steps started in the background (STEP_PIDS: name -> srun pid).
# A stop is underway once the job got USR1/SIGTERM (STOPPING, set by the trap), the orchestrator exits 3 or the
# trainer records its stop in run/trainer.stopped (torchrun exits 0 after a USR1, 1 after a SIGTERM it passed on).
# Preemption signals the tasks, not this shell: the servers end at once, so a server that ends (but of SIGKILL) is
# judged only after INFERENCE_GRACE seconds, when the trainer or orchestrator would have reported the same stop.
WATCH_STEPS = r"""
stop_steps() {
  local pid
  for pid in "${STEP_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 30); do
    for pid in "${STEP_PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && { sleep 1 || true; continue 2; }; done
    return 0
  done
}
fail() {  # step, exit status, why
  echo "prime-rl: step $1 $3 (exit $2); stopping the others; see the logs in $OUTPUT_DIR/logs" >&2
  stop_steps
  exit $(($2 == 0 ? 1 : $2))
}
STOPPED=0 STOPPING=${STOPPING:-0} STOP_AT="" INFERENCE_END=""
while [[ -n "${STEP_PIDS[trainer]:-}${STEP_PIDS[orchestrator]:-}" ]]; do
  [[ ! -f $OUTPUT_DIR/run/trainer.stopped ]] || STOPPING=1
  for name in "${!STEP_PIDS[@]}"; do
    pid=${STEP_PIDS[$name]}
    kill -0 "$pid" 2>/dev/null && continue
    rc=0; wait "$pid" || rc=$?
    unset "STEP_PIDS[$name]"
    if [[ $rc -eq 3 && $name == orchestrator ]] || [[ $name == trainer && -f $OUTPUT_DIR/run/trainer.stopped ]]; then
      STOPPED=3 STOPPING=1
      echo "prime-rl: step $name stopped on a signal, its progress saved"
    elif [[ $name == inference && $rc -ne 137 ]]; then  # SIGKILL (OOM, a node's end) is no stop: fails at once
      INFERENCE_END="$SECONDS $rc"
    elif [[ $rc -eq 137 && $STOPPING -eq 1 ]]; then
      fail "$name" "$rc" "was killed: a SIGTERM that reaches srun itself (the job's hard end) kills its tasks at once; \
the job's lead signal (--slurm.signal-seconds) lets them save first"
    elif [[ $rc -ne 0 ]]; then
      fail "$name" "$rc" failed
    else
      echo "prime-rl: step $name done"
    fi
  done
  if [[ -n $INFERENCE_END ]]; then
    read -r ended rc <<< "$INFERENCE_END"
    if [[ $STOPPING -eq 1 ]]; then
      echo "prime-rl: step inference ended on the stop signal"; INFERENCE_END=""
    elif (( SECONDS - ended >= INFERENCE_GRACE )); then
      fail inference "$rc" "ended"
    fi
  fi
  [[ $STOPPING -eq 0 || -n $STOP_AT ]] || STOP_AT=$((SECONDS + STOP_TIMEOUT))
  if [[ -n $STOP_AT ]] && (( SECONDS > STOP_AT )); then
    fail "${!STEP_PIDS[*]}" 1 "did not stop within ${STOP_TIMEOUT}s of the stop signal"
  fi
  sleep 1 || true  # a SIGTERM to the job kills the sleep: not an error
done
stop_steps
rc=$STOPPED
[[ $rc -ne 0 ]] || echo "prime-rl: done; outputs in $OUTPUT_DIR"
""".strip()


def render_rl(config, argv: list[str]) -> Job:
    from prime_rl.configs.rl import SERVICES

    slurm: SlurmConfig = config.slurm
    output_dir = Path(config.orchestrator.output_dir).resolve()
    if not slurm.multi_node:
        if (slurm.nodes or 1) != 1:
            raise ValueError(
                "rl runs its services on one node: set slurm.inference_nodes and slurm.trainer_nodes to spread them"
            )
        resumable = config.trainer.ckpt is not None
        lines = sbatch_header(slurm, "rl", 1, output_dir, argv, resumable, key_values(config))
        rl = [
            "$PY",
            "-m",
            "prime_rl.entrypoints.rl",
            "@",
            "$OUTPUT_DIR/run/slurm/rl.toml",
            *([RESUME] if resumable else []),
        ]
        lines += ["rc=0", srun(slurm, "--nodes=1", "--ntasks=1") + " " + sh(*rl) + " || rc=$?", finish(slurm)]
        return Job(output_dir, "\n".join(lines) + "\n", {"rl.toml": _toml_data(config, output_dir, SERVICES)})
    return _render_rl_nodes(config, slurm, output_dir, argv)


def _render_rl_nodes(config, slurm: SlurmConfig, output_dir: Path, argv: list[str]) -> Job:
    from prime_rl.launch.services import assign_devices, service_configs

    n_inf, n_train = slurm.inference_nodes or 1, slurm.trainer_nodes or 1
    shared = slurm.nodes == 1
    # Devices: a shared node splits them as `rl` does (its --*-gpu-ids); own nodes give each step all of theirs.
    env, procs = assign_devices(config, slurm.gpus_per_node or 0)
    if not shared and slurm.gpus_per_node:
        env, procs = {s: {} for s in env}, slurm.gpus_per_node
    # The job puts a fresh API key in the steps' environment; the servers listen on every interface.
    layout = f" ({n_train} node(s) x {procs})"
    subs = service_configs(
        config, n_train * procs, key_in_env=True, layout=layout, host="0.0.0.0", self_watch=True, env=env
    )
    configs = {name: _toml_data(sub, output_dir) for name, sub in subs.items()}
    # Each step runs with its service's env_vars, set before Python starts (the entrypoint sets them too).
    env = {name: {**subs[name].env_vars, **env[name]} for name in env}
    key_var, port = config.orchestrator.client.api_key_var, config.inference.server.port
    resumable = config.trainer.ckpt is not None
    commands = _node_commands(config, slurm, procs, n_train, resumable)

    first_trainer = 0 if shared else n_inf
    arrays = f'INFERENCE_NODES=("${{NODES[@]:0:{n_inf}}}")\nTRAINER_NODES=("${{NODES[@]:{first_trainer}:{n_train}}}")'
    lines = sbatch_header(
        slurm, "rl", 1 if shared else n_inf + n_train, output_dir, argv, resumable, key_values(config)
    )
    clear = ["$PY", "-c", CLEAR_PREVIOUS_RUN, "$OUTPUT_DIR"]
    lines += [
        NODE_LISTS.format(arrays=arrays, port=slurm.rdzv_port),
        "# Nothing to resume: a fresh start. What an earlier attempt of this job left (a requeue before the first",
        "# checkpoint, a resubmission) goes first: the orchestrator clears it too late for the trainer beside it.",
        'if [[ -z ${RESUME:-} ]]; then',
        "  " + srun(slurm, "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=$TRAINER_HEAD") + " " + sh(*clear),
        "fi",
        f"export BASE_URLS=$(printf 'http://%s:{port}/v1\\n' \"${{INFERENCE_NODES[@]}}\" | paste -sd,)",
        "# A fresh API key per job, in this job's environment only (every step inherits it): never on disk.",
        f"export {key_var}=$(\"$PY\" -c 'import secrets; print(secrets.token_urlsafe(32))')",
        'echo "prime-rl: inference on ${INFERENCE_NODES[*]}; trainer on ${TRAINER_NODES[*]} (rendezvous '
        '$TRAINER_HEAD:$RDZV_PORT); orchestrator on $TRAINER_HEAD"',
        "declare -A STEP_PIDS",
        srun(slurm, "--overlap", f"--nodes={n_inf}", f"--ntasks={n_inf}", "--ntasks-per-node=1",
             '--nodelist=$(join "${INFERENCE_NODES[@]}")', "--output=$OUTPUT_DIR/logs/inference-%N.log")
        + " " + in_step(commands["inference"], env["inference"]) + " &",
        "STEP_PIDS[inference]=$!",
        srun(slurm, "--overlap", f"--nodes={n_train}", f"--ntasks={n_train}", "--ntasks-per-node=1",
             '--nodelist=$(join "${TRAINER_NODES[@]}")', "--output=$OUTPUT_DIR/logs/trainer-%N.log")
        + " " + in_step(commands["trainer"], env["trainer"]) + " &",
        "STEP_PIDS[trainer]=$!",
        srun(slurm, "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=$TRAINER_HEAD",
             "--output=$OUTPUT_DIR/logs/orchestrator.log")
        + " " + in_step(commands["orchestrator"], env["orchestrator"]) + " &",
        "STEP_PIDS[orchestrator]=$!",
        f"INFERENCE_GRACE=30 STOP_TIMEOUT={math.ceil(config.stop_timeout)}",
        WATCH_STEPS,
        finish(slurm),
    ]  # fmt: skip
    return Job(output_dir, "\n".join(lines) + "\n", {f"{s}.toml": data for s, data in configs.items()})


def _node_commands(config, slurm: SlurmConfig, procs: int, n_train: int, resumable: bool) -> dict[str, list[str]]:
    """The steps' programs: `rl`'s commands on the job's configs, torchrun across the trainer nodes, the
    orchestrator given every server, and the resume flag a requeued or resubmitted job sets."""
    from prime_rl.launch.services import service_commands

    rl_commands = service_commands(Path("$OUTPUT_DIR/run/slurm"), procs, torchrun=True)
    commands = {k: ["$PY", *v[1:]] for k, v in rl_commands.items()}
    if resumable:
        commands["trainer"].append(RESUME)
        commands["orchestrator"].append(RESUME)
    at = commands["trainer"].index("--standalone")
    commands["trainer"][at : at + 1] = torchrun_nodes(n_train)
    commands["orchestrator"] += ["--client.base-url", "$BASE_URLS"]
    if slurm.traffic_share:
        commands["orchestrator"] += ["--client.traffic-share", ",".join(str(s) for s in slurm.traffic_share)]
    if config.trainer.weight_transfer.type == "broadcast":  # trainer rank 0 (on $TRAINER_HEAD) hosts the group
        commands["orchestrator"] += ["--weight-transfer.host", "$TRAINER_HEAD"]
        commands["trainer"] += ["--weight-transfer.host", "$TRAINER_HEAD"]
    return commands


def render_sft(config, argv: list[str]) -> Job:
    slurm: SlurmConfig = config.slurm
    if slurm.multi_node:
        raise ValueError("slurm.inference_nodes / slurm.trainer_nodes are RL layouts; sft trains on slurm.nodes")
    nodes, procs = slurm.nodes or 1, slurm.gpus_per_node or 1
    output_dir = Path(config.output_dir).resolve()
    data = _toml_data(config, output_dir)
    data.setdefault("log", {})["file"] = False  # each node's output is its log
    resumable = config.ckpt is not None
    cmd = ["$PY", "-m", "torch.distributed.run", *torchrun_nodes(nodes), "--nproc-per-node", str(procs),
           "-m", "prime_rl.entrypoints.sft", "@", "$OUTPUT_DIR/run/slurm/sft.toml"]  # fmt: skip
    cmd += [RESUME] if resumable else []
    env = {} if slurm.gpus_per_node else {"CUDA_VISIBLE_DEVICES": ""}
    lines = sbatch_header(slurm, "sft", nodes, output_dir, argv, resumable, key_values(config))
    lines += [
        NODE_LISTS.format(arrays='TRAINER_NODES=("${NODES[@]}")', port=slurm.rdzv_port),
        'echo "prime-rl: sft on ${TRAINER_NODES[*]} (rendezvous $TRAINER_HEAD:$RDZV_PORT)"',
        "rc=0",
        srun(slurm, f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
             "--output=$OUTPUT_DIR/logs/sft-%N.log") + " " + in_step(cmd, env) + " || rc=$?",
        "# Stopped on a signal, progress saved: the trainer recorded it (torchrun exits 0 after a USR1, 1 after",
        "# a SIGTERM it passed on).",
        '[[ ! -f "$OUTPUT_DIR/run/sft.stopped" ]] || rc=3',
        '[[ $rc -ne 0 ]] || echo "prime-rl: done; outputs in $OUTPUT_DIR"',
        finish(slurm),
    ]  # fmt: skip
    return Job(output_dir, "\n".join(lines) + "\n", {"sft.toml": data})


def render(config, service: str, argv: list[str]) -> Job:
    return render_rl(config, argv) if service == "rl" else render_sft(config, argv)


def write_job(job: Job) -> Path:
    """run/slurm/{job.sbatch, *.toml} and logs/ (sbatch does not create the directory of --output)."""
    import tomli_w

    from prime_rl.protocol import atomic_write_text, log_file

    log_file(job.output_dir, "slurm").parent.mkdir(parents=True, exist_ok=True)
    for name, data in job.configs.items():
        atomic_write_text(job_dir(job.output_dir) / name, tomli_w.dumps(data))
    return atomic_write_text(job_dir(job.output_dir) / "job.sbatch", job.script)


def prepare_for_run(config) -> None:
    """As `rl` does before it starts anything, for a fresh run: an earlier run's rollouts and weights go (the
    trainer starts beside the orchestrator, which clears them too late for it). Refused while a live run holds
    the output dir. A resumed run is prepared where it starts (`rl`, or the orchestrator across nodes)."""
    from prime_rl.launch.services import resume_step
    from prime_rl.protocol import prepare_output_dir, run_locks

    if resume_step(config) is not None:
        return
    output_dir = config.orchestrator.output_dir
    with run_locks(output_dir):
        if said := prepare_output_dir(output_dir, None, launcher=True):
            print(f"prime-rl: {said}", file=sys.stderr)


def submit(config, service: str, argv: list[str] | None = None) -> int:
    """Render the job of `config` (`service` = rl or sft); print it (dry run) or write and sbatch it. Exit status."""
    from prime_rl.protocol import RunLocked, UnsafeOutputDir

    argv = sys.argv[1:] if argv is None else argv
    try:
        job = render(config, service, argv)
        if config.slurm.dry_run:
            print(job.script, end="")
            return 0
        if service == "rl":
            prepare_for_run(config)
        script = write_job(job)
    except UnsafeOutputDir as e:  # permanent, as in run_service
        print(f"{service}: {e}", file=sys.stderr)
        return 2
    except (ValueError, RunLocked) as e:
        print(f"{service}: {e}", file=sys.stderr)
        return 1
    try:
        out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        print(f"{service}: sbatch not found (is this a Slurm login node?); the job script is {script}", file=sys.stderr)
        return 1
    if out.returncode != 0:
        print(f"{service}: sbatch failed: {out.stderr.strip()}; the job script is {script}", file=sys.stderr)
        return 1
    job_id = out.stdout.strip().split(";")[0]
    print(f"submitted job {job_id}: {script}")
    print(f"  logs: {job.output_dir}/logs/ (slurm-{job_id}.log and one per service and node)")
    print(f"  follow: squeue -j {job_id}; scontrol show job {job_id}; cancel: scancel {job_id}")
    return 0
