"""What one server's Prometheus `GET /metrics` says, in one vocabulary for both backends (the built-in engine's
`prime_rl_inference_*`, vLLM's `vllm:*`): the pool reads it for each server's in-flight limiter (concurrency.py),
`ServerMetrics` (metrics.py) for the run's `inference/*` metrics."""

from __future__ import annotations

from statistics import fmean

# series -> the sample names of either backend, and whether servers' values add up (else they are averaged)
SERIES: dict[str, tuple[tuple[str, ...], bool]] = {
    "requests_running": (("vllm:num_requests_running", "prime_rl_inference_running"), True),
    "requests_waiting": (("vllm:num_requests_waiting", "prime_rl_inference_waiting"), True),
    "kv_cache_usage": (("vllm:kv_cache_usage_perc",), False),
    "generated_tokens": (("vllm:generation_tokens_total", "prime_rl_inference_generated_tokens_total"), True),
    "batch_capacity": (("prime_rl_inference_max_batch_size",), True),
}
_SAMPLES = {name: series for series, (names, _) in SERIES.items() for name in names}


def parse_metrics(text: str) -> dict[str, float]:
    """The series one server's Prometheus text has. A metric with several label sets (vLLM's per model and
    engine) is summed, or averaged for a fraction. Raises ValueError on text that is not Prometheus'."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (series := _SAMPLES.get(sample.name)) is not None:
                values.setdefault(series, []).append(sample.value)
    return {k: sum(v) if SERIES[k][1] else fmean(v) for k, v in values.items()}
