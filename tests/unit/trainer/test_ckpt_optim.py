"""Learning-rate schedule values and checkpoint pruning that leaves the orchestrator's files alone."""

import pytest

from prime_rl.protocol import (
    checkpoint_dir,
    list_steps,
    mark_stable,
    orchestrator_checkpoint_file,
    trainer_checkpoint_dir,
)
from prime_rl.trainer.ckpt import prune_checkpoints, should_save
from prime_rl.trainer.config import OptimConfig
from prime_rl.trainer.optim import lr_factor


def test_linear_schedule_with_warmup_docstring_example():
    o = OptimConfig(scheduler="linear", warmup_steps=2)
    assert [lr_factor(s, o, 6) for s in range(6)] == pytest.approx([0.5, 1, 1, 0.75, 0.5, 0.25])
    cosine = OptimConfig(scheduler="cosine")
    assert [lr_factor(s, cosine, 4) for s in range(4)] == pytest.approx([1, 0.8536, 0.5, 0.1464], abs=1e-4)


def test_checkpoints_at_every_interval_and_at_the_end():
    assert [s for s in range(1, 8) if should_save(s, 7, 3)] == [3, 6, 7]
    assert [s for s in range(1, 8) if should_save(s, 7, None)] == [7]


def test_prune_keeps_newest_trainer_checkpoints_and_the_orchestrators_files(tmp_path):
    for step in (2, 4, 6):
        trainer_checkpoint_dir(tmp_path, step).mkdir(parents=True)
        mark_stable(trainer_checkpoint_dir(tmp_path, step))
    orchestrator_checkpoint_file(tmp_path, 2).write_bytes(b"x")
    assert prune_checkpoints(tmp_path, keep=1) == [2, 4]
    assert list_steps(checkpoint_dir(tmp_path, 0).parent) == [2, 6]  # step_4 was empty and went
    assert orchestrator_checkpoint_file(tmp_path, 2).is_file() and not trainer_checkpoint_dir(tmp_path, 2).exists()
    assert prune_checkpoints(tmp_path, keep=None) == []
