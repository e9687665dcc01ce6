"""Symbolic links planted where the trainer writes a directory (issue 48, point 11): refused by name before
anything is written, and nothing left behind. A link at weights/step_n.partial was a FileExistsError traceback;
one at weights/step_n was moved to step_n.replaced and left there."""

import os

import pytest
import torch

from prime_rl.protocol import UnsafeOutputDir, weights_dir, weights_root
from prime_rl.trainer.ckpt import Progress, save_checkpoint
from prime_rl.trainer.model import build_model
from prime_rl.trainer.parallel import apply_fsdp
from prime_rl.trainer.weights import build_model_files, save_weights


@pytest.fixture
def model(tiny_model, one_rank):
    model = build_model(str(tiny_model))
    apply_fsdp(model, one_rank, torch.float32)
    return model


@pytest.mark.parametrize("name", ["step_1.partial", "step_1", "step_1.replaced"])
def test_a_link_planted_in_weights_is_refused_by_name_and_its_target_untouched(model, tiny_model, tmp_path, name):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    weights_root(tmp_path).mkdir()
    link = weights_root(tmp_path) / name
    os.symlink(target, link)
    with pytest.raises(UnsafeOutputDir, match=rf"^{link} is a symbolic link \(to {target}\), where a run writes a "
                       r"directory of its own: remove the link$"):  # fmt: skip
        save_weights(model, build_model_files(str(tiny_model)), tmp_path, 1)
    assert sorted(p.name for p in weights_root(tmp_path).iterdir()) == [name]
    assert [p.name for p in target.iterdir()] == ["keep.txt"]
    link.unlink()  # once removed, the same save goes through
    assert save_weights(model, build_model_files(str(tiny_model)), tmp_path, 1) == weights_dir(tmp_path, 1)


def test_a_link_planted_at_a_checkpoint_dir_is_refused_by_name(model, tiny_model, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "checkpoints" / "step_1"
    link.parent.mkdir()
    os.symlink(target, link)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.raises(UnsafeOutputDir, match=rf"^{link} is a symbolic link"):
        save_checkpoint(
            tmp_path, 1, model, optimizer, scheduler, Progress(step=1), build_model_files(str(tiny_model)), 0
        )
    assert list(target.iterdir()) == []
