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

Stopping and resuming (a run with `ckpt`): `#SBATCH --signal=USR1@N` (`slurm.signal_seconds`), `scancel
--signal=USR1` and Slurm's SIGTERM reach every process of the steps; the trainer checkpoints after its current
step and the orchestrator stops with its progress saved (`utils/process.py`), and the run ends with status 3.
With `slurm.requeue` the script then requeues the job; a requeued or resubmitted job finds the trainer's
checkpoint and passes `--ckpt.resume-step=latest`, so it goes on at the next step with none lost or repeated.
"""

from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from prime_rl.configs.slurm import SlurmConfig

KEY_VAR_DEFAULT = "INFERENCE_SERVER_API_KEY"


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


class Raw(str):
    """An arg `sh` leaves unquoted: a $VAR holding zero or more words (e.g. $RESUME)."""


RESUME = Raw("$RESUME")


def sh(*args: object) -> str:
    """A shell command line: literal args quoted, args naming a $VAR in double quotes (expanded where it runs)."""
    return " ".join(a if isinstance(a, Raw) else f'"{a}"' if "$" in str(a) else shlex.quote(str(a)) for a in args)


def in_step(cmd: list[str], env: dict[str, str] | None = None) -> str:
    """`cmd` as one srun step's program: its $VARS (SLURM_PROCID too) are expanded on each node by `bash -c`.
    USR1 starts ignored (inherited through exec): torchrun's agent and the inference server have nothing to
    save, and the services that do catch it themselves."""
    prefix = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
    return "bash -c " + shlex.quote('trap "" USR1; exec ' + sh(*prefix, *cmd))


def torchrun_nodes(nodes: int) -> list[str]:
    """torchrun's static rendezvous across the step's nodes: rank 0 on $TRAINER_HEAD, the first
    node of the step (one task per node: the task rank is the node rank)."""
    return ["--nnodes", str(nodes), "--node-rank", "$SLURM_PROCID", "--rdzv-endpoint", "$TRAINER_HEAD:$RDZV_PORT"]


def sbatch_arg(arg: str) -> str:
    """One argument of a #SBATCH line as sbatch's parser reads it: as is when it holds nothing that parser treats
    specially, else in double quotes (whitespace splits arguments, quotes group, `\\` escapes, `#` starts a
    comment). Bash never reads these lines: to it they are comments."""
    if not re.search(r"[\s\"'\\#]", arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def one_line(what: str, value: object) -> str:
    """`value` as text, refused (ValueError) when a control character in it would end a line of the script."""
    text = str(value)
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in text):
        raise ValueError(f"{what} contains a control character (a newline?): {text!r}; it would end a job script line")
    return text


def sbatch_header(
    slurm: SlurmConfig,
    name: str,
    nodes: int,
    output_dir: Path,
    argv: list[str],
    resumable: bool,
    secrets: tuple[str, ...] = (),
) -> list[str]:
    """The #SBATCH lines and the script's start; `resumable` (the run checkpoints): the stop signal, and
    RESUME set when a trainer checkpoint is there (a requeued or resubmitted job); `secrets`: values the
    `# Rendered by` line must not show."""
    if slurm.requeue and not resumable:
        raise ValueError("slurm.requeue resumes the run from its checkpoints: also set ckpt (e.g. --ckpt.interval 50)")
    cwd, output_dir = one_line("the working directory", Path.cwd()), one_line("output_dir", output_dir)
    options = [f"--job-name={slurm.job_name or name}", f"--nodes={nodes}", "--ntasks-per-node=1"]
    options += [f"--partition={slurm.partition}"] if slurm.partition else []
    options += [f"--account={slurm.account}"] if slurm.account else []
    options += [f"--gpus-per-node={slurm.gpus_per_node}"] if slurm.gpus_per_node else []
    options += [f"--cpus-per-task={slurm.cpus_per_node}"] if slurm.cpus_per_node else []
    options += [f"--time={slurm.time}"] if slurm.time else []
    options += [f"--chdir={cwd}", f"--output={output_dir}/logs/slurm-%j.log"]
    options += ["--requeue", "--open-mode=append"] if slurm.requeue else ["--no-requeue"]
    options += [f"--signal=USR1@{slurm.signal_seconds}"] if resumable and slurm.signal_seconds else []
    options += slurm.extra_sbatch
    lines = ["#!/bin/bash", *(f"#SBATCH {sbatch_arg(o)}" for o in options)]
    comment = argv_comment(name, argv, secrets)
    lines += [f"# Rendered by `{name} --slurm`: {comment}", "set -euo pipefail", *slurm.setup]
    python = one_line("slurm.python", slurm.python or sys.executable)
    lines += [f"export OUTPUT_DIR={shlex.quote(output_dir)}", f"export PY={shlex.quote(python)}"]
    return lines + [RESUME_IF_CHECKPOINTED] if resumable else lines


RESUME_IF_CHECKPOINTED = """# USR1 and SIGTERM are for the steps (they save and stop); this shell waits for them.
trap 'STOPPING=1' USR1 TERM
rm -f "$OUTPUT_DIR"/run/*.stopped  # what an earlier attempt's services recorded
# A requeued or resubmitted job goes on from the newest trainer checkpoint (none yet: it starts over).
export RESUME=""
if compgen -G "$OUTPUT_DIR/checkpoints/step_*/trainer/STABLE" >/dev/null; then
  RESUME="--ckpt.resume-step=latest"
  echo "prime-rl: resuming from the newest checkpoint in $OUTPUT_DIR/checkpoints"
fi"""


def finish(slurm: SlurmConfig) -> str:
    """The script's end: exit with the run's status $rc; 3 = stopped on a signal with its progress saved."""
    requeue = (
        '  scontrol requeue "$SLURM_JOB_ID" && { echo "prime-rl: requeued job $SLURM_JOB_ID: it resumes there '
        'when it starts again"; exit 0; }\n'
    )
    return (
        "if [[ $rc -eq 3 ]]; then\n"
        '  echo "prime-rl: stopped on a signal, progress saved in $OUTPUT_DIR/checkpoints" >&2\n'
        + (requeue if slurm.requeue else "")
        + '  echo "prime-rl: resume it with: sbatch $OUTPUT_DIR/run/slurm/job.sbatch" >&2\n'
        "fi\n"
        "exit $rc"
    )


def srun(slurm: SlurmConfig, *options: str) -> str:
    """An srun line: our options may name the job's $VARS; the user's `srun_args` are data, quoted as such."""
    return " ".join([sh("srun", *options), *map(shlex.quote, slurm.srun_args)])


SECRET_FLAG = re.compile(r"--(?:[\w-]+\.)*api[-_]key(?:=|$)")


def argv_comment(name: str, argv: list[str], secrets: tuple[str, ...] = ()) -> str:
    """The command that rendered the job, for its first lines: secrets (`--...api-key X`, `--...api-key=X`, and
    any of `secrets` wherever it appears) replaced by `***`, and control characters escaped, so that no value can
    end the comment and start a line of shell."""
    shown, hide = [], False
    for arg in argv:
        if hide:
            arg, hide = "***", False
        elif SECRET_FLAG.match(arg):
            if "=" in arg:
                arg = arg.split("=", 1)[0] + "=***"
            else:
                hide = True
        for secret in sorted(secrets, key=len, reverse=True):
            arg = arg.replace(secret, "***")
        shown.append(arg)
    text = shlex.join([name, *shown])
    return "".join(f"\\x{ord(ch):02x}" if ord(ch) < 32 or ord(ch) == 127 else ch for ch in text)


SECRET_VAR = re.compile(r"KEY|TOKEN|SECRET|PASSW", re.IGNORECASE)


def key_values(config) -> tuple[str, ...]:
    """Values the `# Rendered by` line must not show: the API key an `rl` config knows (given, or read from the
    env var it names) and the value of every env var named like a secret (HF_TOKEN, WANDB_API_KEY, ...) that
    is long enough to be one, should the command line hold it."""
    inference = getattr(config, "inference", None)
    values = {inference.api_key} if inference is not None else set()
    values |= {value for name, value in os.environ.items() if SECRET_VAR.search(name) and len(value) >= 8}
    return tuple(value for value in values if value)


NODE_LISTS = """mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
{arrays}
join() {{ local IFS=,; echo "$*"; }}
export TRAINER_HEAD=${{TRAINER_NODES[0]}} RDZV_PORT={port}"""

# A fresh job's first step: the fresh case of `protocol.prepare_output_dir`, the one owner of that rule.
CLEAR_PREVIOUS_RUN = (
    "import pathlib, sys; from prime_rl.protocol import prepare_output_dir; "
    'print("prime-rl:", prepare_output_dir(pathlib.Path(sys.argv[1]), None) or "fresh start")'
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
    subs = service_configs(config, n_train * procs, key_in_env=True, layout=layout, host="0.0.0.0", self_watch=True)
    configs = {name: _toml_data(sub, output_dir) for name, sub in subs.items()}
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

    commands = {k: ["$PY", *v[1:]] for k, v in service_commands(Path("$OUTPUT_DIR/run/slurm"), procs).items()}
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
        if said := prepare_output_dir(output_dir, None):
            print(f"prime-rl: {said}", file=sys.stderr)


def submit(config, service: str, argv: list[str] | None = None) -> int:
    """Render the job of `config` (`service` = rl or sft); print it (dry run) or write and sbatch it. Exit status."""
    from prime_rl.protocol import RunLocked

    argv = sys.argv[1:] if argv is None else argv
    try:
        job = render(config, service, argv)
        if config.slurm.dry_run:
            print(job.script, end="")
            return 0
        if service == "rl":
            prepare_for_run(config)
        script = write_job(job)
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
