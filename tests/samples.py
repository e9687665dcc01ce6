"""The training samples tests build (`from tests.samples import ...`): every test sample comes from `sample`,
`on_policy_sample` or, through the orchestrator's own `rollout_sample`, `scored_rollout`, so a change to the record
(`Sample`, protocol/records.py) is made here once."""

from __future__ import annotations

from pathlib import Path

import torch

from prime_rl.orchestrator.rollout import Rollout
from prime_rl.protocol import rank_file
from prime_rl.protocol.records import Sample, read_rank_file
from prime_rl.trainer.logprobs import forward_logprobs
from prime_rl.trainer.micro_batch import MicroBatch


def sample(
    ids: list[int],
    prompt: int = 0,
    advantage: float | list[float] = 0.0,
    logprobs: list[float] | None = None,
    loss_mask: list | None = None,
    **extras,
) -> Sample:
    """`ids` with the loss on all but the first `prompt` tokens (or where `loss_mask` is true), `advantage` on every
    token (or one per token), μ = `logprobs` (None: 0.0 on every token); `extras` (env, kept, policy_steps,
    servers) as `Sample` takes them."""
    n = len(ids)
    mask = [False] * prompt + [True] * (n - prompt) if loss_mask is None else [bool(m) for m in loss_mask]
    advantages = list(advantage) if isinstance(advantage, list) else [float(advantage)] * n
    return Sample(list(ids), mask, advantages, [0.0] * n if logprobs is None else list(logprobs), **extras)


def trainer_logprobs(
    model: Path | torch.nn.Module,
    prompt: list[int],
    completion: list[int],
    temperature: float,
    kept: list[list[int]] | None = None,
) -> list[float]:
    """The trainer's logprobs of `completion` after `prompt`: its model (a dir, or one it built), its packed
    forward at `temperature`; with `kept` (per completion token its kept set) renormalised over those sets."""
    from prime_rl.trainer.model import build_model

    n = len(prompt) + len(completion)
    kept = None if kept is None else [[]] * len(prompt) + [list(k) for k in kept]
    mb = MicroBatch.pack([sample(prompt + completion, len(prompt), kept=kept)], temperature)
    if isinstance(model, Path):
        model = build_model(str(model))
    with torch.no_grad():
        out = forward_logprobs(model, mb, torch.device("cpu"), where=mb.loss_mask)
    return out.logprobs[0, len(prompt) : n].tolist()


def on_policy_sample(
    model: torch.nn.Module, ids: list[int], prompt: int, advantage: float = 0.0, shift: float = 0.0, **extras
) -> Sample:
    """`sample(ids, prompt, advantage)` whose μ is the model's own logprob of each token minus `shift`: every ratio
    π/μ is 1, or log r = `shift` on every loss token."""
    alone = MicroBatch.pack([sample(ids, loss_mask=[False] * len(ids))], 1.0)
    with torch.no_grad():
        mu = (forward_logprobs(model, alone, torch.device("cpu")).logprobs[0] - shift).tolist()
    return sample(ids, prompt, advantage, mu, **extras)


def scored_rollout(
    prompt_ids: list[int],
    completion_ids: list[int],
    logprobs: list[float] | None = None,
    advantage: float | list[float] = 0.0,
    mask: list | None = None,
    **fields,
) -> Rollout:
    """A scored rollout sampled by weight step 0: `mask` marks the model's completion tokens (None: all), the
    others are env replies; `fields` as `Rollout` takes them (kept, token_steps, ...)."""
    n = len(completion_ids)
    mask = [True] * n if mask is None else [bool(m) for m in mask]
    logprobs = [0.0] * n if logprobs is None else list(logprobs)
    return Rollout(None, list(prompt_ids), list(completion_ids), mask, logprobs, "", "stop", 0, advantage=advantage,
                   **fields)  # fmt: skip


def rank_file_batches(output_dir: Path, step: int, rank: int = 0) -> list[MicroBatch]:
    """The micro batches of a rank file as the trainer takes them (tensors)."""
    return [MicroBatch.from_row(row) for row in read_rank_file(rank_file(output_dir, step, rank), step, rank)]
