"""From scored rollouts to the micro batches each trainer rank receives (docs/design.md §2, rank file).

The packing rules shared with the trainer (first-fit-decreasing rows, all-masked padding rows) are in
`protocol/packing.py`; this module owns what is the orchestrator's own:

1. `rollout_sample`: one rollout becomes one `Sample` (protocol/records.py): prompt + completion tokens, the loss
   mask (sampled completion tokens only), the rollout's advantage on those tokens, the sampler's logprobs (μ)
   there and the policy step that sampled each token (-1 on the prompt and env replies).
2. `packed_rows` (protocol): samples are packed first-fit-decreasing into rows of at most `seq_len` tokens
   (`share_prompts`: the tokens a trainer sharing prompts computes); a sample longer than that is
   `SampleTooLong`, never truncated.
3. `split_over_ranks`: rows are dealt out longest first, each to the rank with the fewest rows (ties:
   fewest tokens, as `seq_len` counts them), so every rank gets ceil(rows / ranks) or one fewer, with tokens
   balanced. Row sizes
   [10, 9, 8, 2, 1] over 2 ranks → [[0, 3, 4], [1, 2]] (rank 0: 10 + 2 + 1 tokens, rank 1: 9 + 8).
4. `pad_rows` (protocol): ranks with fewer rows get all-masked padding rows, so each rank runs the same
   number of forward/backward passes and FSDP collectives stay in lockstep.
"""

from __future__ import annotations

from prime_rl.orchestrator.rollout import Rollout
from prime_rl.protocol.packing import SampleTooLong, packed_rows, pad_rows
from prime_rl.protocol.records import PackedRow, Sample

# SampleTooLong is re-exported: the orchestrator catches what `pack_micro_batches` raises by this module.
__all__ = ["SampleTooLong", "pack_micro_batches", "rollout_sample", "split_over_ranks"]


def rollout_sample(rollout: Rollout, env: int = -1, trained: bool = True) -> Sample:
    """One rollout as a trainer sample (module docstring, 1): the loss on the completion tokens the model sampled
    (none when not `trained`: a truncated rollout under advantage.truncated = "mask"), with the rollout's
    advantage (one value, or one per completion token with a teacher), μ and kept sets there; per token the policy
    step and server that sampled it (-1 on the prompt and env replies); `env`: its env's index in the step's names."""
    r, n = rollout, len(rollout.prompt_ids)
    mask = r.completion_mask if trained else [False] * len(r.completion_mask)
    advantages = r.advantage if isinstance(r.advantage, list) else [r.advantage] * len(r.completion_ids)
    return Sample(
        input_ids=r.prompt_ids + r.completion_ids,
        loss_mask=[False] * n + [bool(m) for m in mask],
        advantages=[0.0] * n + [float(a) for a in advantages],
        inference_logprobs=[0.0] * n + [float(x) for x in r.logprobs],
        env=env,
        kept=None if r.kept is None else [[]] * n + r.kept,
        policy_steps=[-1] * n + [int(s) for s in r.token_steps],
        servers=[-1] * n + [int(s) for s in r.token_servers],
    ).masked()


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
    samples: list[Sample],
    seq_len: int,
    num_ranks: int,
    temperature: float,
    pad_id: int = 0,
    env_names: list[str] = (),
    share_prompts: bool = False,
) -> list[list[PackedRow]]:
    """The micro batches of each rank, all ranks with the same number of them (every row carries `env_names`,
    the labels the samples' `env` index, so each rank reports the same per-env metrics; `share_prompts`: a
    prompt that several samples of a row share counts once toward `seq_len`)."""
    bins, sizes = packed_rows(samples, seq_len, share_prompts)
    rows = [PackedRow.pack([samples[i] for i in b], temperature, env_names) for b in bins]
    per_rank = [[rows[i] for i in idx] for idx in split_over_ranks(sizes, num_ranks)]
    count = max(1, max(len(mbs) for mbs in per_rank))
    return [pad_rows(mbs, count, temperature, pad_id=pad_id, env_names=env_names) for mbs in per_rank]
