"""What hangs off the step (orchestrator.run_step): the parity gate, the evals and the batches' window metrics see
the step through one interface, so the step reads without them. The step calls each hook at its place:

1. `before_policy`: after the step's /health round, before any weight update; True where the step must sample
   from weight step n itself (a parity gate step);
2. `before_generate`: the step's weights are in place (the gate's checksums and canary scores; evals start);
3. `after_batch`: the batch is complete, its rank files not yet written (the run's first batch gives the canaries);
4. `metrics`: the rank files are written; the observer's part of the step's metrics line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prime_rl.orchestrator.batch import Batch
    from prime_rl.orchestrator.servers.client import InferenceClient


class StepObserver:
    """The hooks, each doing nothing here: an observer overrides the ones it needs."""

    async def before_policy(self, client: InferenceClient, step: int) -> bool:
        return False

    async def before_generate(self, client: InferenceClient, step: int) -> None:
        return None

    async def after_batch(self, client: InferenceClient, batch: Batch) -> None:
        return None

    async def metrics(self, client: InferenceClient, step: int, batch: Batch) -> dict[str, Any]:
        return {}


class Observers(StepObserver):
    """Several observers as one, each hook called on every observer in order."""

    def __init__(self, *observers: StepObserver):
        self.observers = observers

    async def before_policy(self, client: InferenceClient, step: int) -> bool:
        return any([await o.before_policy(client, step) for o in self.observers])  # every one called

    async def before_generate(self, client: InferenceClient, step: int) -> None:
        for o in self.observers:
            await o.before_generate(client, step)

    async def after_batch(self, client: InferenceClient, batch: Batch) -> None:
        for o in self.observers:
            await o.after_batch(client, batch)

    async def metrics(self, client: InferenceClient, step: int, batch: Batch) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for o in self.observers:
            out |= await o.metrics(client, step, batch)
        return out
