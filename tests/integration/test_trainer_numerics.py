"""The trainer's numerics, pinned: loss and gradient norm of the first two SFT and RL steps on the shipped tiny
models, so a change that alters training (a loss normalisation, a masking rule, the optimizer, the data
order) fails here, by name, instead of surfacing as an example that learns less on some machine.

Both runs are the real entrypoints in subprocesses. SFT: `assets/reverse-qwen3` on reverse-text's reference
answers with warmup and held-out rows (SFT_CONFIG), with AdamW and with Muon (the reverse-text example's
optimizer). RL: the trainer on `assets/tiny-qwen3` with generated rollouts (`--data.fake`: seeded token
ids, advantages and sampler logprobs) and the default loss.

Measured on an AMD EPYC (AVX-512): under OMP_NUM_THREADS=1 and 2 and under ATEN_CPU_CAPABILITY=avx2 and
avx512, step 0 is the same to every printed digit and the RL steps too; SFT's step 1 and held-out loss
move by at most 8e-8 relative between thread counts (sums over many tokens in another order), Muon's step
1 by at most 1.4e-7 (its grad norm and held-out loss, 2 threads or AVX2 vs 1 thread AVX-512). RTOL is
1e-5: a hundred times that, and far below what a change of the objective does (dividing the step's loss
by its samples instead of its tokens makes the first SFT loss 71.9, not 5.56, and fails every case). Step
1's loss follows the optimizer's first update, so it pins AdamW and Muon too.

If a change is meant to alter training, run this test, check the new figures are what the change should
give, and paste them into PINNED.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import finish

ROOT = Path(__file__).parents[2]
RTOL = 1e-5

PINNED = {  # (case, step): {metric: value}
    ("sft", 0): {"loss": 5.5587024135866026, "grad_norm": 6.830073833465576},
    ("sft", 1): {"loss": 5.449097251342422, "grad_norm": 5.876521587371826, "val/loss": 5.297915367983947},
    # Muon (the reverse-text example's SFT optimizer): step 0 is AdamW's; step 1 follows Muon's first update.
    ("sft-muon", 0): {"loss": 5.5587024135866026, "grad_norm": 6.830073833465576},
    ("sft-muon", 1): {"loss": 5.5345016171678, "grad_norm": 6.960588455200195, "val/loss": 5.488803764585116},
    ("rl", 0): {"loss": 0.10513855458550914, "grad_norm": 0.922434389591217},
    ("rl", 1): {"loss": -1.3858263623583449, "grad_norm": 0.5421964526176453},
}

# Every setting that shapes the numbers is here, not borrowed from an example config that may be retuned.
SFT_CONFIG = """
model.name = "assets/reverse-qwen3"
seq_len = 512
batch_size = 32
max_steps = 2
seed = 0
optim.lr = 3e-3
optim.warmup_steps = 50

[data]
env_id = "reverse-text"
env_args = { min_chars = 3, max_chars = 16 }
env_examples = 256
env_seed = 1

[val]
data = { env_id = "reverse-text", env_args = { min_chars = 3, max_chars = 16 }, env_examples = 64, env_seed = 2 }
interval = 10
"""
RL = [
    "prime_rl.entrypoints.trainer", "--model.name", "assets/tiny-qwen3", "--max-steps", "2", "--optim.lr", "3e-4",
    "--data.fake", "--data.fake-seq-len", "256", "--data.fake-micro-batches", "2",
    "--data.fake-min-len", "16", "--data.fake-max-len", "128",
]  # fmt: skip


CASES = {  # case: (entrypoint args, the metrics file it writes)
    "sft": (["prime_rl.entrypoints.sft"], "sft"),
    "sft-muon": (["prime_rl.entrypoints.sft", "--optim.type", "muon"], "sft"),
    "rl": (RL, "trainer"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[subprocess.Popen, Path]]:
    """Every case's run, started together: each is one process that keeps one core busy (importing, mostly), so the
    three side by side take ~13 s here, one after another ~21 s."""
    started = {}
    for case, (args, _) in CASES.items():
        root = tmp_path_factory.mktemp(case)
        if args[0] == "prime_rl.entrypoints.sft":
            (root / "sft.toml").write_text(SFT_CONFIG)
            args = [args[0], "@", str(root / "sft.toml"), *args[1:]]
        cmd = [sys.executable, "-m", *args, "--output-dir", str(root / "run")]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        started[case] = (proc, root / "run")
    yield started
    for proc, _ in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("case", list(CASES))
def test_first_steps_match_the_pinned_loss_and_grad_norm(case, runs):
    proc, out = runs[case]
    rc, output = finish(proc, case, timeout=300)
    assert rc == 0, output[-3000:]
    steps = {m["step"]: m for m in map(json.loads, (out / "metrics" / f"{CASES[case][1]}.jsonl").open())}
    got = {(case, s): {k: steps[s][k] for k in PINNED[(case, s)]} for s in (0, 1)}
    print(json.dumps({f"{k[0]} step {k[1]}": v for k, v in got.items()}, indent=1))
    for key, metrics in got.items():
        for name, value in metrics.items():
            assert value == pytest.approx(PINNED[key][name], rel=RTOL), (
                f"{key[0]} step {key[1]} {name}: {value!r}, pinned {PINNED[key][name]!r} (rtol {RTOL}); "
                "if training is meant to change, update PINNED (see the module docstring)"
            )
