"""The staleness rule (orchestrator/staleness.py): which weights step n needs, which rollouts it may train, and
by when a rollout must be trained, in barrier and continuous mode."""

import pytest
from pydantic import ValidationError

from prime_rl.configs.orchestrator import OrchestratorConfig
from prime_rl.orchestrator.staleness import Staleness


def test_the_docstrings_worked_example():
    """async_level = 1, max_off_policy_steps = 3: step 5 needs weights >= 4; it trains rollouts of weights >= 4
    in barrier mode, >= 2 in continuous mode, where weights 4 are trained by step 7 at the latest."""
    barrier = Staleness(async_level=1, max_off_policy_steps=3, continuous=False)
    continuous = Staleness(async_level=1, max_off_policy_steps=3, continuous=True)
    assert barrier.required(5) == continuous.required(5) == 4
    assert (barrier.lag, barrier.oldest(5), barrier.deadline(4)) == (1, 4, 5)  # max_off_policy_steps: unused
    assert (continuous.lag, continuous.oldest(5), continuous.deadline(4)) == (3, 2, 7)
    assert barrier.required(0) == continuous.oldest(2) == 0  # never below the base weights


def test_continuous_mode_lags_async_level_plus_1_unless_max_off_policy_steps_is_set():
    config = dict(batch_size=8, rollouts_per_example=2, async_level=2)
    assert Staleness.of(OrchestratorConfig(**config)) == Staleness(2, None, False)
    assert Staleness.of(OrchestratorConfig(**config, max_inflight=8)).lag == 3
    assert Staleness.of(OrchestratorConfig(**config, max_inflight=8, max_off_policy_steps=2)).lag == 2
    # A rollout of weight step w is trainable at step n iff oldest(n) <= w, i.e. n <= deadline(w).
    rule = Staleness(2, 4, True)
    assert all((rule.oldest(n) <= w) == (n <= rule.deadline(w)) for n in range(5, 12) for w in range(1, 12))


def test_a_bound_below_async_level_is_refused():
    with pytest.raises(ValidationError, match=r"max_off_policy_steps \(1\) < async_level \(2\)"):
        OrchestratorConfig(batch_size=8, rollouts_per_example=2, async_level=2, max_inflight=8, max_off_policy_steps=1)
