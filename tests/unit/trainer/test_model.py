"""Packed forward: a sample packed with others gets exactly the logprobs it gets alone."""

import pytest
import torch

from prime_rl.protocol.records import MicroBatch
from prime_rl.trainer.model import build_model, forward_logprobs, packed_attention_mask, sample_starts


def _sample(ids: list[int]) -> dict:
    n = len(ids)
    return {"input_ids": ids, "loss_mask": [True] * n, "advantages": [0.0] * n, "inference_logprobs": [0.0] * n}


def test_packed_attention_mask_is_causal_within_samples_and_blocks_across():
    mask = packed_attention_mask(torch.tensor([0, 2, 3, 5], dtype=torch.int32), 5, torch.device("cpu"))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 0, 1, 0],
            [0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert mask.shape == (1, 1, 5, 5)
    assert torch.equal(mask[0, 0], expected)


def test_sample_starts_marks_first_token_of_each_packed_sample():
    mb = MicroBatch.pack([_sample([1, 2, 3]), _sample([4]), _sample([5, 6])], temperature=1.0)
    assert sample_starts(mb).tolist() == [[True, False, False, True, True, False]]


@pytest.mark.parametrize("arch", ["tiny_model", "tiny_llama"])
def test_logprobs_of_a_packed_sample_equal_those_of_the_sample_alone(arch, request):
    model = build_model(str(request.getfixturevalue(arch)))
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randint(3, 1000, (n,), generator=g).tolist() for n in (9, 13, 6))
    alone = MicroBatch.pack([_sample(a)], temperature=0.8)
    packed = MicroBatch.pack([_sample(b), _sample(a), _sample(c)], temperature=0.8)

    with torch.no_grad():
        ref = forward_logprobs(model, alone, torch.device("cpu"))
        out = forward_logprobs(model, packed, torch.device("cpu"))
    start, end = len(b), len(b) + len(a)
    # Position 0 of a sample has no prefix; from position 1 on, every logprob and entropy must match.
    torch.testing.assert_close(out.logprobs[0, start + 1 : end], ref.logprobs[0, 1:], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy[0, start + 1 : end], ref.entropy[0, 1:], atol=1e-5, rtol=0)
    # And the samples around it are unaffected by it: c alone gives c's packed logprobs.
    ref_c = forward_logprobs(model, MicroBatch.pack([_sample(c)], 0.8), torch.device("cpu"))
    torch.testing.assert_close(out.logprobs[0, end + 1 :], ref_c.logprobs[0, 1:].detach(), atol=1e-5, rtol=0)


def test_activation_checkpointing_leaves_gradients_unchanged(tiny_model):
    mb = MicroBatch.pack([_sample(list(range(5, 17))), _sample(list(range(40, 47)))], temperature=1.0)
    grads = []
    for ac in (False, True):
        model = build_model(str(tiny_model), activation_checkpointing=ac)
        forward_logprobs(model, mb, torch.device("cpu")).logprobs.sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5)


def test_logprobs_at_loss_positions_only_match_the_full_forward_in_value_and_gradient(tiny_model):
    model = build_model(str(tiny_model))
    g = torch.Generator().manual_seed(2)
    a, b = (torch.randint(3, 1000, (n,), generator=g).tolist() for n in (11, 7))
    mb = MicroBatch.pack([_sample(a), _sample(b)], temperature=0.7)
    where = torch.zeros_like(mb.loss_mask)
    where[0, [0, 3, 4, 10, 11, 12, 17]] = True  # 0 and 11 start a sample: they have no prediction
    want = where & ~sample_starts(mb)

    results = []
    for kwargs in ({}, {"where": where}):
        model.zero_grad()
        out = forward_logprobs(model, mb, torch.device("cpu"), entropy_grad=True, **kwargs)
        (torch.where(want, out.logprobs + out.entropy, 0.0).sum()).backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (full, full_grads), (kept, kept_grads) = results
    torch.testing.assert_close(kept.logprobs[want], full.logprobs[want], atol=1e-5, rtol=0)
    torch.testing.assert_close(kept.entropy[want], full.entropy[want], atol=1e-5, rtol=0)
    assert not kept.logprobs[~want].any() and not kept.entropy[~want].any()
    for name, grad in full_grads.items():
        torch.testing.assert_close(kept_grads[name], grad, atol=1e-6, rtol=1e-4)
