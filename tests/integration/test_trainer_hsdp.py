"""HSDP (`--parallel.replicate`): 4 real torchrun ranks as 2 replicas x 2 shards train exactly as 4 ranks
sharding one copy do (same losses and statistics every step, same weights after 3 steps, up to the order of
fp32 reductions), and a replicate count that does not divide the ranks is refused naming both."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prime_rl.protocol import weights_dir
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.parallel import apply_fsdp
from prime_rl.utils.hf_layout import iter_safetensors
from prime_rl.utils.metrics import read_metrics
from tests.processes import finish

pytestmark = pytest.mark.slow

TRAIN_PY = Path(__file__).parents[2] / "src" / "prime_rl" / "entrypoints" / "trainer.py"


def four_ranks(tiny_model: Path, out: Path, replicate: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(TRAIN_PY),
           "--model.name", str(tiny_model), "--output-dir", str(out), "--max-steps", "3", "--data.fake",
           "--data.fake-seq-len", "64", "--data.fake-micro-batches", "2", "--data.fake-max-len", "64",
           "--parallel.replicate", str(replicate)]  # fmt: skip
    env = os.environ | {"OMP_NUM_THREADS": "1"}  # both runs sum in the same order within a rank
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def test_two_replicas_of_two_shards_train_as_four_shards_do(tiny_model, tmp_path):
    flat, hsdp = tmp_path / "flat", tmp_path / "hsdp"
    procs = [four_ranks(tiny_model, flat, 1), four_ranks(tiny_model, hsdp, 2)]  # together: imports overlap
    for proc in procs:
        rc, output = finish(proc, "trainer", 300)
        assert rc == 0, output[-6000:]
    assert "HSDP: 2 replicas x 2 shards (4 ranks)" in (hsdp / "logs" / "trainer.log").read_text()
    assert "HSDP" not in (flat / "logs" / "trainer.log").read_text()
    m_flat, m_hsdp = read_metrics(flat, "trainer"), read_metrics(hsdp, "trainer")
    assert [m["step"] for m in m_hsdp] == [0, 1, 2]
    for a, b in zip(m_flat, m_hsdp, strict=True):
        for key in ("loss", "entropy", "grad_norm", "mismatch_kl", "num_loss_tokens"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (a["step"], key)
    a, b = dict(iter_safetensors(weights_dir(flat, 3))), dict(iter_safetensors(weights_dir(hsdp, 3)))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=name)


def test_a_replicate_count_that_does_not_divide_the_ranks_is_refused(tiny_model, one_rank):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TrainerError, match=r"parallel.replicate = 2 does not divide the 1 trainer rank"):
        apply_fsdp(model, one_rank, torch.float32, replicate=2)
