"""How old a trained rollout's policy may be (docs/design.md §3): the one staleness rule. policy.py reads it for
the weights the servers must hold and the client's floor, stream.py for continuous mode's deadlines.

Step n's requests start once every live server holds weight step >= n - async_level (`required`). A rollout
trained at step n may come from weight step >= n - lag (`oldest`); so one sampled from weight step w is trained
by step w + lag at the latest (`deadline`). The lag is
- barrier mode: async_level (all of step n's requests start once its weights are in place);
- continuous mode (`max_inflight` set): max_off_policy_steps, unset = async_level + 1 (groups keep generating
  across updates: one step of overlap past the barrier's lag). The config refuses one below async_level: it
  would drop rollouts of the very policy the step may use.

E.g. async_level = 1, max_off_policy_steps = 3: step 5 starts once the servers hold weights >= 4, and takes
rollouts of weight step >= 4 in barrier mode, >= 2 in continuous mode, where a group sampled from weights 4 is
trained by step 7 at the latest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prime_rl.configs.orchestrator import OrchestratorConfig


@dataclass(frozen=True)
class Staleness:
    async_level: int
    max_off_policy_steps: int | None = None
    continuous: bool = False

    @classmethod
    def of(cls, config: OrchestratorConfig) -> Staleness:
        return cls(config.async_level, config.max_off_policy_steps, config.max_inflight is not None)

    @property
    def lag(self) -> int:
        """The most steps a trained token's policy may lag its step: what token_lag_max may reach."""
        if not self.continuous:
            return self.async_level
        return self.async_level + 1 if self.max_off_policy_steps is None else self.max_off_policy_steps

    def required(self, step: int) -> int:
        """The oldest weight step every live server must hold before step `step`'s requests start."""
        return max(0, step - self.async_level)

    def oldest(self, step: int) -> int:
        """The oldest weight step a rollout trained at step `step` may come from (older ones are redone by the
        client, `set_floor`, or dropped as stale by the stream)."""
        return max(0, step - self.lag)

    def deadline(self, weight_step: int) -> int:
        """The last step that may train a rollout sampled from `weight_step`."""
        return weight_step + self.lag
