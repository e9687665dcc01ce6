"""The real `sft` entrypoint on the shipped debug config and dataset (tiny model from assets/).

4 straight steps == 2 steps with --ckpt + --ckpt.resume-step 2 for 2 more (same weights within 1e-6; the
data order, position in the epoch and lr schedule resume too), and the two halves log to one W&B run (offline,
read back from W&B's own record files). A malformed row fails with file:line.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from prime_rl.protocol import checkpoint_steps, is_stable, wandb_run_file, weights_dir
from prime_rl.utils.metrics import read_metrics
from tests.processes import finish

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
SFT = Path(sys.executable).parent / "sft"


def _sft(out: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    # batch 12 of 48 rows, 4 steps = one epoch; shuffled order and the cosine schedule must both resume.
    cmd = [str(SFT), "@", str(ROOT / "configs/sft/debug.toml"), "--output-dir", str(out), "--batch-size", "12",
           "--optim.scheduler", "cosine", "--max-steps", "4", "--data.path", str(ROOT / "configs/sft/debug/data.jsonl"),
           "--model.name", str(ROOT / "assets/tiny-qwen3"), *extra]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)


def _wandb(tmp: Path) -> tuple[list[str], dict]:
    """Flags and environment of an offline W&B run whose settings and cache stay in `tmp` (no network, no login)."""
    pytest.importorskip("wandb", reason="the wandb extra is not installed (uv sync --extra wandb)")
    env = os.environ | {"WANDB_DIR": str(tmp), "WANDB_CONFIG_DIR": str(tmp), "WANDB_CACHE_DIR": str(tmp)}
    return ["--wandb.project", "sft-test", "--wandb.offline"], env


def summary(output: str) -> dict[str, str]:
    """The rows of the summary sft ends with: {"steps": "4/4", ...}."""
    rows = output[output.index(" sft INFO run summary") :].splitlines()[1:]
    return dict(re.fullmatch(r"\S+ sft INFO   (.+?)  +(.*)", row).groups() for row in rows)


def _finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str]:
    return finish(proc, "sft", timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    bad = root / "bad.jsonl"
    bad.write_text('{"prompt": "ab", "completion": "ba"}\n{"prompt": "ab"}\n')
    wandb, env = _wandb(root)
    procs = {
        "straight": _sft(root / "straight", "--log.interval", "3"),
        "first_half": _sft(root / "resumed", "--ckpt.interval", "2", "--weights-interval", "2", *wandb, env=env),
        "bad": _sft(root / "bad", "--data.path", str(bad)),
    }
    yield procs, root
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_sft_resume_matches_an_uninterrupted_run(runs):
    procs, root = runs
    rc, output = _finish(procs["first_half"])
    assert rc == 0, output[-6000:]
    resumed = root / "resumed"
    # The summary ends with the command that goes on from the newest checkpoint: the user's own arguments.
    said = summary(output)
    assert said["checkpoints"] == f"{resumed}/checkpoints/step_4 (newest of this run's 2)"
    command, note = said["resume"].split("  ")
    assert shlex.split(command) == ["uv", "run", "sft", *procs["first_half"].args[1:], "--ckpt.resume-step", "latest"]
    assert note == "(raise --max-steps to train further)"
    assert checkpoint_steps(resumed, ("trainer",)) == [2, 4]
    # Restart from step 2 as if the run had stopped there (the step-4 checkpoint is ignored); it overlaps
    # the straight run, which is still going.
    run_id = json.loads(wandb_run_file(resumed).read_text())["id"]
    second_half = _sft(resumed, "--ckpt.resume-step", "2", *_wandb(root)[0], env=_wandb(root)[1])
    rc, output = _finish(procs["straight"])
    assert rc == 0, output[-6000:]
    # --log.interval 3: the step lines of steps 0 (the first), 2 and 3 (the last); the metrics get every step.
    assert re.findall(r" sft INFO step (\d+) \|", output) == ["0", "2", "3"]
    straight = root / "straight"
    assert (straight / "plots" / "run.png").stat().st_size > 10_000
    said = summary(output)
    assert said["steps"] == "4/4" and said["weights"] == f"{straight}/weights/final (-> step_4)", said
    assert said["checkpoints"] == "no checkpoints (add --ckpt)", said
    assert said["plots"].startswith(f"{straight}/plots/run.png, {straight}/plots/run.svg "), said
    assert re.fullmatch(r"\d\.\d{3} -> \d\.\d{3} \(mean loss of the first 1 and the last 1 of 4 steps\)", said["loss"])
    rc, output = _finish(second_half)
    assert rc == 0, output[-6000:]
    a = load_file(weights_dir(root / "straight", 4) / "model.safetensors")
    b = load_file(weights_dir(resumed, 4) / "model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)
    assert is_stable(weights_dir(resumed, 2))  # weights_interval 2
    straight, again = read_metrics(root / "straight", "sft"), read_metrics(resumed, "sft")
    assert [m["step"] for m in again] == [0, 1, 2, 3]  # steps 2-3 once: the resumed run's records replace them
    assert [m["epoch"] for m in straight] == [1, 1, 1, 1]  # 4 x 12 of 48 rows: all from the first epoch
    for x, y in zip(straight[2:], again[2:], strict=True):
        for key in ("loss", "lr", "num_tokens", "progress/samples"):
            assert x[key] == pytest.approx(y[key], rel=1e-5), key
    assert straight[-1]["loss"] < straight[0]["loss"]  # it learns
    assert (resumed / "logs" / "sft.log").is_file()
    # W&B: the resumed half went on in the first half's run; every step's record is there once per sitting.
    from prime_rl.utils.wandb import read_offline

    assert json.loads(wandb_run_file(resumed).read_text())["id"] == run_id
    run_dirs = sorted((resumed / "wandb").glob("offline-run-*"))
    assert [d.name.rsplit("-", 1)[1] for d in run_dirs] == [run_id, run_id]  # one W&B run, in two sittings
    (config, first_rows), (_, second_rows) = (read_offline(d) for d in run_dirs)
    rows = [row for row in first_rows + second_rows if "sft/step" in row]
    assert [row["sft/step"] for row in rows] == [0, 1, 2, 3, 2, 3]  # steps 2-3 again after the resume from 2
    for row, record in zip(rows[:2] + rows[-2:], again, strict=True):
        assert row["sft/loss"] == pytest.approx(record["loss"]) and row["sft/epoch"] == record["epoch"]
    assert config["model"]["name"] == str(ROOT / "assets/tiny-qwen3") and config["wandb"]["offline"] is True


def test_malformed_row_names_file_and_line(runs):
    procs, root = runs
    rc, output = _finish(procs["bad"])
    assert rc == 1
    assert "bad.jsonl:2: needs both 'prompt' and 'completion'" in output and "Traceback" not in output


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)


def test_a_stop_signal_to_one_rank_stops_both_after_the_same_step_and_the_run_resumes(tmp_path):
    """torchrun, 2 ranks; USR1 reaches rank 1 only: both stop after the same step (a rank going on alone
    would hang in the next step's collectives), rank 0 writes the checkpoint of that step and run/sft.stopped,
    torchrun exits 0 (resuming it: test_slurm.py's sft job)."""
    import os
    import signal
    import time

    from prime_rl.protocol import stopped_file
    from prime_rl.utils.process import children

    out, steps = tmp_path / "out", 40
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "prime_rl.entrypoints.sft", "@", str(ROOT / "configs/sft/debug.toml"), "--output-dir", str(out),
           "--max-steps", str(steps), "--ckpt", "--data.path", str(ROOT / "configs/sft/debug/data.jsonl"),
           "--model.name", str(ROOT / "assets/tiny-qwen3")]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    deadline = time.monotonic() + 120
    while len(read_metrics(out, "sft")) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    rank1 = [pid for pid in children(proc.pid) if _environ(pid).get("RANK") == "1"]
    assert len(rank1) == 1, rank1
    os.kill(rank1[0], signal.SIGUSR1)
    rc, output = _finish(proc)
    assert rc == 0, output[-6000:]
    stopped = json.loads(stopped_file(out, "sft").read_text())["step"]
    assert 2 <= stopped < steps, output[-3000:]
    assert (
        f"stopped on a stop signal (on another rank) after {stopped} step(s): checkpoint checkpoints/step_{stopped}"
        in output
    )  # rank 0 got no signal: it stopped because rank 1 did
    assert checkpoint_steps(out, ("trainer",)) == [stopped]
    assert [m["step"] for m in read_metrics(out, "sft")] == list(range(stopped))


def _held_out_nll(weights: Path, rows: Path) -> float:
    """Mean NLL per completion token of `rows` under `weights`, scored by transformers (not the trainer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prime_rl.configs.sft import SFTDataConfig
    from prime_rl.trainer.sft.data import build_samples

    model = AutoModelForCausalLM.from_pretrained(weights, torch_dtype=torch.float32).eval()
    samples, _ = build_samples(SFTDataConfig(path=rows), AutoTokenizer.from_pretrained(weights), 256)
    nll, count = 0.0, 0
    with torch.no_grad():
        for s in samples:
            logits = model(torch.tensor([s.input_ids])).logits[0, :-1].double()
            targets = torch.tensor(s.input_ids[1:])
            mask = torch.tensor(s.loss_mask[1:])
            nll -= float(logits.log_softmax(-1).gather(1, targets[:, None])[:, 0][mask].sum())
            count += int(mask.sum())
    return nll / count


def test_held_out_loss_ends_the_run_at_its_target_and_final_names_that_step(tmp_path):
    out, rows = tmp_path / "run", ROOT / "configs/sft/debug/data.jsonl"
    held_out = ["--val.data.path", str(rows), "--val.interval", "2"]
    # Any loss is below 1000: the run stops at its first evaluation (step 2 of 4).
    rc, output = _finish(_sft(out, *held_out, "--val.stop-below", "1000"))
    assert rc == 0, output[-6000:]
    assert "< val.stop-below 1000: stopping" in output
    said = summary(output)
    assert re.fullmatch(r"2/4 \(stopped early: held-out loss [\d.]+ < val.stop-below 1000\)", said["steps"]), said
    assert re.fullmatch(r"best [\d.]+ after 2 steps, last [\d.]+", said["held-out loss"]), said
    metrics = read_metrics(out, "sft")
    assert [m["step"] for m in metrics] == [0, 1] and "val/loss" in metrics[1] and "val/loss" not in metrics[0]
    final = out / "weights" / "final"
    assert final.resolve() == weights_dir(out, 2).resolve() and is_stable(final)
    assert metrics[1]["val/loss"] == pytest.approx(_held_out_nll(final, rows), rel=1e-5)

    # Again in the same output dir, with no target: all 4 steps, held-out loss at 2 and 4, final moves on.
    rc, output = _finish(_sft(out, *held_out))
    assert rc == 0, output[-6000:]
    metrics = read_metrics(out, "sft")
    assert [m["step"] for m in metrics if "val/loss" in m] == [1, 3]
    assert final.resolve() == weights_dir(out, 4).resolve()
    assert metrics[3]["val/loss"] < metrics[1]["val/loss"]  # it learns the rows it is scored on
