"""Generated packed micro batches for `--data.fake` runs and benchmarks (no orchestrator needed).

Samples get lengths drawn uniformly from [min_len, max_len] and random token ids, and are packed
first-fit-decreasing into rows of at most `seq_len` tokens by the orchestrator's own packer (`protocol.packing`).
Everything is a function of the seed, so every rank and every repetition sees the same data.
"""

from __future__ import annotations

import torch

from prime_rl.protocol.packing import first_fit_decreasing, pack_rows, pad_rows
from prime_rl.protocol.records import PackedRow, Sample


def random_samples(num: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=g).tolist()
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]


def pack_samples(samples: list[list[int]], seq_len: int, seed: int) -> list[PackedRow]:
    """First-fit-decreasing into rows of ≤ seq_len; loss on all but the first quarter (the "prompt") of each."""
    g = torch.Generator().manual_seed(seed)
    # Advantages are drawn in packed order (row by row; `pack_rows` packs the same rows again), so a seed
    # gives the same data as before the packer moved to protocol.
    advantages = [0.0] * len(samples)
    for row in first_fit_decreasing([len(s) for s in samples], seq_len):
        for i in row:
            advantages[i] = float(torch.randn(1, generator=g))
    packed = []
    for ids, advantage in zip(samples, advantages, strict=True):
        n, prompt = len(ids), max(1, len(ids) // 4)
        packed.append(Sample(ids, [False] * prompt + [True] * (n - prompt), [advantage] * n, [-7.0] * n))
    return pack_rows(packed, seq_len, temperature=1.0)


def fake_micro_batches(
    step: int, rank: int, num: int, seq_len: int, min_len: int, max_len: int, vocab_size: int, seed: int
) -> list[PackedRow]:
    """`num` packed rows for (`step`, `rank`), as a rank file holds them: samples drawn until `num` rows are full."""
    base = seed * 1_000_003 + step * 1009 + rank
    mean = (min_len + max_len) // 2
    # Draw 1.5x what fills the rows, so the first `num` first-fit-decreasing rows are (nearly) full.
    samples = random_samples(max(1, 3 * num * seq_len // (2 * mean)), min_len, min(max_len, seq_len), vocab_size, base)
    # Rarely (more short samples than expected) fewer rows: padded with all-masked rows of seq_len tokens.
    return pad_rows(pack_samples(samples, seq_len, base), num, 1.0, length=seq_len)[:num]
