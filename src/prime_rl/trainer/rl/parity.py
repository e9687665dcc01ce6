"""The trainer's half of the parity gate (docs/orchestrator.md): at the start of step n, when n is a gate step,
its weights are weight step n; it scores the orchestrator's canaries with them and writes
`parity/step_n.json`, which the orchestrator compares with every server's scores of the same step.

Every rank runs the forwards (FSDP gathers are collective); rank 0 writes. The canaries are a few short
sequences: one packed forward each, no gradient.

The sampled tokens (`SampledMismatch`): canaries are scored through the servers' prefill path only, while
tokens are sampled through their decode path. At a gate step n the orchestrator samples on-policy (weight
step n, the trainer's weights now), so the k3 of every loss token whose policy step is n, taken from the loss
the step computes anyway, is the sampler's mismatch alone. Each rank writes, per sample and server, (tokens,
Σ k3, max |Δ logprob|) to `parity/sampled_step_n_rank_r.json`; no collective, no extra forward.
"""

from __future__ import annotations

import logging

import torch

from prime_rl.configs.trainer import TrainerConfig
from prime_rl.protocol.parity import canary_file, is_gate_step, read_canaries, write_sampled, write_trainer_scores
from prime_rl.protocol.records import Sample
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.logprobs import forward_logprobs
from prime_rl.trainer.micro_batch import MicroBatch

logger = logging.getLogger("prime_rl")


def canary_batch(token_ids: list[int]) -> MicroBatch:
    """One canary as a packed row of one sample, scored at temperature 1 (as the servers' prompt logprobs)."""
    return MicroBatch.pack([Sample(token_ids, [True] * len(token_ids))], temperature=1.0)


def score_canaries(config: TrainerConfig, model: torch.nn.Module, device: torch.device, step: int, main: bool) -> None:
    """At a gate step, write the trainer's logprobs of every canary token (0.0 at index 0) for weight step `step`."""
    if config.bench or not is_gate_step(step, config.parity.interval):
        return
    canaries = read_canaries(config.output_dir)
    if canaries is None:  # an orchestrator without the gate (or an older one): nothing to compare with
        logger.debug(f"parity: no canaries in {config.output_dir / 'parity'} at step {step}")
        return
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logprobs = [
                forward_logprobs(model, canary_batch(c["token_ids"]), device).logprobs[0].float().cpu().tolist()
                for c in canaries
            ]
    except TrainerError as e:
        raise TrainerError(f"{canary_file(config.output_dir)}: {e}") from None
    finally:
        model.train(was_training)
    if main:
        write_trainer_scores(config.output_dir, step, logprobs)


class SampledMismatch:
    """Collects, during a gate step, each (sample, server)'s on-policy loss tokens: their count, Σ k3 and
    max |Δ logprob| (`add`, from the loss callback); `write` puts this rank's entries in its parity file."""

    def __init__(self, config: TrainerConfig, rank: int):
        self.config, self.rank = config, rank
        self.entries: list[list[float]] = []  # [server, tokens, Σ k3, max |Δ|]

    def active(self, step: int | None) -> bool:
        return step is not None and not self.config.bench and is_gate_step(step, self.config.parity.interval)

    def add(self, mb: MicroBatch, log_ratio: torch.Tensor, mask: torch.Tensor, samples: torch.Tensor,
            step: int) -> None:  # fmt: skip
        """`log_ratio` [1, L]: log π − log μ of the loss; `samples` the packed sample of each position."""
        if not mb.token_server.numel() or not mb.policy_steps.numel():
            return  # an orchestrator that sends no servers: nothing to attribute
        device = mask.device
        server = mb.token_server.to(device)
        on_policy = mask & (mb.policy_steps.to(device) == step) & (server >= 0)
        if not bool(on_policy.any()):
            return
        servers = int(server.max()) + 1
        keys = (samples[on_policy] * servers + server[on_policy]).long()
        unique, inverse = torch.unique(keys, return_inverse=True)
        zeros = torch.zeros(len(unique), dtype=torch.float64, device=device)
        tokens = zeros.index_add(0, inverse, torch.ones_like(inverse, dtype=torch.float64))
        d = log_ratio[on_policy].double()
        total = zeros.index_add(0, inverse, torch.expm1(d) - d)  # k3 in float64: fp32's rounds honest noise to 0
        worst = zeros.scatter_reduce(0, inverse, d.abs(), "amax", include_self=False)
        for key, n, kl, d in zip(unique.tolist(), tokens.tolist(), total.tolist(), worst.tolist(), strict=True):
            self.entries.append([key % servers, int(n), kl, d])

    def write(self, step: int) -> None:
        if self.active(step):
            write_sampled(self.config.output_dir, step, self.rank, self.entries)
        self.entries = []
