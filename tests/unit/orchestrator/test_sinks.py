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


def offline_history(output_dir) -> list[dict]:
    """Every history row of the offline W&B runs under output_dir (W&B's own record file, as `wandb sync` reads)."""
    import wandb

    from prime_rl.utils.wandb import read_offline

    wandb.teardown()  # W&B's writer may still be flushing after `finish`: what a process's exit waits for
    return [row for run_dir in sorted((output_dir / "wandb").glob("offline-run-*")) for row in read_offline(run_dir)[1]]


@pytest.mark.parametrize("backend", ["builtin", "vllm"])
def test_the_servers_numbers_reach_the_wandb_run_and_a_silent_server_is_left_out(
    backend, calc_servers, tmp_path, monkeypatch, caplog
):
    """Both backends' /metrics become inference/* on the run's W&B run; a server that never answers its /metrics
    (a socket that takes the connection and says nothing) is warned about once and left out, the others' numbers
    still come."""
    pytest.importorskip("wandb", reason="the wandb extra is not installed (uv sync --extra wandb)")
    import socket

    from prime_rl.configs.orchestrator import OrchestratorConfig
    from prime_rl.orchestrator.servers.client import InferenceClient
    from prime_rl.orchestrator.servers.metrics import ServerMetrics
    from prime_rl.orchestrator.sinks import build_wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    server = calc_servers.ready(backend)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    urls = [f"{server.url}/v1", f"http://127.0.0.1:{silent.getsockname()[1]}/v1"]
    config = OrchestratorConfig.model_validate(
        {"output_dir": str(tmp_path), "model": {"name": str(server.model)}, "client": {"base_url": urls},
         "wandb": {"project": "p", "offline": True}}
    )  # fmt: skip
    sink = build_wandb(config)

    async def steps() -> None:
        async with InferenceClient(config.client, config.model.name) as client:
            async with ServerMetrics(client) as sink.servers:
                for step in range(2):
                    body = {"model": str(server.model), "prompt": "1+2=", "max_tokens": 16, "min_tokens": 16}
                    await asyncio.to_thread(server.post, "/v1/completions", body)
                    await asyncio.sleep(2.5)  # two reads of the servers (each waits out the silent one: 1 s)
                    sink.log(step, {"reward_mean": 0.5})

    with caplog.at_level("WARNING", logger="prime_rl"):
        asyncio.run(steps())
    sink.close()
    silent.close()
    warnings = [r.getMessage() for r in caplog.records if "/metrics" in r.getMessage()]
    assert len(warnings) == 1 and urls[1] in warnings[0], warnings

    rows = [row for row in offline_history(tmp_path) if "inference/step" in row]
    assert [row["inference/step"] for row in rows] == [0, 1]
    for row in rows:
        assert row["inference/servers"] == 1  # the silent one is left out
        assert row["inference/requests_running"] >= 0 and row["inference/requests_waiting"] >= 0
        assert row["inference/generated_tokens"] >= 16
    assert rows[1]["inference/generated_tokens"] >= rows[0]["inference/generated_tokens"] + 16
    assert rows[1]["inference/generated_tokens_per_s"] > 0
    if backend == "vllm":
        assert 0 <= rows[0]["inference/kv_cache_usage"] <= 1
    assert any(row.get("orchestrator/reward_mean") == 0.5 for row in offline_history(tmp_path))
