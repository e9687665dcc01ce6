"""The terminal progress line: drawn on a terminal only, so `rl` (which captures output into log files) and CI
output never see it, and nothing it does can fail a step."""

from __future__ import annotations

import asyncio
import io

import pytest

from prime_rl.orchestrator.sinks import ProgressLine


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class GoneTerminal(Terminal):
    def write(self, text: str) -> int:
        raise BrokenPipeError("the terminal went away")


async def value(x: int, delay: float) -> int:
    await asyncio.sleep(delay)
    return x


def track(progress: ProgressLine, n: int = 3) -> list[int]:
    # Later coroutines finish first: results must still come back in the order given.
    return asyncio.run(progress.track([value(i, 0.01 * (n - i)) for i in range(n)]))


def test_off_when_the_stream_is_not_a_terminal_and_results_come_back_in_order():
    log_file = io.StringIO()  # what `rl` gives the orchestrator: a file, not a tty
    progress = ProgressLine(None, max_steps=5, stream=log_file)
    assert not progress.enabled
    assert track(progress) == [0, 1, 2]
    progress.close()
    assert log_file.getvalue() == ""


def test_on_a_terminal_one_self_overwriting_line_per_finished_group_then_cleared():
    tty = Terminal()
    progress = ProgressLine(None, max_steps=5, stream=tty)
    progress.step = 2
    assert track(progress) == [0, 1, 2]
    lines = tty.getvalue().split("\r\033[K")[1:]
    assert [line.split(" | ")[:2] for line in lines] == [["step 2/5", f"groups {i}/3"] for i in (1, 2, 3)]
    assert all(line.endswith(" groups/s") and "\n" not in line for line in lines)
    progress.close()
    assert tty.getvalue().endswith("\r\033[K")  # the next log line starts on a clean line


def test_forced_off_on_a_terminal_and_forced_on_elsewhere():
    tty, pipe = Terminal(), io.StringIO()
    track(ProgressLine(False, max_steps=1, stream=tty))
    track(ProgressLine(True, max_steps=1, stream=pipe))
    assert tty.getvalue() == "" and "groups 3/3" in pipe.getvalue()


def test_a_terminal_that_goes_away_turns_the_line_off_instead_of_failing_the_step():
    progress = ProgressLine(None, max_steps=1, stream=GoneTerminal())
    assert track(progress) == [0, 1, 2]
    assert not progress.enabled
    progress.close()


def test_a_resumed_orchestrator_continues_its_wandb_run_and_a_fresh_one_starts_another(tmp_path, monkeypatch):
    """A restart by `rl --restart` or a Slurm requeue resumes the orchestrator: it used to start a second W&B
    run, splitting one training run's curves in two."""
    pytest.importorskip("wandb", reason="the wandb extra is not installed (uv sync --extra wandb)")
    from prime_rl.configs.orchestrator import OrchestratorConfig
    from prime_rl.orchestrator.sinks import build_wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    config = OrchestratorConfig.model_validate(
        {"output_dir": str(tmp_path), "model": {"name": "m"}, "wandb": {"project": "p", "offline": True}}
    )

    def run_id(resumed: bool) -> str:
        sink = build_wandb(config, resumed)
        try:
            return sink.run.id
        finally:
            sink.close()

    first = run_id(False)
    assert run_id(True) == first
    assert run_id(False) != first
