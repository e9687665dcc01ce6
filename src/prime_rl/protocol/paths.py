"""Every path of the OUTPUT_DIR layout (docs/design.md §2). No other module formats these names."""

from __future__ import annotations

import re
from pathlib import Path

STABLE = "STABLE"
_STEP = re.compile(r"^step_(\d+)$")


def run_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "run"


def run_record_file(output_dir: Path) -> Path:
    """`run/versions.json`: written by every command before anything else (utils/run_record.py), so a dir that
    holds it is one a prime-rl run wrote; only there may a run delete the step dirs it finds (protocol.prepare)."""
    return run_dir(output_dir) / "versions.json"


def stopped_file(output_dir: Path, service: str) -> Path:
    """Present while `service`'s last run stopped on a stop signal (not done): what a job script checks."""
    return run_dir(output_dir) / f"{service}.stopped"


def wandb_run_file(output_dir: Path) -> Path:
    """{"id"}: the W&B run a resumed or restarted orchestrator continues."""
    return run_dir(output_dir) / "wandb.json"


def servers_file(output_dir: Path) -> Path:
    """{"base_url", "traffic_share"}: the orchestrator's inference servers, which an operator may rewrite while
    the run goes on (orchestrator/servers/fleet.py)."""
    return run_dir(output_dir) / "servers.json"


def log_file(output_dir: Path, service: str) -> Path:
    return Path(output_dir) / "logs" / f"{service}.log"


def metrics_file(output_dir: Path, service: str) -> Path:
    return Path(output_dir) / "metrics" / f"{service}.jsonl"


def rollouts_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "rollouts"


def rollout_step_dir(output_dir: Path, step: int) -> Path:
    return rollouts_dir(output_dir) / f"step_{step}"


def rank_file(output_dir: Path, step: int, rank: int) -> Path:
    return rollout_step_dir(output_dir, step) / f"rank_{rank}.safetensors"


def weights_root(output_dir: Path) -> Path:
    return Path(output_dir) / "weights"


def weights_dir(output_dir: Path, step: int) -> Path:
    return weights_root(output_dir) / f"step_{step}"


def final_weights_dir(output_dir: Path) -> Path:
    """`weights/final`: a link to the `step_n` an `sft` run ended on (its last step, or where it stopped early),
    so a config that starts from an SFT run's weights names no step."""
    return weights_root(output_dir) / "final"


def broadcast_root(output_dir: Path) -> Path:
    """`step_n.json`: the trainer is about to send weight step n over the broadcast group (protocol.broadcast)."""
    return Path(output_dir) / "broadcast"


def checkpoints_root(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return checkpoints_root(output_dir) / f"step_{step}"


def heartbeat_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "heartbeat"


def heartbeat_file(output_dir: Path, name: str) -> Path:
    """`name` is `orchestrator` or `trainer-rank{r}`."""
    return heartbeat_dir(output_dir) / f"{name}.json"


def step_of(path: Path) -> int | None:
    """The n of a `step_n` directory name, else None."""
    m = _STEP.match(Path(path).name)
    return int(m.group(1)) if m else None


def list_steps(parent: Path) -> list[int]:
    """Sorted step numbers of the `step_n` entries under `parent` (complete or not)."""
    if not Path(parent).is_dir():
        return []
    return sorted(s for s in (step_of(p) for p in Path(parent).iterdir()) if s is not None)


def trainer_checkpoint_dir(output_dir: Path, step: int) -> Path:
    """DCP shards of trainer state after `step` optimizer steps; complete when it holds STABLE."""
    return checkpoint_dir(output_dir, step) / "trainer"


def orchestrator_checkpoint_file(output_dir: Path, step: int) -> Path:
    """Orchestrator progress when it is about to produce rollouts for `step`."""
    return checkpoint_dir(output_dir, step) / "orchestrator.json"


def step_dir(parent: Path, step: int) -> Path:
    """`parent/step_n`, for a weights folder given by the user (e.g. `eval --weights-dir`)."""
    return Path(parent) / f"step_{step}"


def eval_dir(output_dir: Path) -> Path:
    """A run's `eval` results, read by `plot`; `eval --output-dir D` writes its results in D itself (so
    `--output-dir RUN/eval` puts them beside a run), not in D/eval/."""
    return Path(output_dir) / "eval"


def eval_samples_file(results_dir: Path, step: int, env_name: str) -> Path:
    """Per-sample results of `eval` for one environment at one weight step (`results_dir`: eval's output dir)."""
    return Path(results_dir) / f"step_{step}" / f"{env_name}.jsonl"


def eval_summary_file(results_dir: Path) -> Path:
    """One JSON line per (step, environment) evaluated (`results_dir`: eval's output dir, or a run's `eval_dir`)."""
    return Path(results_dir) / "summary.jsonl"
