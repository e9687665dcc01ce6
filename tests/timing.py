"""Where the suite's time goes: a pytest plugin that records, per test (setup + call + teardown), its wall time and
the whole machine's busy and idle CPU over it (/proc/stat: its servers and background jobs too), and a report of
those records by module.

    uv run python -m pytest -p tests.timing      # appends to suite-timing.jsonl (SUITE_TIMING=PATH elsewhere)
    uv run python -m tests.timing suite-timing.jsonl [--top 30]

A module whose `util` (busy / (busy + idle)) is near 1 keeps both cores busy: running it beside another would only
share them. The idle core-seconds are what parallel workers could fill at most.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

OUT = Path(os.environ.get("SUITE_TIMING", "suite-timing.jsonl"))


def machine_cpu() -> tuple[float, float]:
    """(busy, idle) CPU seconds of every core since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    busy = fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + (fields[7] if len(fields) > 7 else 0)
    return busy / tick, (fields[3] + fields[4]) / tick


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    (busy, idle), start = machine_cpu(), time.monotonic()
    yield
    busy2, idle2 = machine_cpu()
    record = {"id": item.nodeid, "wall": time.monotonic() - start, "busy": busy2 - busy, "idle": idle2 - idle}
    with OUT.open("a") as f:
        f.write(json.dumps(record) + "\n")


def report(path: Path, top: int) -> str:
    modules: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for record in map(json.loads, path.open()):
        m = modules[record["id"].split("::", 1)[0]]
        m[0] += 1
        m[1] += record["wall"]
        m[2] += record["busy"]
        m[3] += record["idle"]
    rows = sorted(modules.items(), key=lambda kv: -kv[1][1])
    total = [sum(v[i] for v in modules.values()) for i in range(4)]
    lines = ["| module | tests | wall s | busy core-s | idle core-s | util |", "| --- | --- | --- | --- | --- | --- |"]
    for name, (n, wall, busy, idle) in [*rows[:top], ("**all**", total)]:
        lines.append(f"| {name} | {n} | {wall:.0f} | {busy:.0f} | {idle:.0f} | {busy / max(busy + idle, 1e-9):.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    if not args.path.is_file():
        parser.error(f"{args.path}: no such file (record one with `python -m pytest -p tests.timing`)")
    print(report(args.path, args.top))
