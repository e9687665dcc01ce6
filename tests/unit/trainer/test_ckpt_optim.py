"""Learning-rate schedule values; checkpoint cadence and pruning (protocol.checkpoints) for both services."""

import pytest

from prime_rl.configs.training import OptimConfig
from prime_rl.protocol import (
    checkpoint_dir,
    checkpoint_due,
    list_steps,
    mark_stable,
    orchestrator_checkpoint_file,
    prune_checkpoints,
    prune_rollouts,
    rollout_step_dir,
    trainer_checkpoint_dir,
)
from prime_rl.trainer.optim import lr_factor


def test_linear_schedule_with_warmup_docstring_example():
    o = OptimConfig(scheduler="linear", warmup_steps=2)
    assert [lr_factor(s, o, 6) for s in range(6)] == pytest.approx([0.5, 1, 1, 0.75, 0.5, 0.25])
    cosine = OptimConfig(scheduler="cosine")
    assert [lr_factor(s, cosine, 4) for s in range(4)] == pytest.approx([1, 0.8536, 0.5, 0.1464], abs=1e-4)


def test_checkpoints_at_every_interval_and_at_the_end():
    assert [s for s in range(0, 8) if checkpoint_due(s, 7, 3)] == [3, 6, 7]
    assert [s for s in range(0, 8) if checkpoint_due(s, 7, None)] == [7]


def test_prune_keeps_newest_trainer_checkpoints_and_the_orchestrators_files(tmp_path):
    for step in (2, 4, 6):
        trainer_checkpoint_dir(tmp_path, step).mkdir(parents=True)
        mark_stable(trainer_checkpoint_dir(tmp_path, step))
    orchestrator_checkpoint_file(tmp_path, 2).write_bytes(b"x")
    assert prune_checkpoints(tmp_path, "trainer", keep=1, max_steps=6, interval=2) == [2, 4]
    assert list_steps(checkpoint_dir(tmp_path, 0).parent) == [2, 6]  # step_4 was empty and went
    assert orchestrator_checkpoint_file(tmp_path, 2).is_file() and not trainer_checkpoint_dir(tmp_path, 2).exists()
    assert prune_checkpoints(tmp_path, "trainer", keep=None, max_steps=6, interval=2) == []


def test_orchestrator_records_off_cadence_only_the_newest(tmp_path):
    """The orchestrator records its progress every step; of the off-cadence records only the newest stays."""
    for step in range(8):
        orchestrator_checkpoint_file(tmp_path, step).parent.mkdir(parents=True, exist_ok=True)
        orchestrator_checkpoint_file(tmp_path, step).write_bytes(b"x")
        prune_checkpoints(tmp_path, "orchestrator", keep=2, max_steps=10, interval=3)
    assert list_steps(checkpoint_dir(tmp_path, 0).parent) == [3, 6, 7]


def test_rollouts_from_the_newest_trainer_checkpoint_on_stay_for_a_resume(tmp_path):
    for step in range(6):
        rollout_step_dir(tmp_path, step).mkdir(parents=True)
    trainer_checkpoint_dir(tmp_path, 2).mkdir(parents=True)
    mark_stable(trainer_checkpoint_dir(tmp_path, 2))
    # The trainer read through step 4; a restart from checkpoint 2 reads steps 2.. again.
    assert prune_rollouts(tmp_path, read_through=4, keep=1, resumable=True) == [0, 1]
    assert list_steps(rollout_step_dir(tmp_path, 0).parent) == [2, 3, 4, 5]
    assert prune_rollouts(tmp_path, read_through=4, keep=1, resumable=False) == [2, 3, 4]


def test_before_the_first_trainer_checkpoint_every_rollout_stays_for_a_restart(tmp_path):
    for step in range(4):
        rollout_step_dir(tmp_path, step).mkdir(parents=True)
    assert prune_rollouts(tmp_path, read_through=2, keep=1, resumable=True) == []


def test_a_checkpoint_an_earlier_shorter_run_saved_at_its_end_is_kept(tmp_path):
    """Resumed with a longer max_steps, step 2 is no longer on this run's cadence; it is a checkpoint all the same."""
    for step in (2, 4):
        trainer_checkpoint_dir(tmp_path, step).mkdir(parents=True)
        mark_stable(trainer_checkpoint_dir(tmp_path, step))
        orchestrator_checkpoint_file(tmp_path, step).write_bytes(b"x")
    orchestrator_checkpoint_file(tmp_path, 3).parent.mkdir(parents=True)
    orchestrator_checkpoint_file(tmp_path, 3).write_bytes(b"x")
    assert prune_checkpoints(tmp_path, "trainer", keep=None, max_steps=4, interval=None) == []
    orchestrator_checkpoint_file(tmp_path, 5).parent.mkdir(parents=True)
    orchestrator_checkpoint_file(tmp_path, 5).write_bytes(b"x")
    assert prune_checkpoints(tmp_path, "orchestrator", keep=None, max_steps=6, interval=None) == [3]
