"""The pieces every job script is made of, whatever its layout: the #SBATCH header and the script's start
(`sbatch_header`, with the resume check of a checkpointing run) and end (`finish`: its exit status, the requeue
after a stop), srun lines, and the quoting that keeps every value where it belongs: shell words (`sh`, `in_step`),
sbatch's own argument syntax (`sbatch_arg`), values refused when they would end a line (`one_line`), and the
`# Rendered by` comment with secrets hidden (`argv_comment`, `key_values`). The layouts are launch.py's.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

from prime_rl.configs.slurm import SlurmConfig


class Raw(str):
    """An arg `sh` leaves unquoted: a $VAR holding zero or more words (e.g. $RESUME)."""


RESUME = Raw("$RESUME")


def sh(*args: object) -> str:
    """A shell command line: literal args quoted, args naming a $VAR in double quotes (expanded where it runs)."""
    return " ".join(a if isinstance(a, Raw) else f'"{a}"' if "$" in str(a) else shlex.quote(str(a)) for a in args)


def in_step(cmd: list[str], env: dict[str, str] | None = None) -> str:
    """`cmd` as one srun step's program: its $VARS (SLURM_PROCID too) are expanded on each node by `bash -c`;
    `env` (names, and values taken literally: a user's `env_vars` too) is set for it alone. USR1 starts ignored
    (inherited through exec): torchrun's agent and the inference server have nothing to save, and the services
    that do catch it themselves."""
    prefix = ["env", *(shlex.quote(f"{k}={one_line(f'env var {k}', v)}") for k, v in env.items())] if env else []
    return "bash -c " + shlex.quote('trap "" USR1; exec ' + " ".join([*prefix, sh(*cmd)]))


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
