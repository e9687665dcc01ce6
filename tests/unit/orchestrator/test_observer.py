"""The step's observers (orchestrator/observer.py): every hook reaches every observer, in order."""

import asyncio

from prime_rl.orchestrator.observer import Observers, StepObserver


class Recorder(StepObserver):
    def __init__(self, name: str, on_policy: bool, calls: list):
        self.name, self.on_policy, self.calls = name, on_policy, calls

    async def before_policy(self, client, step):
        self.calls.append((self.name, "before_policy", step))
        return self.on_policy

    async def after_batch(self, client, batch):
        self.calls.append((self.name, "after_batch", batch))

    async def metrics(self, client, step, batch):
        return {f"{self.name}/step": step}


def test_every_observer_sees_every_hook_in_order_and_the_defaults_do_nothing():
    calls = []
    observers = Observers(Recorder("a", True, calls), StepObserver(), Recorder("b", False, calls))

    async def step():
        on_policy = await observers.before_policy(None, 3)  # "a" says on-policy: "b" is still asked
        await observers.before_generate(None, 3)
        await observers.after_batch(None, "batch")
        return on_policy, await observers.metrics(None, 3, "batch")

    on_policy, metrics = asyncio.run(step())
    assert on_policy and metrics == {"a/step": 3, "b/step": 3}
    assert calls == [("a", "before_policy", 3), ("b", "before_policy", 3), ("a", "after_batch", "batch"),
                     ("b", "after_batch", "batch")]  # fmt: skip
    assert not asyncio.run(Observers(StepObserver()).before_policy(None, 0))
