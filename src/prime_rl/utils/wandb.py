"""The one owner of W&B runs: the orchestrator's (one run for a whole `rl` run) and `sft`'s use it alike.

W&B is an optional extra (`uv sync --extra wandb`), imported only when `[wandb]` is configured; asking for it
without the package is one clear error at start, not a crash at the first step. A run's W&B id is kept in
OUTPUT_DIR/run/wandb.json: a resumed run (`--ckpt.resume-step`, `rl --restart`, a Slurm requeue) continues
that W&B run instead of splitting its curves over two. Each series (`orchestrator`, `trainer`, `inference`,
`sft`, ...) is logged on its own step axis `<series>/step`, so a series that starts late or resumes behind
another is never dropped by W&B's single monotonic step.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from prime_rl.configs.shared import WandbConfig
from prime_rl.protocol import atomic_write_json, wandb_run_file


class WandbError(RuntimeError):
    """W&B logging was asked for but cannot work (the package is missing, the run could not start)."""


class WandbRun:
    """An open W&B run whose series each have their own step axis."""

    def __init__(self, run: Any, series: Iterable[str]):
        self.run = run
        for name in series:
            run.define_metric(f"{name}/step")
            run.define_metric(f"{name}/*", step_metric=f"{name}/step")

    @property
    def id(self) -> str:
        return self.run.id

    def log(self, series: str, step: int, values: dict[str, Any]) -> None:
        self.run.log({f"{series}/step": step, **{f"{series}/{k}": v for k, v in values.items()}})

    def finish(self) -> None:
        self.run.finish()


def open_run(
    config: WandbConfig | None, output_dir: Path, run_config: dict, resumed: bool, series: Iterable[str]
) -> WandbRun | None:
    """The W&B run of the run in `output_dir` (None when `[wandb]` is off): a fresh run starts a W&B run and
    records its id; a resumed one continues the recorded one. Its files go under OUTPUT_DIR/wandb/."""
    if config is None:
        return None
    try:
        import wandb
    except ImportError:
        raise WandbError(
            "wandb logging is on ([wandb] / --wandb) but the wandb package is not installed; "
            "run `uv sync --extra wandb` or drop the [wandb] section"
        ) from None
    record = wandb_run_file(output_dir)
    try:
        run_id = json.loads(record.read_text())["id"] if resumed else None
    except (OSError, ValueError, KeyError, TypeError):
        run_id = None
    run_id = run_id or secrets.token_hex(6)
    try:
        run = wandb.init(
            project=config.project, name=config.name, entity=config.entity, config=run_config,
            mode="offline" if config.offline else "online", dir=str(output_dir), id=run_id, resume="allow",
        )  # fmt: skip
    except Exception as e:  # no API key, no network, a refused project: one line instead of W&B's traceback
        hint = "" if config.offline else " (no network or no login? --wandb.offline logs locally)"
        raise WandbError(f"cannot start the W&B run: {type(e).__name__}: {e}{hint}") from None
    atomic_write_json(record, {"id": run_id})
    return WandbRun(run, series)


def read_offline(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The config and the history rows an offline run recorded in its `run-<id>.wandb` file (what `wandb sync`
    would upload), read with W&B's own record format: checks a run's W&B series with no W&B server."""
    from wandb.proto import wandb_internal_pb2

    config, history = {}, []
    for path in sorted(Path(run_dir).glob("*.wandb")):
        for data in _log_records(path.read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "history":
                history.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
            elif kind in ("run", "config"):
                items = record.run.config.update if kind == "run" else record.config.update
                config |= {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in items}
    return config, history


def _log_records(data: bytes, block: int = 32768) -> Iterator[bytes]:
    """The records of a W&B transaction log: a 7-byte `:W&B` header, then LevelDB-log blocks whose records are
    chunks of (crc 4, length 2, type 1: full / first / middle / last) + payload."""
    if data[:4] != b":W&B":
        raise ValueError("not a W&B transaction log")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending += chunk
        if kind in (1, 4):
            yield pending
            pending = b""


class MirroredMetrics:
    """A metrics writer (utils.metrics.MetricsWriter) whose every record also goes to a W&B run, as one series."""

    def __init__(self, writer: Any, run: WandbRun, series: str):
        self.writer, self.run, self.series = writer, run, series

    def log(self, step: int, metrics: dict) -> None:
        self.writer.log(step, metrics)
        self.run.log(self.series, step, metrics)

    def close(self) -> None:
        self.writer.close()
        self.run.finish()
