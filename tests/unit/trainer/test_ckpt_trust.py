"""Nothing read from a checkpoint on the shared filesystem runs code; a damaged index is one clear error."""

import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from prime_rl.protocol import mark_stable
from prime_rl.trainer.ckpt import CheckpointError, load_hf_state_dict


class Payload:
    """What an attacker plants as `.metadata`: unpickling it calls os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (__import__("os").system, (f"touch {self.marker}",))


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "checkpoints" / "step_1" / "trainer"
    dcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id=path, no_dist=True)
    mark_stable(path)
    return path


def test_a_real_checkpoint_index_loads(checkpoint):
    assert torch.equal(load_hf_state_dict(checkpoint)["w"], torch.ones(2))


def test_a_planted_pickle_never_runs(checkpoint, tmp_path):
    marker = tmp_path / "pwned"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(
        CheckpointError, match=r"\.metadata: not a readable checkpoint index: refusing to load posix.system"
    ):
        load_hf_state_dict(checkpoint)
    assert not marker.exists()
    # convert-checkpoint says so in one line and exits 1 (it used to run the payload).
    out = tmp_path / "hf"
    result = subprocess.run(
        [sys.executable, "-m", "prime_rl.entrypoints.convert", str(checkpoint), str(out)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1 and "refusing to load" in result.stderr and "Traceback" not in result.stderr
    assert not marker.exists()


def test_a_truncated_index_names_the_checkpoint(checkpoint):
    index = checkpoint / ".metadata"
    index.write_bytes(index.read_bytes()[:40])
    with pytest.raises(CheckpointError, match=rf"{index}: not a readable checkpoint index"):
        load_hf_state_dict(checkpoint)


@pytest.mark.parametrize(("name", "what"), [("__0_0.distcp", "trainer checkpoint"), ("rng_rank0.pt", "RNG state")])
def test_a_truncated_shard_or_rng_file_is_one_error_naming_it(tiny_model, tmp_path, one_rank, name, what):
    """Issue 48, point 9: a cut-short shard was DCP's CheckpointException (a BaseException: a raw traceback)."""
    from prime_rl.trainer.ckpt import Progress, load_checkpoint, save_checkpoint
    from prime_rl.trainer.model import build_model
    from prime_rl.trainer.weights import build_model_files

    model = build_model(str(tiny_model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    path = save_checkpoint(
        tmp_path, 1, model, optimizer, scheduler, Progress(step=1), build_model_files(str(tiny_model)), 0
    )
    damaged = path / name
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 3])
    shown = path if name.endswith(".distcp") else damaged
    with pytest.raises(CheckpointError, match=rf"^{shown}: not a readable {what} \(cut short or overwritten\?\): "):
        load_checkpoint(tmp_path, 1, model, optimizer, scheduler, 0)
