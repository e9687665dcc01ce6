"""Prometheus during a run (utils/prometheus.py): `rl` gives the orchestrator and the trainer a port each and
names every scrape URL in its log; while the run trains, each serves its last step's numbers and its process's
memory on /metrics and its liveness on /health, beside the policy server's and the teacher server's own /metrics
(all four services of a distillation run); once the run ends nothing listens there."""

import re
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prime_rl.protocol.paths import log_file
from prime_rl.utils.net import free_port as another_free_port
from tests.integration.test_rl import descendants, finished, leave_nothing_running, show_logs, small_run, start_rl

pytestmark = pytest.mark.slow


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(url, timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def scrape_urls(rl, out) -> dict[str, str]:
    """service -> its /metrics URL, from the line `rl` logs before it starts the services."""
    deadline = time.monotonic() + 120
    while not (found := re.search(r"Prometheus: (.*) \(and /health\)", read(log_file(out, "rl")))):
        assert rl.poll() is None and time.monotonic() < deadline, rl.stderr.read().decode() + show_logs(out)
        time.sleep(0.05)
    return dict(part.split(" ") for part in found[1].split(", "))


def read(path) -> str:
    return path.read_text() if path.is_file() else ""


def test_the_orchestrator_and_the_trainer_serve_metrics_and_health_while_the_run_trains(
    tiny_model, tmp_path, free_port
):
    out = tmp_path / "out"
    teacher = ["--teacher.model.name", str(tiny_model), "--teacher.server.port", str(another_free_port()),
               "--orchestrator.teacher.kl-coef", "0.5"]  # fmt: skip
    rl = start_rl([*small_run(tiny_model, out, free_port, max_steps=20), *teacher])
    seen: dict[int, str] = {}
    try:
        urls = scrape_urls(rl, out)
        assert set(urls) == {"inference", "teacher", "orchestrator", "trainer"}, urls
        steps: dict[str, set[float]] = {"orchestrator": set(), "trainer": set()}
        last: dict[str, dict[str, float]] = {}
        deadline = time.monotonic() + 240
        while min(len(s) for s in steps.values()) < 3:  # three steps each, scraped while they happen
            assert rl.poll() is None, "the run ended before three steps were scraped\n" + show_logs(out)
            assert time.monotonic() < deadline, f"scraped steps {steps}\n" + show_logs(out)
            seen |= descendants(rl.pid)
            for name in steps:
                try:
                    last[name] = scrape(urls[name])
                except httpx.TransportError:
                    continue  # not listening yet: it serves from its first step on
                if f"prime_rl_{name}_step" in last[name]:
                    steps[name].add(last[name][f"prime_rl_{name}_step"])
            time.sleep(0.05)
        health = {name: httpx.get(urls[name].replace("/metrics", "/health"), timeout=10) for name in steps}
        server, teacher = scrape(urls["inference"]), scrape(urls["teacher"])
        finished(rl, out, seen)
    finally:
        leave_nothing_running(rl, seen)
    print(f"steps scraped live: {steps}")
    trainer, orchestrator = last["trainer"], last["orchestrator"]
    for key in ("loss", "mismatch_kl", "grad_norm", "tokens_per_s", "time_wait", "peak_memory_gib"):
        assert f"prime_rl_trainer_{key}" in trainer, sorted(trainer)
    for key in ("reward_mean", "weight_step", "time_step"):
        assert f"prime_rl_orchestrator_{key}" in orchestrator, sorted(orchestrator)
    assert trainer["process_resident_memory_bytes"] > 100e6 and orchestrator["process_resident_memory_bytes"] > 0
    assert server["prime_rl_inference_generated_tokens_total"] > 0
    assert teacher["prime_rl_inference_requests_total"] > 0  # it scored the samples: prompts, no generation
    for name, answer in health.items():
        assert answer.status_code == 200 and answer.json()["service"] == name and answer.json()["step"] >= 2
    for name in steps:  # the run is over: its services are gone, and their endpoints with them
        with pytest.raises(httpx.ConnectError):
            httpx.get(urls[name], timeout=5)
