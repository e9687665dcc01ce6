"""The HTTP side of the contract: what an inference server stamps on a response for the orchestrator."""

from __future__ import annotations

from typing import Any

# The policy step whose weights produced a completion; the orchestrator checks it against its staleness bound.
WEIGHT_STEP_HEADER = "x-weight-step"


def weight_step(headers: Any) -> int | None:
    """The `x-weight-step` a server stamped on a completion response, if any."""
    value = headers.get(WEIGHT_STEP_HEADER)
    return int(value) if value is not None and value.isdigit() else None
