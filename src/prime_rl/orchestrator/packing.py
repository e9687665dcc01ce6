"""From scored rollouts to the micro batches each trainer rank receives (DESIGN §2, rank file).

1. `make_sample`: one rollout becomes one sample: prompt + completion tokens, the loss mask (sampled
   completion tokens only), the rollout's advantage on those tokens and the sampler's logprobs (μ) there.
2. `first_fit_decreasing`: samples are packed into rows of at most `seq_len` tokens. Longest first, each
   sample goes into the first row with room, else opens a new row. Lengths [5, 2, 7, 3, 4], seq_len 10:

       sorted 7 5 4 3 2  →  row0 [7, 3]   (7, then 5 no fit, 4 no fit, 3 fits → 10)
                            row1 [5, 4]   (5, then 4 fits → 9; 2 no longer fits in row0 or row1)
                            row2 [2]

   A sample longer than `seq_len` is an error (`SampleTooLong`), never truncated: a cut completion
   would train on a sequence the policy never produced.
3. `split_over_ranks`: rows are dealt out longest first, each to the rank with the fewest rows (ties:
   fewest tokens), so every rank gets ceil(rows / ranks) or one fewer, with tokens balanced.
4. Ranks with fewer rows get all-masked padding rows, so each rank runs the same number of
   forward/backward passes and FSDP collectives stay in lockstep.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prime_rl.protocol.records import MicroBatch

# Padding rows are all masked, so their content never matters. A few tokens keep their compute negligible
# while sparing the trainer zero-size tensors after its next-token shift.
PADDING_LENGTH = 8


class SampleTooLong(ValueError):
    """A rollout does not fit in one micro batch row."""


def make_sample(
    prompt_ids: list[int],
    completion_ids: list[int],
    logprobs: list[float],
    advantage: float,
    completion_mask: list[bool] | None = None,
) -> dict:
    """One rollout as the per-token lists that `MicroBatch.pack` lays end to end.

    `completion_mask` marks the completion tokens the model sampled (default: all of them); env replies
    of multi-turn rollouts are part of the completion but masked, and carry no advantage.
    """
    if len(logprobs) != len(completion_ids):
        raise ValueError(f"{len(logprobs)} logprobs for {len(completion_ids)} completion tokens")
    mask = [True] * len(completion_ids) if completion_mask is None else [bool(m) for m in completion_mask]
    if len(mask) != len(completion_ids):
        raise ValueError(f"{len(mask)} mask entries for {len(completion_ids)} completion tokens")
    n_prompt = len(prompt_ids)
    return {
        "input_ids": list(prompt_ids) + list(completion_ids),
        "loss_mask": [False] * n_prompt + mask,
        "advantages": [0.0] * n_prompt + [float(advantage) if m else 0.0 for m in mask],
        "inference_logprobs": [0.0] * n_prompt + [float(x) if m else 0.0 for x, m in zip(logprobs, mask, strict=True)],
    }


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of total length <= capacity (see the module docstring)."""
    for i, n in enumerate(lengths):
        if n > capacity:
            raise SampleTooLong(
                f"sample {i} has {n} tokens but seq_len is {capacity}; raise seq_len or lower "
                f"sampling.max_tokens / the prompt length (samples are never truncated)"
            )
    bins: list[list[int]] = []
    room: list[int] = []
    # Stable sort: equal lengths keep their original order, so packing is deterministic.
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


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
    samples: list[dict], seq_len: int, num_ranks: int, temperature: float, pad_id: int = 0
) -> list[list[MicroBatch]]:
    """The micro batches of each rank, all ranks with the same number of them."""
    from prime_rl.protocol.records import MicroBatch  # torch, imported only when packing

    bins = first_fit_decreasing([len(s["input_ids"]) for s in samples], seq_len)
    rows = [MicroBatch.pack([samples[i] for i in b], temperature) for b in bins]
    per_rank = [[rows[i] for i in idx] for idx in split_over_ranks([r.num_tokens for r in rows], num_ranks)]
    count = max(1, max(len(mbs) for mbs in per_rank))
    for mbs in per_rank:
        mbs.extend(MicroBatch.padding(PADDING_LENGTH, temperature, pad_id) for _ in range(count - len(mbs)))
    return per_rank
