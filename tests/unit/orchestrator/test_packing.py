import itertools

import numpy as np
import pytest

from prime_rl.orchestrator.packing import pack_micro_batches, rollout_sample, split_over_ranks
from prime_rl.protocol.packing import (
    PADDING_LENGTH,
    SampleTooLong,
    first_fit_decreasing,
    packed_rows,
    shareable_prompt,
)
from prime_rl.protocol.records import Sample
from tests.samples import scored_rollout


def sample(uid: int, n_prompt: int, n_completion: int, advantage: float = 0.5) -> Sample:
    """Token ids encode (sample, position) so we can trace every token after packing."""
    ids = [uid * 1000 + i for i in range(n_prompt + n_completion)]
    logprobs = [-(uid + i / 100) for i in range(n_completion)]
    return rollout_sample(scored_rollout(ids[:n_prompt], ids[n_prompt:], logprobs, advantage))


def test_rollout_sample_masks_prompt_and_puts_advantage_and_logprobs_on_completion():
    s = rollout_sample(scored_rollout([1, 2, 3], [4, 5], [-0.1, -0.2], advantage=0.75))
    assert s.input_ids == [1, 2, 3, 4, 5]
    assert s.loss_mask == [False, False, False, True, True]
    assert s.advantages == [0.0, 0.0, 0.0, 0.75, 0.75]
    assert s.inference_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2]


def test_ffd_matches_docstring_example():
    lengths = [5, 2, 7, 3, 4]
    bins = first_fit_decreasing(lengths, 10)
    assert [[lengths[i] for i in b] for b in bins] == [[7, 3], [5, 4], [2]]
    assert bins == [[2, 3], [0, 4], [1]]


def test_ffd_fills_rows_exactly_to_capacity():
    bins = first_fit_decreasing([4, 6, 10, 5, 5], 10)
    assert sorted(sorted(b) for b in bins) == [[0, 1], [2], [3, 4]]


def test_ffd_puts_a_sample_with_the_row_of_its_prompt_where_that_row_has_room():
    """Lengths [6, 5, 4, 4] into 10: plain FFD pairs 6+4 and 5+4; with the 4s of the prompts of 5 and 6 (b, a),
    each goes to its own prompt's row."""
    assert first_fit_decreasing([6, 5, 4, 4], 10) == [[0, 2], [1, 3]]
    assert first_fit_decreasing([6, 5, 4, 4], 10, ["a", "b", "b", "a"]) == [[0, 3], [1, 2]]
    assert first_fit_decreasing([6, 5, 4, 4], 10, ["a", "b", None, None]) == [[0, 2], [1, 3]]
    assert shareable_prompt([5, 6, 7, 10], [False, False, False, True]) == (5, 6)
    assert shareable_prompt([5, 6], [True, True]) == ()  # the loss from the 2nd token: its prompt is 5 alone


def test_with_share_prompts_a_row_counts_its_shared_prompt_once():
    """Two prompts of 20 tokens, 4 completions of 5 each (25 tokens a sample), rows of 64: two samples a row as
    packed, a whole group a row when the 19 prompt tokens the trainer computes once count once (25 + 3 x 6)."""
    samples = []
    for uid in range(2):
        prompt = [uid * 1000 + i for i in range(20)]
        samples += [rollout_sample(scored_rollout(prompt, [7 + j] * 5, [-0.5] * 5, 0.5)) for j in range(4)]
    bins, sizes = packed_rows(samples, 64)
    assert [len(b) for b in bins] == [2, 2, 2, 2] and sizes == [50] * 4
    bins, sizes = packed_rows(samples, 64, share_prompts=True)
    assert bins == [[0, 1, 2, 3], [4, 5, 6, 7]] and sizes == [43, 43]
    per_rank = pack_micro_batches(samples, 64, num_ranks=2, temperature=1.0, share_prompts=True)
    assert [[mb.num_tokens for mb in mbs] for mbs in per_rank] == [[100], [100]]
    # A sample longer than seq_len is still refused, whatever it would share.
    with pytest.raises(SampleTooLong):
        packed_rows(samples, 24, share_prompts=True)


def test_sample_longer_than_seq_len_raises_naming_lengths():
    with pytest.raises(SampleTooLong, match="sample 1 has 11 tokens but seq_len is 10"):
        first_fit_decreasing([3, 11], 10)
    with pytest.raises(SampleTooLong):
        pack_micro_batches([sample(0, 4, 8)], seq_len=11, num_ranks=1, temperature=1.0)


def test_every_token_lands_exactly_once_with_correct_boundaries():
    shapes = [(3, 4), (5, 9), (2, 2), (6, 1), (4, 7), (1, 3), (8, 5)]
    samples = [sample(uid, p, c, advantage=uid / 10) for uid, (p, c) in enumerate(shapes)]
    per_rank = pack_micro_batches(samples, seq_len=16, num_ranks=1, temperature=0.7)
    seen = {}
    for mb in per_rank[0]:
        mb.validate()
        assert mb.num_tokens <= 16
        assert mb.temperature == 0.7
        cu = mb.cu_seqlens.tolist()
        for a, b in itertools.pairwise(cu):
            ids = mb.input_ids[0, a:b].tolist()
            uid = ids[0] // 1000
            assert uid not in seen, "sample packed twice"
            seen[uid] = (a, b)
            assert ids == samples[uid].input_ids
            assert mb.position_ids[0, a:b].tolist() == list(range(b - a))
            assert mb.loss_mask[0, a:b].tolist() == samples[uid].loss_mask
            assert mb.advantages[0, a:b].tolist() == pytest.approx(samples[uid].advantages)
            assert mb.inference_logprobs[0, a:b].tolist() == pytest.approx(samples[uid].inference_logprobs)
    assert sorted(seen) == list(range(len(shapes)))


def test_split_over_ranks_balances_counts_then_tokens():
    assert split_over_ranks([10, 9, 8, 2, 1], 2) == [[0, 3, 4], [1, 2]]
    assert split_over_ranks([5], 3) == [[0], [], []]


def test_ranks_get_equal_micro_batch_counts_padded_with_all_masked_rows():
    samples = [sample(uid, 4, 6) for uid in range(5)]  # 10 tokens each, one per 12-token row
    per_rank = pack_micro_batches(samples, seq_len=12, num_ranks=2, temperature=1.0)
    assert [len(mbs) for mbs in per_rank] == [3, 3]
    real = [mb for mbs in per_rank for mb in mbs if mb.loss_mask.any()]
    padding = [mb for mbs in per_rank for mb in mbs if not mb.loss_mask.any()]
    assert len(real) == 5 and len(padding) == 1
    pad = padding[0]
    pad.validate()
    assert pad.num_tokens == PADDING_LENGTH
    assert np.array_equal(pad.advantages, np.zeros((1, PADDING_LENGTH)))
    assert per_rank[1][-1] is pad  # the short rank is the padded one


def test_more_ranks_than_rows_gives_padding_only_ranks():
    per_rank = pack_micro_batches([sample(0, 2, 2), sample(1, 2, 2)], seq_len=64, num_ranks=3, temperature=1.0)
    assert [len(mbs) for mbs in per_rank] == [1, 1, 1]
    assert per_rank[0][0].cu_seqlens.tolist() == [0, 4, 8]
    assert not per_rank[1][0].loss_mask.any() and not per_rank[2][0].loss_mask.any()
