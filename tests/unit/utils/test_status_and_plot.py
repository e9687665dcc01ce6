"""The live status line's text, the metrics tail it reads, and `plot` on made-up metrics."""

import subprocess
import sys

from prime_rl.launch.console import status_text
from prime_rl.utils.metrics import MetricsWriter, read_metrics, tail_metrics


def write_run(out, steps: int) -> None:
    orchestrator, trainer = MetricsWriter(out, "orchestrator"), MetricsWriter(out, "trainer")
    for step in range(steps):
        shape = {"completion_len_mean": 10.0, "truncated_fraction": 0.0, "off_policy_gap": 1}
        orchestrator.log(step, {"reward_mean": 0.1 * step, "tokens_per_s": 5120.0, "time/generate": 1.0, **shape})
        trainer.log(step, {"loss": 1.0, "mismatch_kl": 1e-3, "time/step": 5.0, "time/train": 2.0, "tokens_per_s": 9.0})
    orchestrator.close()
    trainer.close()


def test_status_line_says_step_reward_eval_throughput_and_eta(tmp_path):
    assert status_text(tmp_path, 20) == "step 0/20 | starting"
    write_run(tmp_path, 7)
    evals = MetricsWriter(tmp_path, "eval")  # the evals during training
    evals.log(5, {"env": "a", "reward_mean": 0.38})
    evals.close()
    assert status_text(tmp_path, 20) == "step 7/20 | reward 0.600 | eval 0.380 | 5,120 tok/s | ETA 1m05s"


def test_tail_reads_only_whole_newest_records(tmp_path):
    write_run(tmp_path, 300)
    tail = tail_metrics(tmp_path, "orchestrator", nbytes=2000)
    assert 5 < len(tail) < 30 and [r["step"] for r in tail] == list(range(300 - len(tail), 300))
    assert tail_metrics(tmp_path, "orchestrator") == read_metrics(tmp_path, "orchestrator")
    assert tail_metrics(tmp_path / "nowhere", "trainer") == []


def test_plot_overlays_runs_into_png_and_svg(tmp_path):
    for name in ("a", "b"):
        write_run(tmp_path / name, 5)
    cmd = [sys.executable, "-m", "prime_rl.utils.plot", str(tmp_path / "a"), str(tmp_path / "b"),
           "--out", str(tmp_path / "cmp")]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(tmp_path / "cmp.png"), str(tmp_path / "cmp.svg")]
    svg = (tmp_path / "cmp.svg").read_text()
    assert "reward" in svg and "mismatch KL" in svg and "SFT loss" not in svg  # only panels with data
    empty = subprocess.run([sys.executable, "-m", "prime_rl.utils.plot", str(tmp_path)], capture_output=True, text=True)
    assert empty.returncode == 1 and "no metrics under" in empty.stderr


def test_status_line_of_a_reused_output_dir_shows_only_this_runs_records(tmp_path):
    """The metrics files hold the previous run's records until each service starts and truncates its own."""
    import time

    from prime_rl.utils.metrics import MetricsWriter

    write_run(tmp_path, 7)
    eval_writer = MetricsWriter(tmp_path, "eval")
    eval_writer.log(5, {"reward_mean": 0.9})
    eval_writer.close()
    since = time.time()
    assert status_text(tmp_path, 20, since) == "step 0/20 | starting"  # not "step 7/20 | reward 0.600 | ..."
    orchestrator = MetricsWriter(tmp_path, "orchestrator")  # the trainer's file is still the old run's
    orchestrator.log(0, {"reward_mean": 0.25, "tokens_per_s": 1000.0})
    orchestrator.close()
    assert status_text(tmp_path, 20, since) == "step 0/20 | reward 0.250 | 1,000 tok/s"
