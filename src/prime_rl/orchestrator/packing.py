"""From scored rollouts to the micro batches each trainer rank receives (docs/design.md §2, rank file).

The packing rules shared with the trainer (first-fit-decreasing rows, all-masked padding rows) are in
`protocol/packing.py`; this module owns what is the orchestrator's own:

1. `make_sample`: one rollout becomes one sample: prompt + completion tokens, the loss mask (sampled
   completion tokens only), the rollout's advantage on those tokens, the sampler's logprobs (μ) there and
   the policy step that sampled each token (-1 on the prompt and env replies).
2. `pack_rows` (protocol): samples are packed first-fit-decreasing into rows of at most `seq_len` tokens;
   a sample longer than that is `SampleTooLong`, never truncated.
3. `split_over_ranks`: rows are dealt out longest first, each to the rank with the fewest rows (ties:
   fewest tokens), so every rank gets ceil(rows / ranks) or one fewer, with tokens balanced. Row sizes
   [10, 9, 8, 2, 1] over 2 ranks → [[0, 3, 4], [1, 2]] (rank 0: 10 + 2 + 1 tokens, rank 1: 9 + 8).
4. `pad_rows` (protocol): ranks with fewer rows get all-masked padding rows, so each rank runs the same
   number of forward/backward passes and FSDP collectives stay in lockstep.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prime_rl.protocol.packing import SampleTooLong, pack_rows, pad_rows

if TYPE_CHECKING:
    from prime_rl.protocol.records import MicroBatch

# SampleTooLong is re-exported: the orchestrator catches what `pack_micro_batches` raises by this module.
__all__ = ["SampleTooLong", "make_sample", "pack_micro_batches", "split_over_ranks"]


def make_sample(
    prompt_ids: list[int],
    completion_ids: list[int],
    logprobs: list[float],
    advantage: float | list[float],
    completion_mask: list[bool] | None = None,
    env: int = -1,
    kept: list[list[int]] | None = None,
    policy_steps: list[int] | None = None,
    servers: list[int] | None = None,
) -> dict:
    """One rollout as the per-token lists that `MicroBatch.pack` lays end to end.

    `completion_mask` marks the completion tokens the model sampled (default: all of them); env replies
    of multi-turn rollouts are part of the completion but masked, and carry no advantage. `advantage` is the
    rollout's, or one per completion token (distillation: [0.5, -1.2] for two tokens). `env` is the
    index of the rollout's environment in the step's env names; `kept` the token ids the sampler could draw
    at each completion token (top-p/top-k; [] = the whole vocabulary), None when it sampled without a filter;
    `policy_steps` the weight step that sampled each completion token (-1: none, e.g. env replies), None: unknown;
    `servers` likewise the server that sampled it (its index in client.base_url), for the parity gate.
    """
    if len(logprobs) != len(completion_ids):
        raise ValueError(f"{len(logprobs)} logprobs for {len(completion_ids)} completion tokens")
    mask = [True] * len(completion_ids) if completion_mask is None else [bool(m) for m in completion_mask]
    if len(mask) != len(completion_ids):
        raise ValueError(f"{len(mask)} mask entries for {len(completion_ids)} completion tokens")
    n_prompt = len(prompt_ids)
    per_token = advantage if isinstance(advantage, list) else [advantage] * len(completion_ids)
    if len(per_token) != len(completion_ids):
        raise ValueError(f"{len(per_token)} advantages for {len(completion_ids)} completion tokens")
    sample = {
        "input_ids": list(prompt_ids) + list(completion_ids),
        "loss_mask": [False] * n_prompt + mask,
        "advantages": [0.0] * n_prompt + [float(a) if m else 0.0 for a, m in zip(per_token, mask, strict=True)],
        "inference_logprobs": [0.0] * n_prompt + [float(x) if m else 0.0 for x, m in zip(logprobs, mask, strict=True)],
        "env": env,
    }
    if kept is not None:
        if len(kept) != len(completion_ids):
            raise ValueError(f"{len(kept)} kept sets for {len(completion_ids)} completion tokens")
        sample["kept"] = [[]] * n_prompt + [list(k) if m else [] for k, m in zip(kept, mask, strict=True)]
    if policy_steps is not None:
        if len(policy_steps) != len(completion_ids):
            raise ValueError(f"{len(policy_steps)} policy steps for {len(completion_ids)} completion tokens")
        sample["policy_steps"] = [-1] * n_prompt + [int(s) for s in policy_steps]
    if servers is not None:
        if len(servers) != len(completion_ids):
            raise ValueError(f"{len(servers)} servers for {len(completion_ids)} completion tokens")
        sample["servers"] = [-1] * n_prompt + [int(s) for s in servers]
    return sample


def split_over_ranks(sizes: list[int], num_ranks: int) -> list[list[int]]:
    """Indices of rows (with token counts `sizes`) for each rank: equal counts ±1, tokens balanced."""
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    tokens = [0] * num_ranks
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = min(range(num_ranks), key=lambda r: (len(ranks[r]), tokens[r]))
        ranks[r].append(i)
        tokens[r] += sizes[i]
    return ranks


def pack_micro_batches(
    samples: list[dict],
    seq_len: int,
    num_ranks: int,
    temperature: float,
    pad_id: int = 0,
    env_names: list[str] = (),
) -> list[list[MicroBatch]]:
    """The micro batches of each rank, all ranks with the same number of them (every row carries `env_names`,
    the labels the samples' `env` index, so each rank reports the same per-env metrics)."""
    rows = pack_rows(samples, seq_len, temperature, env_names)
    per_rank = [[rows[i] for i in idx] for idx in split_over_ranks([r.num_tokens for r in rows], num_ranks)]
    count = max(1, max(len(mbs) for mbs in per_rank))
    return [pad_rows(mbs, count, temperature, pad_id=pad_id, env_names=env_names) for mbs in per_rank]
