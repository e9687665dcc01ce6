"""The end-of-run summary of `rl` and `sft`, built from real metrics files, weights and checkpoints on disk; the
SFT progress line; the live line off a terminal."""

import json
import time

from prime_rl.protocol import eval_dir, eval_summary_file, orchestrator_checkpoint_file
from prime_rl.protocol.paths import STABLE
from prime_rl.utils.console import LiveLine
from prime_rl.utils.metrics import MetricsWriter
from prime_rl.utils.summary import ThisRun, first_last, resume_command, rl_summary, sft_summary


def log(out, service: str, rows: list[dict], first_step: int = 0) -> None:
    writer = MetricsWriter(out, service, first_step)
    for step, row in enumerate(rows, start=first_step):
        writer.log(step, row)
    writer.close()


def stable(path) -> None:
    path.mkdir(parents=True)
    (path / STABLE).touch()


def test_first_and_last_tenth_are_at_least_one_step():
    assert first_last([1.0, 2.0, 3.0]) == (1.0, 3.0, 1)
    assert first_last([float(i) for i in range(20)]) == (0.5, 18.5, 2)


def test_rl_summary_of_a_run_without_checkpoints(tmp_path):
    log(tmp_path, "orchestrator", [{"reward_mean": 0.1 * s} for s in range(20)])
    log(tmp_path, "trainer", [{"loss": 1.0} for _ in range(20)])
    log(tmp_path, "eval", [{"reward_mean": r} for r in (0.2, 0.5, 0.4)])  # steps 0, 1, 2
    eval_summary_file(eval_dir(tmp_path)).parent.mkdir()
    eval_summary_file(eval_dir(tmp_path)).write_text(json.dumps({"step": 1, "env": "b", "reward_mean": 0.7}) + "\n")
    for step in (19, 20):
        stable(tmp_path / "weights" / f"step_{step}")
    (tmp_path / "weights" / "step_21").mkdir()  # being written: not the newest weights
    plots = [tmp_path / "plots" / "run.png"]
    lines = rl_summary(tmp_path, 20, 65.0, ["@", "configs/debug/rl.toml"], plots)
    assert lines == [
        "run summary",
        "  wall time    1m05s",
        "  steps        20/20",
        "  reward       0.050 -> 1.850 (mean reward of the first 2 and the last 2 of 20 steps)",
        "  best eval    0.600 at step 1 (mean reward over the eval environments)",  # (0.5 + 0.7) / 2, as plotted
        f"  weights      {tmp_path}/weights/step_20",
        "  checkpoints  no checkpoints (add --ckpt)",
        f"  plots        {tmp_path}/plots/run.png (uv run plot DIR [DIR ...] to compare runs)",
        "  resume       not possible without checkpoints: add --ckpt (or --ckpt.interval N) to the command",
    ]


def test_rl_summary_names_the_newest_complete_checkpoint_and_the_resume_command(tmp_path):
    log(tmp_path, "orchestrator", [{"reward_mean": 0.5}] * 4)
    log(tmp_path, "trainer", [{"loss": 1.0}] * 4)
    for step in (2, 4):
        stable(tmp_path / "checkpoints" / f"step_{step}" / "trainer")
        orchestrator_checkpoint_file(tmp_path, step).touch()
    stable(tmp_path / "checkpoints" / "step_6" / "trainer")  # no orchestrator part: incomplete
    argv = ["@", "my rl.toml", "--ckpt.interval", "2", "--ckpt.resume-step", "2", "--max-steps", "4"]
    lines = rl_summary(tmp_path, 4, 3.0, argv, [])
    assert f"  checkpoints  {tmp_path}/checkpoints/step_4 (newest of this run's 2)" in lines
    assert (
        "  resume       uv run rl @ 'my rl.toml' --ckpt.interval 2 --max-steps 4 --ckpt.resume-step latest"
        "  (raise --max-steps to train further)"
    ) in lines
    assert "  weights      none written" in lines and not any("best eval" in line for line in lines)


def test_rl_summary_reports_and_advises_only_this_runs_checkpoints(tmp_path):
    """A plain run in a dir where an earlier run checkpointed step 40 used to end with that checkpoint and a
    `--ckpt.resume-step latest` that resumed the earlier run. Checkpoints completed before this run started are
    not its own: none of its own, no resume advice; its own step 4 with the earlier step 40 newer: the step by
    number, since `latest` would take step 40; a resumed run's own lineage includes the checkpoint it resumed."""
    import os

    log(tmp_path, "orchestrator", [{"reward_mean": 0.5}] * 4)
    log(tmp_path, "trainer", [{"loss": 1.0}] * 4)

    def checkpoint(step: int, when: float) -> None:
        stable(tmp_path / "checkpoints" / f"step_{step}" / "trainer")
        orchestrator_checkpoint_file(tmp_path, step).touch()
        for path in (tmp_path / "checkpoints" / f"step_{step}" / "trainer" / STABLE,
                     orchestrator_checkpoint_file(tmp_path, step)):  # fmt: skip
            os.utime(path, (when, when))

    checkpoint(40, 1000.0)  # the earlier run's
    lines = rl_summary(tmp_path, 4, 3.0, ["@", "rl.toml"], [], ThisRun(started=2000.0))
    said = dict(line.strip().split(maxsplit=1) for line in lines[1:] if not line.startswith("  wall"))
    assert said["checkpoints"] == f"none of this run (add --ckpt); {tmp_path}/checkpoints/step_40 is an earlier run's"
    assert said["resume"].startswith("not possible without checkpoints")
    checkpoint(4, 2100.0)  # this run's
    lines = rl_summary(tmp_path, 4, 3.0, ["@", "rl.toml", "--ckpt"], [], ThisRun(started=2000.0))
    assert f"  checkpoints  {tmp_path}/checkpoints/step_4 (newest of this run's 1)" in lines
    assert (
        "  resume       uv run rl @ rl.toml --ckpt --ckpt.resume-step 4  (raise --max-steps to train further)" in lines
    )
    lines = rl_summary(tmp_path, 50, 3.0, ["--ckpt.resume-step", "40"], [], ThisRun(started=3000.0, resumed_from=40))
    assert f"  checkpoints  {tmp_path}/checkpoints/step_40 (newest of this run's 1)" in lines
    assert any(line.endswith("--ckpt.resume-step latest  (raise --max-steps to train further)") for line in lines)


def test_resume_command_replaces_an_earlier_resume_step():
    assert resume_command("sft", ["--ckpt.resume-step=3", "--ckpt"]) == "uv run sft --ckpt --ckpt.resume-step latest"


def test_sft_summary_of_a_run_stopped_early_on_its_held_out_loss(tmp_path):
    rows = [{"loss": 3.0 - 0.1 * s} for s in range(12)]
    rows[4]["val/loss"], rows[9]["val/loss"], rows[11]["val/loss"] = 1.5, 0.9, 1.1
    log(tmp_path, "sft", rows)
    stable(tmp_path / "weights" / "step_12")
    (tmp_path / "weights" / "final").symlink_to("step_12")
    stable(tmp_path / "checkpoints" / "step_12" / "trainer")
    lines = sft_summary(tmp_path, 40, 7265.0, ["@", "sft.toml"], [], "stopped early: held-out loss 1.1 < 1.2")
    assert lines == [
        "run summary",
        "  wall time      2h01m",
        "  steps          12/40 (stopped early: held-out loss 1.1 < 1.2)",
        "  loss           3.000 -> 1.900 (mean loss of the first 1 and the last 1 of 12 steps)",
        "  held-out loss  best 0.9 after 10 steps, last 1.1",
        f"  weights        {tmp_path}/weights/final (-> step_12)",
        f"  checkpoints    {tmp_path}/checkpoints/step_12 (newest of this run's 1)",
        "  plots          none",
        "  resume         uv run sft @ sft.toml --ckpt.resume-step latest  (raise --max-steps to train further)",
    ]


def test_sft_progress_line_of_a_reused_output_dir(tmp_path):
    from prime_rl.trainer.sft.train import status_text

    log(tmp_path, "sft", [{"loss": 9.0, "val/loss": 9.0, "tokens_per_s": 1.0, "time/step": 9.0}] * 50)  # last run
    since = time.time()
    assert status_text(tmp_path, 340, since) == "step 0/340 | starting"
    assert status_text(tmp_path, 340).startswith("step 50/340 | loss 9")  # what it showed before
    rows = [{"loss": 2.0, "tokens_per_s": 2100.0, "time/step": 0.5} for _ in range(120)]
    rows[109]["val/loss"], rows[-1]["loss"] = 0.45, 1.23
    log(tmp_path, "sft", rows)
    assert status_text(tmp_path, 250, since) == "step 120/250 | loss 1.23 | val 0.45 | 2,100 tok/s | ETA 1m05s"


def test_live_line_off_a_terminal_prints_plain_lines_and_draws_nothing(capsys):
    drawn = []
    with LiveLine(lambda: drawn.append(1) or "status") as line:
        line.print("a [bold]line[/bold]")
        line.update()
    assert capsys.readouterr().out == "a [bold]line[/bold]\n" and drawn == []
