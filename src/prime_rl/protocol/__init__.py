"""The OUTPUT_DIR contract (DESIGN §2): paths, atomic writes, STABLE markers, waits and heartbeats.

Both sides of every exchange import from here; nothing else formats these paths or polls these files.
`records` (the rank-file format) needs torch and is imported explicitly where used.
"""

from prime_rl.protocol.files import (
    atomic_write,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    checkpoint_steps,
    is_stable,
    mark_stable,
    prune_steps,
    resolve_resume_step,
    stable_steps,
)
from prime_rl.protocol.paths import (
    checkpoint_dir,
    checkpoints_root,
    heartbeat_file,
    list_steps,
    log_file,
    metrics_file,
    orchestrator_checkpoint_file,
    rank_file,
    rollout_step_dir,
    rollouts_dir,
    run_dir,
    step_of,
    trainer_checkpoint_dir,
    weights_dir,
    weights_root,
)
from prime_rl.protocol.wait import (
    Heartbeat,
    WaitTimeout,
    WriterDead,
    heartbeat_age,
    wait_for_rank_file,
    wait_for_weights,
    wait_until,
)

__all__ = [
    "Heartbeat",
    "WaitTimeout",
    "WriterDead",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "checkpoint_dir",
    "checkpoint_steps",
    "checkpoints_root",
    "heartbeat_age",
    "heartbeat_file",
    "is_stable",
    "list_steps",
    "log_file",
    "mark_stable",
    "metrics_file",
    "orchestrator_checkpoint_file",
    "prune_steps",
    "resolve_resume_step",
    "rank_file",
    "rollout_step_dir",
    "rollouts_dir",
    "run_dir",
    "stable_steps",
    "step_of",
    "trainer_checkpoint_dir",
    "wait_for_rank_file",
    "wait_for_weights",
    "wait_until",
    "weights_dir",
    "weights_root",
]
