"""Packing samples into the rows of a rank file (docs/design.md §2): the one packer of the orchestrator (rollouts),
SFT (data rows) and the trainer's fake data.

A sample is a `protocol.records.Sample` (token ids, loss mask, advantages, μ, ... one entry per token), laid end
to end by `PackedRow.pack`.

1. `first_fit_decreasing`: samples go into rows of at most `seq_len` tokens. Longest first, each sample goes
   into the first row with room, else opens a new row. Lengths [5, 2, 7, 3, 4], seq_len 10:

       sorted 7 5 4 3 2  →  row0 [7, 3]   (7, then 5 no fit, 4 no fit, 3 fits → 10)
                            row1 [5, 4]   (5, then 4 fits → 9; 2 no longer fits in row0 or row1)
                            row2 [2]

   As indices: [[2, 3], [0, 4], [1]]. A sample longer than `seq_len` is an error (`SampleTooLong`), never
   truncated: a cut completion would train on a sequence the policy never produced. Among the rows with room,
   one already holding a sample of the same prompt (`shareable_prompt`) comes first: the trainer computes once
   the leading tokens that several samples of a row hold alike (trainer/prefix.py), an RL group's prompt or a
   system prompt every sample opens with. With `share_prompts` (a trainer that does so) `seq_len` counts the
   tokens the trainer computes: a sample costs only its tokens past the longest start of its prompt that the
   row already holds. Two samples of 9 tokens whose first 6 are one prompt, seq_len 12: rows [9], [9] without,
   [9, 9] (9 + 3) with.
2. `pack_rows`: each of those rows becomes one `PackedRow` (positions restarting at 0 per sample).
3. `pad_rows`: a rank with fewer rows than the others gets all-masked padding rows up to `count`, so every
   rank runs the same number of forward/backward passes and FSDP collectives stay in lockstep. Rows [r0, r1]
   padded to 3 → [r0, r1, pad]; to 2 or fewer → unchanged.
"""

from __future__ import annotations

from prime_rl.protocol.records import PackedRow, Sample

# Padding rows are all masked, so their content never matters. A few tokens keep their compute negligible
# while sparing the trainer zero-size tensors after its next-token shift.
PADDING_LENGTH = 8


class SampleTooLong(ValueError):
    """A sample does not fit in one micro batch row."""


def shareable_prompt(ids: list[int], wanted: list[bool]) -> tuple[int, ...]:
    """The leading tokens of a sample that the trainer may compute once for the samples of a row that start with
    the same ones (trainer/prefix.py): those before the token whose logits predict its first `wanted` position
    (the first loss token past its start); () where it has none. [5, 6, 7, 10] with the loss on 10 → (5, 6)."""
    first = next((t for t, w in enumerate(wanted) if w and t > 0), 0)
    return tuple(ids[: first - 1]) if first > 1 else ()


def first_fit_decreasing(
    lengths: list[int], capacity: int, groups: list | None = None, prompts: list | None = None
) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of total length <= capacity (see the module docstring). With
    `groups` (a key per item, None: none) an item goes to the first bin with room that holds its group, else to
    the first with room: samples of one prompt share rows, where the trainer computes the prompt once. With
    `prompts` (per item, the tokens the trainer may share: `shareable_prompt`) an item costs only its tokens past
    the longest start of its prompt that the bin's items already hold."""
    return _fit(lengths, capacity, groups, prompts)[0]


def _fit(lengths: list[int], capacity: int, groups: list | None, prompts: list | None) -> tuple[list, list]:
    """`first_fit_decreasing`'s bins and the length each bin holds (its cost, with `prompts`)."""
    for i, n in enumerate(lengths):
        if n > capacity:
            raise SampleTooLong(
                f"sample {i} has {n} tokens but seq_len is {capacity}; one that does not fit seq_len {capacity} "
                f"is never truncated: raise seq_len or lower sampling.max_tokens / the prompt length"
            )
    bins: list[list[int]] = []
    room: list[int] = []
    held: list[set] = []  # the groups each bin holds
    tries: list[dict] = []  # the prompts each bin holds, as a prefix tree (token -> subtree)
    # Stable sort: equal lengths keep their original order, so packing is deterministic.
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        group = None if groups is None else groups[i]
        mates = {b for b in range(len(bins)) if group is not None and group in held[b]}
        # A bin holding the item's group holds its whole prompt; elsewhere the item may cost less than counted
        # here (a shared system prompt), which is what it is charged once placed.
        discount = 0 if prompts is None else len(prompts[i])
        fits = [b for b in range(len(bins)) if lengths[i] - (discount if b in mates else 0) <= room[b]]
        if fits:
            b = ([b for b in fits if b in mates] or fits)[0]
        else:
            b = len(bins)
            bins.append([])
            room.append(capacity)
            held.append(set())
            tries.append({})
        bins[b].append(i)
        room[b] -= lengths[i] - (0 if prompts is None else _held_start(tries[b], prompts[i]))
        if group is not None:
            held[b].add(group)
    return bins, [capacity - free for free in room]


def _held_start(trie: dict, prompt: tuple[int, ...]) -> int:
    """How many leading tokens of `prompt` `trie` already holds; adds the rest to it."""
    node, held = trie, 0
    for token in prompt:
        if token in node:
            held += 1
        else:
            node[token] = {}
        node = node[token]
    return held


def packed_rows(samples: list[Sample], seq_len: int, share_prompts: bool = False) -> tuple[list, list[int]]:
    """The indices of `samples` in each row (first-fit-decreasing into rows of `seq_len`; with `share_prompts`
    counting the leading tokens that a row's samples hold alike once) and the tokens each row counts toward
    `seq_len`."""
    prompts = [shareable_prompt(s.input_ids, s.loss_mask) for s in samples]
    groups = [p or None for p in prompts]
    return _fit([s.num_tokens for s in samples], seq_len, groups, prompts if share_prompts else None)


def pack_rows(
    samples: list[Sample], seq_len: int, temperature: float, env_names: list[str] = (), share_prompts: bool = False
) -> list[PackedRow]:
    """`samples` packed first-fit-decreasing into rows of at most `seq_len` tokens (`share_prompts`: counting a
    shared prompt once), one PackedRow each (`env_names`: the labels the samples' `env` indexes, carried by
    every row)."""
    bins, _ = packed_rows(samples, seq_len, share_prompts)
    return [PackedRow.pack([samples[i] for i in b], temperature, env_names) for b in bins]


def pad_rows(
    rows: list[PackedRow],
    count: int,
    temperature: float,
    length: int = PADDING_LENGTH,
    pad_id: int = 0,
    env_names: list[str] = (),
) -> list[PackedRow]:
    """`rows` followed by all-masked rows of `length` tokens up to `count` rows (none if it has that many)."""
    return rows + [PackedRow.padding(length, temperature, pad_id, env_names) for _ in range(count - len(rows))]
