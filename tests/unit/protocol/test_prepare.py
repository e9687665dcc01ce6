"""Fresh or resumed: what `prepare_output_dir` leaves of an earlier run, and the launcher's lock pair."""

import pytest

from prime_rl.protocol import (
    RunLock,
    RunLocked,
    UnsafeOutputDir,
    atomic_write_text,
    list_steps,
    mark_stable,
    prepare_output_dir,
    rank_file,
    rollouts_dir,
    run_locks,
    run_record_file,
    weights_dir,
    weights_root,
)


def earlier_run(out) -> None:
    """Rollouts of steps 0..4 (complete), weights of steps 3 and 4, a checkpoint at step 3, and the record every
    command writes at its start."""
    atomic_write_text(run_record_file(out), "{}")
    for step in range(5):
        rank_file(out, step, 0).parent.mkdir(parents=True)
        mark_stable(rank_file(out, step, 0).parent)
    for step in (3, 4):
        weights_dir(out, step).mkdir(parents=True)
        mark_stable(weights_dir(out, step))
    (out / "checkpoints" / "step_3").mkdir(parents=True)


def test_a_fresh_run_clears_rollouts_and_weights_and_keeps_checkpoints(tmp_path):
    earlier_run(tmp_path)
    said = prepare_output_dir(tmp_path, None)
    assert said == f"fresh start: removed rollouts/step_0..4, weights/step_3..4 left in {tmp_path} by an earlier run"
    assert list_steps(rollouts_dir(tmp_path)) == [] and list_steps(weights_root(tmp_path)) == []
    assert (tmp_path / "checkpoints" / "step_3").is_dir()


def test_step_dirs_no_prime_rl_run_wrote_are_refused_and_left_alone(tmp_path):
    """Issue 48, point 8: a fresh run deleted rollouts/step_* and weights/step_* wherever it was pointed (the
    current directory, for `--output-dir ""`). Without the record of a prime-rl run there, nothing is deleted."""
    earlier_run(tmp_path)
    run_record_file(tmp_path).unlink()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for resume_step in (None, 3):
        with pytest.raises(
            UnsafeOutputDir,
            match=rf"^{tmp_path} holds rollouts/step_0, rollouts/step_1, "
            r"rollouts/step_2 and 5 more but no run/versions.json: no prime-rl run wrote them",
        ):
            prepare_output_dir(tmp_path, resume_step, launcher=True)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_resumed_run_drops_rollouts_from_its_start_step_on_and_keeps_the_rest(tmp_path):
    earlier_run(tmp_path)
    said = prepare_output_dir(tmp_path, 3)
    assert said == "resuming at step 3: removed rollouts/step_3..4 of the interrupted run"
    assert list_steps(rollouts_dir(tmp_path)) == [0, 1, 2]  # a trainer resumed at an earlier step reads them
    assert list_steps(weights_root(tmp_path)) == [3, 4]
    assert prepare_output_dir(tmp_path, 3) == ""


def test_run_locks_hold_both_roles_and_children_join_with_the_token(tmp_path):
    with run_locks(tmp_path) as token:
        for role in ("orchestrator", "trainer"):
            with pytest.raises(RunLocked):
                RunLock(tmp_path, role).acquire()
            assert RunLock(tmp_path, role, token=token).acquire().joined
    with RunLock(tmp_path, "trainer"):  # released
        pass


def test_only_a_launcher_clears_the_heartbeats_a_service_may_share_with_live_peers(tmp_path):
    """`rl` and a Slurm job clear the heartbeats before their services start; the orchestrator's own fresh
    start, with the trainer of its run already beating, must not delete that trainer's beat."""
    from prime_rl.protocol import Heartbeat, heartbeat_file

    with Heartbeat(tmp_path, "trainer-rank0", interval=60):
        prepare_output_dir(tmp_path, None)
        assert heartbeat_file(tmp_path, "trainer-rank0").is_file()
    prepare_output_dir(tmp_path, None, launcher=True)
    assert not heartbeat_file(tmp_path, "trainer-rank0").exists()
