"""The trainer's half of the parity gate (docs/orchestrator.md): at the start of step n, when n is a gate step,
its weights are weight step n; it scores the orchestrator's canaries with them and writes
`parity/step_n.json`, which the orchestrator compares with every server's scores of the same step.

Every rank runs the forwards (FSDP gathers are collective); rank 0 writes. The canaries are a few short
sequences: one packed forward each, no gradient.
"""

from __future__ import annotations

import logging

import torch

from prime_rl.configs.trainer import TrainerConfig
from prime_rl.protocol.parity import canary_file, is_gate_step, read_canaries, write_trainer_scores
from prime_rl.protocol.records import MicroBatch
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.logprobs import forward_logprobs

logger = logging.getLogger("prime_rl")


def canary_batch(token_ids: list[int]) -> MicroBatch:
    """One canary as a packed row of one sample, scored at temperature 1 (as the servers' prompt logprobs)."""
    n = len(token_ids)
    sample = {"input_ids": token_ids, "loss_mask": [True] * n, "advantages": [0.0] * n, "inference_logprobs": [0.0] * n}
    return MicroBatch.pack([sample], temperature=1.0)


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
