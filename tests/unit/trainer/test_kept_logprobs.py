"""Logprobs and entropy renormalised over the sampler's kept sets (top-p / top-k replay): values and gradients
against a plain masked log-softmax, a float64 gradcheck, the CSR of a packed micro batch, and bad sets."""

from __future__ import annotations

import math

import pytest
import torch

from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.logprobs import kept_at, target_logprobs_and_entropy, token_logprobs_and_entropy
from prime_rl.trainer.micro_batch import MicroBatch
from tests.samples import sample


def csr(sets: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.tensor([0] + [len(s) for s in sets]).cumsum(0)
    return offsets, torch.tensor([i for s in sets for i in s], dtype=torch.long)


def reference(logits, targets, temperature, sets):
    """log_softmax over the logits masked to each row's set ([] = all), and −Σ p log p over the same."""
    keep = torch.ones(logits.shape, dtype=torch.bool)
    for row, ids in enumerate(sets):
        if ids:
            keep[0, row] = False
            keep[0, row, ids] = True
    logp = torch.log_softmax((logits / temperature).masked_fill(~keep, float("-inf")), -1)
    entropy = -(logp.exp() * logp.masked_fill(~keep, 0.0)).sum(-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1), entropy


def test_the_worked_example_renormalises_over_the_kept_set():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]])
    logprobs, entropy = target_logprobs_and_entropy(logits, torch.tensor([[0]]), 1.0, kept=csr([[0, 1]]))
    assert logprobs.item() == pytest.approx(math.log(0.644 / 0.881), abs=2e-3)  # −0.313
    assert entropy.item() == pytest.approx(-(0.731 * math.log(0.731) + 0.269 * math.log(0.269)), abs=2e-3)


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("chunk_rows", [None, 2, 3])
def test_chunked_kept_logprobs_match_a_masked_log_softmax_in_value_and_gradient(chunk_rows, entropy_grad):
    """7 rows over a vocab of 50, four with kept sets (one a single token), chunks of 2 or 3 (ragged)."""
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(1, 7, 50, generator=g)).requires_grad_(True)
    targets = torch.randint(0, 50, (1, 7), generator=g)
    sets = [[], sorted({int(targets[0, 1]), 3, 17, 40}), [int(targets[0, 2])], [], sorted({int(targets[0, 4]), 0}),
            [], sorted({int(targets[0, 6]), *range(20, 30)})]  # fmt: skip
    w_lp, w_ent = torch.randn(1, 7, generator=g), torch.randn(1, 7, generator=g)
    logprobs, entropy = target_logprobs_and_entropy(logits, targets, 0.7, entropy_grad, chunk_rows, kept=csr(sets))
    (logprobs * w_lp + entropy * w_ent).sum().backward()
    ref = logits.detach().clone().requires_grad_(True)
    ref_lp, ref_entropy = reference(ref, targets, 0.7, sets)
    (ref_lp * w_lp + (ref_entropy * w_ent if entropy_grad else 0)).sum().backward()
    torch.testing.assert_close(logprobs, ref_lp)
    torch.testing.assert_close(entropy, ref_entropy.detach())
    torch.testing.assert_close(logits.grad, ref.grad)
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 2].abs().max() == 0  # a single-token set: p = 1
    outside = torch.ones(50, dtype=torch.bool)
    outside[sets[1]] = False
    assert logits.grad[0, 1, outside].abs().max() == 0


def test_gradients_are_exact_in_float64():
    logits = torch.randn(1, 4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    targets = torch.tensor([[1, 4, 0, 5]])
    kept = csr([[1, 2], [], [0, 3, 5], [5]])

    def f(x):
        return target_logprobs_and_entropy(x, targets, 0.8, entropy_grad=True, chunk_rows=3, kept=kept)

    assert torch.autograd.gradcheck(f, (logits,), eps=1e-6, atol=1e-8)


def test_a_packed_micro_batch_scores_its_kept_positions_and_leaves_the_others():
    samples = [sample([5, 1, 2], 1, kept=[[], [1, 3], []]), sample([4, 0], 1, kept=[[], [0, 2, 7]])]
    mb = MicroBatch.pack(samples, 1.0)
    offsets, ids = kept_at(mb, torch.tensor([1, 2, 3, 4]))
    assert offsets.tolist() == [0, 2, 2, 2, 5] and ids.tolist() == [1, 3, 0, 2, 7]
    logits = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(3))
    plain, _ = token_logprobs_and_entropy(logits, mb.input_ids, 1.0)
    kept, _ = token_logprobs_and_entropy(logits, mb.input_ids, 1.0, kept=kept_at(mb, torch.arange(1, 5)))
    assert torch.equal(kept[0, [0, 2, 3]], plain[0, [0, 2, 3]])  # no set (3 crosses samples: never read)
    sets = [[], [1, 3], [], [], [0, 2, 7]]
    want, _ = reference(logits[:, :-1], mb.input_ids[:, 1:], 1.0, sets[1:])
    torch.testing.assert_close(kept[0, [1, 4]], want[0, [0, 3]])


def test_sets_that_do_not_fit_the_model_are_refused():
    logits, targets = torch.zeros(1, 2, 8), torch.tensor([[1, 2]])
    with pytest.raises(TrainerError, match=r"outside the model's vocabulary \[0, 8\): \[9\]"):
        target_logprobs_and_entropy(logits, targets, 1.0, kept=csr([[1, 9], []]))
    with pytest.raises(TrainerError, match="outside their own kept set"):
        target_logprobs_and_entropy(logits, targets, 1.0, kept=csr([[1], [3, 4]]))
