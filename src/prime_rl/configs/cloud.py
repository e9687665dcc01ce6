"""The `[cloud]` section of `rl`: render the run as a SkyPilot or dstack task (`rl --cloud.launcher skypilot ...`)
instead of running it here. Imports no torch."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from prime_rl.configs import Section


def _pattern(regex: str, what: str):
    def check(value: str | None) -> str | None:
        if value is not None and not re.fullmatch(regex, value):
            raise ValueError(f"{value!r}: {what}")
        return value

    return AfterValidator(check)


class CloudConfig(Section):
    """Write the run as a multi-node task of SkyPilot (`sky launch`) or dstack (`dstack apply`) instead of running
    it here: inference nodes first, then trainer nodes; the first trainer node also runs the orchestrator."""

    launcher: Annotated[Literal["skypilot", "dstack"], Field(description="whose task file to write")]
    volume: Annotated[
        str,
        _pattern(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", "lowercase letters, digits and '-' (a volume name)"),
        Field(description="a network volume every node mounts: the run's shared output dir"),
    ]
    name: Annotated[
        str,
        _pattern(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", "lowercase letters, digits and '-', a letter first"),
        Field(description="the task's name, and its dir on the volume"),
    ] = "prime-rl"
    mount: Annotated[
        str,
        _pattern(r"/[-_./a-zA-Z0-9]*", "an absolute path of letters, digits, '-', '_', '.' and '/'"),
        Field(description="where the volume is mounted; OUTPUT_DIR is <mount>/<name>"),
    ] = "/outputs"
    inference_nodes: Annotated[int, Field(ge=1, description="nodes running one inference server each")] = 1
    trainer_nodes: Annotated[int, Field(ge=1, description="nodes of the trainer (torchrun)")] = 1
    accelerators: Annotated[
        str | None,
        _pattern(r"[A-Za-z0-9-]+:[1-9][0-9]*", "NAME:COUNT, e.g. H100:8"),
        Field(description="each node's GPUs (NAME:COUNT, e.g. H100:8; COUNT trainer ranks a node); unset: CPU"),
    ] = None
    setup: Annotated[list[str], Field(description="shell lines each node runs first, in the project's directory")] = [
        "uv sync --locked --extra vllm"
    ]
    rdzv_port: Annotated[int, Field(ge=1, le=65535, description="torchrun's rendezvous on the first trainer node")] = (
        29500
    )
    metrics_port: Annotated[
        int, Field(ge=1, le=65535, description="the orchestrator's and the trainer's Prometheus port")
    ] = 9400

    @property
    def gpus_per_node(self) -> int:
        return int(self.accelerators.rsplit(":", 1)[1]) if self.accelerators else 0
