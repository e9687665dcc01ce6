"""The OUTPUT_DIR protocol: atomic files, STABLE markers, pruning, rank files, waits (DESIGN §2)."""

import asyncio
import json
import os
import time
from dataclasses import FrozenInstanceError, replace

import numpy as np
import pytest
import torch

from prime_rl.protocol import (
    WaitTimeout,
    WriterDead,
    atomic_write_text,
    clear_previous_run,
    heartbeat_file,
    list_steps,
    mark_stable,
    prune_steps,
    rank_file,
    stable_steps,
    step_of,
    wait_for_rank_file,
    wait_for_weights,
    weights_dir,
    weights_root,
)
from prime_rl.protocol.liveness import RUN_VAR, STARTED
from prime_rl.protocol.records import PackedRow, Sample, read_rank_file, write_rank_file
from tests.samples import sample


def test_atomic_write_leaves_no_temp_files_and_replaces_whole(tmp_path):
    path = tmp_path / "a" / "b.txt"
    atomic_write_text(path, "one")
    atomic_write_text(path, "two")
    assert path.read_text() == "two"
    assert os.listdir(path.parent) == ["b.txt"]


def test_only_stable_dirs_count_and_pruning_keeps_newest(tmp_path):
    root = weights_root(tmp_path)
    for step in range(1, 6):
        weights_dir(tmp_path, step).mkdir(parents=True)
        if step != 5:
            mark_stable(weights_dir(tmp_path, step))
    assert stable_steps(root) == [1, 2, 3, 4]
    assert list_steps(root) == [1, 2, 3, 4, 5]
    removed = prune_steps(root, keep=2, protect=[1])
    assert removed == [2, 3]
    assert list_steps(root) == [1, 4, 5]
    assert step_of(weights_dir(tmp_path, 12)) == 12 and step_of(tmp_path / "step_x") is None


def test_rank_file_round_trip_and_mismatch_is_an_error(tmp_path):
    one = sample([5, 6, 7], 1, [0, 1, 1], [0, -1.5, -0.5])
    mb = PackedRow.pack([one, replace(one, env=1, kept=[[], [2, 3], [4]], policy_steps=[-1, 3, 3])], 0.7, ["a", "b"])
    assert mb.cu_seqlens.tolist() == [0, 3, 6]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 2]]
    write_rank_file(tmp_path, 3, 1, [mb, PackedRow.padding(4, 0.7)])
    loaded = read_rank_file(rank_file(tmp_path, 3, 1), step=3, rank=1)
    for name, value in mb.arrays().items():  # every field back with its dtype and shape
        got = getattr(loaded[0], name)
        assert got.dtype == value.dtype and np.array_equal(got, value), name
    assert (loaded[0].temperature, loaded[0].env_names) == (0.7, ["a", "b"])
    assert not loaded[1].loss_mask.any() and loaded[1].env_names == []
    with pytest.raises(ValueError, match="holds step 3 rank 1, expected 4/1"):
        read_rank_file(rank_file(tmp_path, 3, 1), step=4, rank=1)


def test_a_sample_has_one_entry_per_token_in_every_list_and_packs_without_the_optional_ones():
    with pytest.raises(ValueError, match="2 loss mask entries for 3 tokens"):
        Sample([1, 2, 3], [True, True])
    with pytest.raises(ValueError, match="2 inference logprobs for 3 tokens"):
        Sample([1, 2, 3], [True] * 3, [0.0] * 3, [0.0] * 2)
    for extra in ("kept", "policy_steps", "servers"):
        with pytest.raises(ValueError, match=f"1 {'kept sets' if extra == 'kept' else extra.replace('_', ' ')} for 3"):
            Sample([1, 2, 3], [True] * 3, **{extra: [[]] if extra == "kept" else [0]})
    with pytest.raises(FrozenInstanceError):
        Sample([1], [True]).env = 0
    # No advantage, μ or kept set off the loss mask; an SFT sample (none given) packs as zeros, -1 steps beside others'.
    one = Sample([5, 6, 7], [False, True, False], [1.0] * 3, [-0.5] * 3, kept=[[1], [2, 3], [4]]).masked()
    assert (one.advantages, one.inference_logprobs, one.kept) == ([0.0, 1.0, 0.0], [0.0, -0.5, 0.0], [[], [2, 3], []])
    mb = PackedRow.pack([Sample([8, 9], [True, True]), sample([1, 2], 1, 0.5, policy_steps=[-1, 4])], 1.0)
    mb.validate()
    assert mb.advantages.tolist() == [[0.0, 0.0, 0.5, 0.5]] and mb.inference_logprobs.tolist() == [[0.0] * 4]
    assert mb.policy_steps.tolist() == [[-1, -1, -1, 4]] and mb.kept_ids.size == 0


def test_malformed_micro_batch_is_rejected():
    mb = PackedRow.padding(4, 1.0)
    with pytest.raises(ValueError, match="loss_mask"):
        replace(mb, loss_mask=mb.loss_mask.astype(np.int64)).validate()


def test_wait_times_out_naming_what_it_waited_for(tmp_path):
    start = time.monotonic()
    with pytest.raises(WaitTimeout, match=r"rollouts for step 2 .*rank_0.safetensors"):
        wait_for_rank_file(tmp_path, 2, 0, timeout=0.3, heartbeat_timeout=60)
    assert time.monotonic() - start < 3


def write_heartbeat(output_dir, name: str, at: float, run: str | None = None) -> None:
    beat = {"pid": 1, "host": "h", "run": run, "started": at, "time": at, "progress": at, "units": 0}
    atomic_write_text(heartbeat_file(output_dir, name), json.dumps(beat))


def test_a_writer_of_this_run_silent_for_the_heartbeat_timeout_of_the_wait_is_reported_dead(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_VAR, "run-a")
    write_heartbeat(tmp_path, "trainer-rank0", time.time() - 100, run="run-a")
    start = time.monotonic()
    with pytest.raises(WriterDead, match=r"trainer-rank0 heartbeat is 10\ds old") as e:
        asyncio.run(wait_for_weights(tmp_path, 1, timeout=10, heartbeat_timeout=1))
    assert e.value.writer == "trainer-rank0"
    assert 1 <= time.monotonic() - start < 5  # judged on this wait's silence, not the file's age alone


def test_a_writer_started_by_hand_is_judged_once_it_beat_during_this_process(tmp_path, monkeypatch):
    """Panes: no run id. A beat from before this process started is an earlier run's: the writer has not
    started, and only the wait's own timeout bounds that; one written since then counts."""
    monkeypatch.delenv(RUN_VAR, raising=False)
    write_heartbeat(tmp_path, "trainer-rank0", STARTED - 1000)
    with pytest.raises(WaitTimeout, match="weights of step 1"):
        asyncio.run(wait_for_weights(tmp_path, 1, timeout=2.5, heartbeat_timeout=1))
    write_heartbeat(tmp_path, "trainer-rank0", time.time())  # it started, then went silent
    with pytest.raises(WriterDead, match="trainer-rank0 heartbeat"):
        asyncio.run(wait_for_weights(tmp_path, 1, timeout=10, heartbeat_timeout=1))


def test_an_earlier_runs_heartbeat_does_not_fail_a_new_runs_wait(tmp_path, monkeypatch):
    import threading

    monkeypatch.setenv(RUN_VAR, "run-b")
    write_heartbeat(tmp_path, "trainer-rank0", time.time() - 1000, run="run-a")  # a run that ended long ago

    def new_trainer():  # starts, beats, and writes its weights after more than the heartbeat timeout
        time.sleep(2.5)
        write_heartbeat(tmp_path, "trainer-rank0", time.time(), run="run-b")
        time.sleep(0.5)
        weights_dir(tmp_path, 1).mkdir(parents=True)
        mark_stable(weights_dir(tmp_path, 1))

    threading.Thread(target=new_trainer).start()
    assert asyncio.run(wait_for_weights(tmp_path, 1, timeout=10, heartbeat_timeout=1)) == weights_dir(tmp_path, 1)


def test_wait_returns_once_stable_appears(tmp_path):
    import threading

    def writer():
        time.sleep(0.2)
        weights_dir(tmp_path, 1).mkdir(parents=True)
        mark_stable(weights_dir(tmp_path, 1))

    threading.Thread(target=writer).start()
    assert asyncio.run(wait_for_weights(tmp_path, 1, timeout=5, heartbeat_timeout=5)) == weights_dir(tmp_path, 1)


def test_a_long_wait_is_never_silent():
    import logging

    from prime_rl.protocol.wait import wait_until

    notes: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: notes.append(record.getMessage())
    logger = logging.getLogger("prime_rl")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with pytest.raises(WaitTimeout, match="the rank file"):
            wait_until(lambda: False, "the rank file", timeout=0.5, poll=0.02, note_every=0.2)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert len(notes) == 2 and all(n.startswith("still waiting for the rank file (") for n in notes)


def test_clear_previous_run_removes_rollouts_and_weights_but_keeps_checkpoints(tmp_path):
    for step in (0, 1, 2):
        rank_file(tmp_path, step, 0).parent.mkdir(parents=True)
    for step in (2, 3):
        weights_dir(tmp_path, step).mkdir(parents=True)
        mark_stable(weights_dir(tmp_path, step))
    (tmp_path / "checkpoints" / "step_2").mkdir(parents=True)

    said = clear_previous_run(tmp_path)

    assert said == f"fresh start: removed rollouts/step_0..2, weights/step_2..3 left in {tmp_path} by an earlier run"
    assert list_steps(tmp_path / "rollouts") == [] and list_steps(weights_root(tmp_path)) == []
    assert (tmp_path / "checkpoints" / "step_2").is_dir()
    assert clear_previous_run(tmp_path) == ""


@pytest.mark.parametrize("poll", [0.01, 60.0])  # 60: only an inotify wake-up can be prompt
def test_a_waiter_notices_a_rank_file_within_milliseconds(tmp_path, poll):
    """Hand-offs must not idle: the reader wakes when the writer's rename lands, not at its next backoff tick.

    The writer is another process, as in a run (a thread would share the GIL and its 5 ms switch interval).
    """
    import subprocess
    import sys

    from prime_rl.protocol.wait import DirWatch, wait_until

    if poll > 1 and DirWatch().fd < 0:
        pytest.skip("no inotify on this platform: waits fall back to short polls")
    lags = []
    for step in range(5):
        target = rank_file(tmp_path, step, 0)
        code = (
            "import sys, time; from pathlib import Path; from prime_rl.protocol import atomic_write_text; "
            "time.sleep(0.3); p = Path(sys.argv[1]); p.parent.mkdir(parents=True, exist_ok=True); "
            "atomic_write_text(p, 'x'); print(time.monotonic())"
        )
        writer = subprocess.Popen([sys.executable, "-c", code, str(target)], stdout=subprocess.PIPE, text=True)
        wait_until(target.is_file, "a rank file", timeout=10, watch=target, poll=poll)
        noticed = time.monotonic()
        lags.append(noticed - float(writer.communicate(timeout=10)[0]))
    # The writer's clock stops after its directory fsync, so the reader may even be first (a negative lag).
    assert sorted(lags)[2] < 0.01, lags  # median under 10 ms (was up to 1 s with the growing backoff)


def test_broadcast_buckets_are_runs_of_one_dtype_within_the_byte_limit():
    from prime_rl.protocol.weight_stream import buckets

    f32, bf16 = torch.float32, torch.bfloat16
    specs = [("a", f32, (4,)), ("b", f32, (4,)), ("c", f32, (10,)), ("d", bf16, (2,)), ("e", bf16, (3, 2)),
             ("f", f32, (1,))]  # fmt: skip
    assert buckets(specs, limit=40) == [[0, 1], [2], [3, 4], [5]]  # c (40 bytes) would overflow a+b's bucket
    assert buckets(specs, limit=1) == [[0], [1], [2], [3], [4], [5]]  # each larger than the limit: alone
    assert [i for run in buckets(specs) for i in run] == list(range(len(specs)))


def test_a_truncated_rank_file_is_one_value_error_naming_it(tmp_path):
    """Issue 48, point 9: a rank file cut short (torch.load's `OSError: [Errno 22] Invalid argument` went through as
    a 34-line traceback naming no file) is one line naming the file, at any length."""
    path = write_rank_file(tmp_path, 0, 0, [PackedRow.padding(100_000, 1.0)] * 3)
    data = path.read_bytes()
    reasons = set()
    for n in range(0, len(data), len(data) // 200):
        path.write_bytes(data[:n])
        with pytest.raises(ValueError) as raised:
            read_rank_file(path, 0, 0)
        assert len(str(raised.value).splitlines()) == 1
        assert str(raised.value).startswith(f"{path}: not a readable rank file (cut short or overwritten?): ")
        reasons.add(str(raised.value).split("?): ")[1].split(":")[0])
    assert reasons == {"SafetensorError"}, reasons


def test_a_rank_file_is_data_a_pickle_there_runs_no_code(tmp_path):
    """What a rank file holds is read as tensors and JSON, never unpickled: a pickle put in its place (one that would
    create a file when loaded) is refused as unreadable and nothing runs."""
    import pickle

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = rank_file(tmp_path, 0, 0)
    path.parent.mkdir(parents=True)
    path.write_bytes(pickle.dumps({"version": 5, "step": 0, "rank": 0, "micro_batches": [Payload()]}))
    with pytest.raises(ValueError, match="rank_0.safetensors: not a readable rank file"):
        read_rank_file(path, 0, 0)
    assert not marker.exists()
