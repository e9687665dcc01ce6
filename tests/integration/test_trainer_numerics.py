"""The trainer's numerics, pinned: loss and gradient norm of the first two SFT and RL steps on the shipped tiny
models, so a change that alters training (a loss normalisation, a masking rule, the optimizer, the data
order) fails here, by name, instead of surfacing as an example that learns less on some machine.

Both runs are the real entrypoints in subprocesses. SFT: the reverse-text example's config on
`assets/reverse-qwen3` (its real data, warmup, held-out rows). RL: the trainer on `assets/tiny-qwen3` with
generated rollouts (`--data.fake`: seeded token ids, advantages and sampler logprobs) and the default loss.

The figures were the same to every printed digit (~1e-16 relative) under OMP_NUM_THREADS=1 and 2 and
under ATEN_CPU_CAPABILITY=avx2 and avx512 (an AMD EPYC with AVX-512); only the held-out loss, a sum over
many more tokens in another order, moved (by 6e-9 relative). RTOL is 1e-5: a thousand times that, and far
below what a change of the objective does (dividing the step's loss by its samples instead of its tokens
makes the first SFT loss 38.72, not 5.53, and fails both cases). Step 1's loss follows the optimizer's
first update, so it pins AdamW too.

If a change is meant to alter training, run this test, check the new figures are what the change should
give, and paste them into PINNED.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
RTOL = 1e-5

PINNED = {  # (service, step): {metric: value}
    ("sft", 0): {"loss": 5.531527723584857, "grad_norm": 9.502030372619629},
    ("sft", 1): {"loss": 5.412201136979372, "grad_norm": 7.532143592834473, "val/loss": 5.2358744},
    ("trainer", 0): {"loss": 0.10513855458550914, "grad_norm": 0.922434389591217},
    ("trainer", 1): {"loss": -1.3858263623583449, "grad_norm": 0.5421964526176453},
}

SFT = ["prime_rl.trainer.sft.train", "@", "configs/examples/reverse_text/sft.toml", "--max-steps", "2"]
RL = [
    "prime_rl.trainer.rl.train", "--model.name", "assets/tiny-qwen3", "--max-steps", "2", "--optim.lr", "3e-4",
    "--data.fake", "--data.fake-seq-len", "256", "--data.fake-micro-batches", "2",
    "--data.fake-min-len", "16", "--data.fake-max-len", "128",
]  # fmt: skip


def first_steps(args: list[str], service: str, out: Path) -> dict[int, dict]:
    result = subprocess.run(
        [sys.executable, "-m", *args, "--output-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return {m["step"]: m for m in map(json.loads, (out / "metrics" / f"{service}.jsonl").open())}


@pytest.mark.parametrize("service,args", [("sft", SFT), ("trainer", RL)], ids=["sft", "rl"])
def test_first_steps_match_the_pinned_loss_and_grad_norm(service, args, tmp_path):
    steps = first_steps(args, service, tmp_path)
    got = {(service, s): {k: steps[s][k] for k in PINNED[(service, s)]} for s in (0, 1)}
    print(json.dumps({f"{k[0]} step {k[1]}": v for k, v in got.items()}, indent=1))
    for key, metrics in got.items():
        for name, value in metrics.items():
            assert value == pytest.approx(PINNED[key][name], rel=RTOL), (
                f"{key[0]} step {key[1]} {name}: {value!r}, pinned {PINNED[key][name]!r} (rtol {RTOL}); "
                "if training is meant to change, update PINNED (see the module docstring)"
            )
