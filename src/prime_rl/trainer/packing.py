"""First-fit-decreasing packing of token sequences into rows of at most `seq_len` tokens (SFT, fake data).

Example: lengths [5, 3, 4, 2], seq_len 8 → sorted 5, 4, 3, 2 → rows [[5, 3], [4, 2]] (indices [[0, 1], [2, 3]]).
"""

from __future__ import annotations


def first_fit_decreasing(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Indices of the items in each row, fullest rows first; ValueError if an item exceeds `seq_len`."""
    rows: list[list[int]] = []
    space: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if lengths[i] > seq_len:
            raise ValueError(f"a sample of {lengths[i]} tokens does not fit seq_len {seq_len}")
        row = next((r for r, free in enumerate(space) if free >= lengths[i]), None)
        if row is None:
            rows.append([])
            space.append(seq_len)
            row = len(rows) - 1
        rows[row].append(i)
        space[row] -= lengths[i]
    return rows
