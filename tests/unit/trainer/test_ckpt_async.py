"""Checkpoints written in the background (`AsyncCheckpointer`): what is written is the state when the save
started, even though the next steps change the parameters (CPU ones too) while the write goes on; STABLE only
after the write; a failed write is an error naming the checkpoint, not a missing STABLE found later."""

import time

import pytest
import torch

from prime_rl.protocol import is_stable
from prime_rl.trainer.ckpt import AsyncCheckpointer, CheckpointError, Progress, load_checkpoint, load_hf_state_dict
from prime_rl.trainer.model import build_model
from prime_rl.trainer.parallel import apply_fsdp
from prime_rl.trainer.weights import build_model_files
from prime_rl.utils.tiny_model import create_tiny_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    # ~35 MB of state with AdamW: its write takes long enough that the mutations below land while it runs.
    return create_tiny_model(tmp_path_factory.mktemp("models") / "qwen3-h256", hidden_size=256, num_layers=4)


def _training(path):
    model = build_model(str(path))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


def _step(model, optimizer, scheduler):
    loss = sum((p.float() ** 2).sum() for p in model.parameters())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def test_the_checkpoint_holds_the_state_when_the_save_started(model_path, tmp_path, one_rank):
    model, optimizer, scheduler = _training(model_path)
    apply_fsdp(model, one_rank, torch.float32)  # one rank in fp32: a plain module, its parameters CPU tensors
    _step(model, optimizer, scheduler)  # AdamW state exists (exp_avg, exp_avg_sq)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]

    checkpointer = AsyncCheckpointer(rank=0)
    path = checkpointer.start(
        tmp_path, 1, model, optimizer, scheduler, Progress(step=1), build_model_files(str(model_path))
    )
    # Right away, while the thread writes: the next steps change parameters and optimizer state in place.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    _step(model, optimizer, scheduler)
    in_flight = checkpointer.in_flight
    assert not in_flight.future.done(), "the write ended before the state changed: this test proves nothing"
    assert not is_stable(path)  # STABLE only once the write ended
    # ... and then at once, not at the next save: a crash before that resumes from this checkpoint.
    in_flight.future.result()
    deadline = time.monotonic() + 10
    while not is_stable(path):  # the done callback runs just after the future's waiters wake
        assert time.monotonic() < deadline, f"{path} written but not marked STABLE within 10 s"
        time.sleep(0.01)

    assert checkpointer.finish() is in_flight and is_stable(path)
    assert in_flight.write_seconds > 0

    saved = load_hf_state_dict(path)
    for name, value in params.items():
        assert torch.equal(saved[name], value), name
    fresh_model, fresh_optimizer, fresh_scheduler = _training(model_path)
    progress = load_checkpoint(tmp_path, 1, fresh_model, fresh_optimizer, fresh_scheduler, 0)
    assert progress.step == 1 and fresh_scheduler.last_epoch == 1
    for p, expected in zip(fresh_model.parameters(), moments, strict=True):
        assert torch.equal(fresh_optimizer.state[p]["exp_avg"], expected)
    assert checkpointer.finish() is None  # nothing in flight any more

    # The next save copies into the same host buffers: it holds the new state, the first checkpoint stays.
    later = {n: p.detach().clone() for n, p in model.named_parameters()}
    path2 = checkpointer.start(
        tmp_path, 2, model, optimizer, scheduler, Progress(step=2), build_model_files(str(model_path))
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert checkpointer.finish().step == 2 and is_stable(path2)
    second, first = load_hf_state_dict(path2), load_hf_state_dict(path)
    for name, value in later.items():
        assert torch.equal(second[name], value) and torch.equal(first[name], params[name]), name
    checkpointer.close()


class _Unwritable:
    """A state entry that copies (staging) but cannot be serialized (the write, in the background)."""

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        raise TypeError("this object cannot be written")


class _Factor:
    """An lr factor whose attributes LambdaLR puts into its state dict."""

    def __init__(self):
        self.tag = _Unwritable()

    def __call__(self, step):
        return 1.0


def test_a_failed_background_write_is_an_error_naming_the_checkpoint_never_stable(tiny_model, tmp_path, one_rank):
    model = build_model(str(tiny_model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _Factor())
    checkpointer = AsyncCheckpointer(rank=0)
    files = build_model_files(str(tiny_model))

    path = checkpointer.start(tmp_path, 1, model, optimizer, scheduler, Progress(step=1), files)  # staging works
    with pytest.raises(CheckpointError, match=rf"writing checkpoint {path} failed: rank 0: .*cannot be written"):
        checkpointer.finish()
    assert not is_stable(path) and checkpointer.in_flight is None

    # A next save goes on: the same step again, into a clean dir.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    checkpointer.start(tmp_path, 1, model, optimizer, scheduler, Progress(step=1), files)
    assert checkpointer.finish().path == path and is_stable(path)
