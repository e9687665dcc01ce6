"""A service's Prometheus endpoint (utils/prometheus.py) over real HTTP on loopback: the last step's numbers as
gauges under names Prometheus accepts, the process's memory, /health, and the port given back on close."""

import math
import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prime_rl.configs import PrometheusConfig
from prime_rl.utils.metrics import MetricsWriter, read_metrics
from prime_rl.utils.net import free_port


def scrape(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def writer(tmp_path):
    port = free_port()
    w = MetricsWriter(tmp_path, "trainer", prometheus=PrometheusConfig(port=port, host="127.0.0.1"))
    yield w, port
    w.close()


def test_each_number_of_the_last_step_is_a_gauge_and_the_rest_is_left_out(writer, tmp_path):
    w, port = writer
    before = scrape(port)
    assert "prime_rl_trainer_step" not in before and before["process_resident_memory_bytes"] > 0
    w.log(3, {"loss": 0.5, "time/train": 1.25, "reward/math-v2": 1, "kl": math.nan, "model": "x", "flag": True})
    w.log(4, {"loss": 0.25, "time/train": 1.5})
    metrics = scrape(port)
    assert metrics["prime_rl_trainer_step"] == 4 and metrics["prime_rl_trainer_loss"] == 0.25
    assert metrics["prime_rl_trainer_time_train"] == 1.5 and "prime_rl_trainer_reward_math_v2" not in metrics
    assert metrics["prime_rl_trainer_last_step_timestamp_seconds"] > 1.7e9
    assert [r["step"] for r in read_metrics(tmp_path, "trainer")] == [3, 4]  # the file still gets every record
    w.log(5, {"kl": math.inf, "model": "x", "flag": True})
    metrics = scrape(port)  # a NaN or inf would be a gauge Prometheus cannot graph; text is not a number
    assert "prime_rl_trainer_kl" not in metrics and "prime_rl_trainer_model" not in metrics
    assert metrics["prime_rl_trainer_flag"] == 1.0 and metrics["prime_rl_trainer_step"] == 5


def test_health_says_the_step_and_what_the_work_does_and_other_paths_are_404(writer):
    w, port = writer
    first = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
    assert first.status_code == 200 and first.json()["step"] is None and first.json()["service"] == "trainer"
    w.log(7, {"loss": 1.0})
    answer = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
    assert answer["step"] == 7 and answer["doing"] and answer["silent_s"] >= 0
    assert httpx.get(f"http://127.0.0.1:{port}/other", timeout=10).status_code == 404


def test_close_gives_the_port_back_to_a_restart_and_no_port_serves_nothing(tmp_path):
    port = free_port()
    w = MetricsWriter(tmp_path, "orchestrator", prometheus=PrometheusConfig(port=port, host="127.0.0.1"))
    w.log(0, {"reward/mean": 0.5})
    assert scrape(port)["prime_rl_orchestrator_reward_mean"] == 0.5
    w.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    again = MetricsWriter(tmp_path, "orchestrator", 1, PrometheusConfig(port=port, host="127.0.0.1"))
    again.log(1, {"reward/mean": 0.75})  # a restarted service serves on the same port at once
    assert scrape(port)["prime_rl_orchestrator_reward_mean"] == 0.75
    again.close()
    assert MetricsWriter(tmp_path, "orchestrator", prometheus=PrometheusConfig()).server is None


def test_a_port_taken_by_another_process_is_a_warning_not_a_failed_run(tmp_path, caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        w = MetricsWriter(tmp_path, "trainer", prometheus=PrometheusConfig(port=port, host="127.0.0.1"))
        w.log(0, {"loss": 1.0})  # the run goes on: its metrics file still gets the step
        w.close()
    assert w.server is None and read_metrics(tmp_path, "trainer")[0]["loss"] == 1.0
    assert f"prometheus.port {port}: cannot listen" in caplog.text and "serves no /metrics" in caplog.text
