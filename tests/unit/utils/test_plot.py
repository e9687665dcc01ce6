"""What `plot` draws, read back from the figure: log loss axes, integer steps, eval error bars of one standard
error, a reward axis that does not zoom into noise, smoothing beside the raw line, and the run's name."""

import json
import math

import pytest
from matplotlib.container import ErrorbarContainer

from prime_rl.protocol import eval_dir, eval_summary_file
from prime_rl.protocol.paths import run_dir
from prime_rl.utils.metrics import MetricsWriter
from prime_rl.utils.plot import draw_runs, eval_rewards, plot_runs


def write(out, service: str, rows: list[dict]) -> None:
    writer = MetricsWriter(out, service)
    for row in rows:
        writer.log(row.pop("step"), row)
    writer.close()


def panel(fig, title: str):
    return next(ax for ax in fig.axes if ax.get_title() == title)


def test_loss_is_log_and_steps_are_integers(tmp_path):
    write(
        tmp_path, "sft", [{"step": s, "loss": 7.0 / (s + 1), **({"val/loss": 3.0} if s == 4 else {})} for s in range(5)]
    )
    write(tmp_path, "orchestrator", [{"step": s, "reward_mean": 0.5} for s in range(5)])
    fig = draw_runs([tmp_path])
    assert panel(fig, "SFT loss").get_yscale() == "log"
    for ax in fig.axes:
        if ax.get_title():
            assert all(t == int(t) for t in ax.get_xticks()), (ax.get_title(), ax.get_xticks())


def test_loss_at_or_below_zero_stays_linear(tmp_path):
    write(tmp_path, "sft", [{"step": s, "loss": 1.0 - s} for s in range(5)])
    assert panel(draw_runs([tmp_path]), "SFT loss").get_yscale() == "linear"


def test_eval_points_carry_one_standard_error_and_the_axis_spans_it(tmp_path):
    # Two envs at steps 0 and 10 (reward_std is a pstdev over `samples`), then an older row without samples/std.
    rows = [{"step": s, "env": env, "samples": 101, "reward_std": std, "reward_mean": mean}
            for s, mean in ((0, 0.570), (10, 0.587)) for env, std in (("a", 0.3), ("b", 0.4))]  # fmt: skip
    write(tmp_path, "eval", rows)
    eval_summary_file(eval_dir(tmp_path)).parent.mkdir(parents=True)
    eval_summary_file(eval_dir(tmp_path)).write_text(json.dumps({"step": 20, "env": "a", "reward_mean": 0.6}) + "\n")
    assert eval_rewards(tmp_path) == [(0, pytest.approx(0.570)), (10, pytest.approx(0.587)), (20, 0.6)]

    ax = panel(draw_runs([tmp_path]), "reward")
    (bars,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    se = math.sqrt((0.3 / 10) ** 2 + (0.4 / 10) ** 2) / 2  # pstdev / sqrt(n - 1) per env; mean of 2 envs
    segments = bars.lines[2][0].get_segments()
    assert [(x0, y0, y1) for (x0, y0), (_, y1) in segments] == [
        (0, pytest.approx(0.570 - se), pytest.approx(0.570 + se)),
        (10, pytest.approx(0.587 - se), pytest.approx(0.587 + se)),
    ]
    (points,) = [line for line in ax.get_lines() if line.get_label() == "eval ± 1 SE"]
    assert list(points.get_xdata()) == [0, 10, 20]  # the row without samples is drawn, without a bar
    lo, hi = ax.get_ylim()
    assert hi - lo >= 0.1 and lo <= 0.570 - se and hi >= 0.6 and 0 <= lo and hi <= 1


def test_reward_axis_is_at_least_a_tenth_wide_and_stays_in_0_1(tmp_path):
    write(tmp_path, "orchestrator", [{"step": s, "reward_mean": 0.99 + 0.001 * (s % 2)} for s in range(5)])
    lo, hi = panel(draw_runs([tmp_path]), "reward").get_ylim()
    assert hi - lo == pytest.approx(0.1) and hi == pytest.approx(1.0, abs=0.005)


def test_an_all_zero_fraction_is_drawn_from_zero_not_below(tmp_path):
    write(tmp_path, "orchestrator", [{"step": s, "truncated_fraction": 0.0} for s in range(20)])
    lo, hi = panel(draw_runs([tmp_path]), "truncated fraction").get_ylim()
    assert -0.005 < lo <= 0.0 and hi - lo >= 0.1


def test_noisy_series_get_a_moving_average_over_the_raw_line(tmp_path):
    write(tmp_path, "orchestrator", [{"step": s, "reward_mean": float(s % 2)} for s in range(20)])
    ax = panel(draw_runs([tmp_path]), "reward")
    (smoothed,) = [line for line in ax.get_lines() if line.get_label() == "train (3-step moving avg)"]
    # Window 3 (~5 % of 20 steps, odd), centred; at the ends the mean of the two points there.
    assert list(smoothed.get_ydata()) == pytest.approx([0.5] + [1 / 3, 2 / 3] * 9 + [0.5])
    (raw,) = [line for line in ax.get_lines() if line.get_label().startswith("_")]
    assert list(raw.get_ydata()) == [float(s % 2) for s in range(20)] and raw.get_alpha() < 1


def test_short_runs_are_drawn_raw(tmp_path):
    write(tmp_path, "orchestrator", [{"step": s, "reward_mean": 0.1 * s} for s in range(5)])
    (line,) = panel(draw_runs([tmp_path]), "reward").get_lines()
    assert line.get_label() == "train" and list(line.get_ydata()) == pytest.approx([0.1 * s for s in range(5)])


def test_title_and_legend_name_the_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("outputs/a", "outputs/b"):
        write(tmp_path / name, "orchestrator", [{"step": s, "reward_mean": 0.5} for s in range(3)])
    run_dir(tmp_path / "outputs/b").mkdir()
    run_dir(tmp_path / "outputs/b").joinpath("orchestrator.toml").write_text('[wandb]\nname = "lr-3e-4"\n')
    fig = draw_runs([tmp_path / "outputs/a", tmp_path / "outputs/b"])
    assert fig._suptitle.get_text() == "outputs/a, lr-3e-4"
    assert panel(fig, "reward").get_legend_handles_labels()[1] == ["outputs/a train", "lr-3e-4 train"]
    assert plot_runs([tmp_path / "outputs/a"], tmp_path / "p", ("png",)) == [tmp_path / "p.png"]
    assert (tmp_path / "p.png").stat().st_size > 0


def test_hand_off_is_step_minus_work_as_in_the_benchmark():
    """The plot drew waits + transfer under "hand-off" while docs/benchmarks.md meant step - work: one
    definition now (plot_data.handoffs), the docstring's worked example included."""
    from prime_rl.utils.plot_data import handoffs

    orchestrator = [
        {"step": 0, "time": 10.0, "time/generate": 9.0},
        {"step": 1, "time": 13.0, "time/generate": 1.0, "time/pack": 0.2, "time/write": 0.1, "time/update_weights": 0.2,
         "time/wait_weights": 0.7},
        {"step": 2, "time": 14.0, "time/generate": 1.0},
    ]  # fmt: skip
    trainer = [{"step": 0, "time/load_data": 0.1, "time/train": 0.8, "time/save_weights": 0.1, "time/wait": 2.0}]
    assert [(s, round(v, 9)) for s, v in handoffs(orchestrator, trainer)] == [(1, 0.5)]  # step 2: no trainer step 1
