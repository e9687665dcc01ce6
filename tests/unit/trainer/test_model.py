"""Packed forward: a sample packed with others gets exactly the logprobs it gets alone."""

import pytest
import torch

from prime_rl.trainer.logprobs import forward_logprobs, sample_starts
from prime_rl.trainer.micro_batch import MicroBatch
from prime_rl.trainer.model import build_model
from prime_rl.trainer.parallel import apply_ac, apply_compile
from tests.samples import sample


def test_sample_starts_marks_first_token_of_each_packed_sample():
    mb = MicroBatch.pack([sample([1, 2, 3]), sample([4]), sample([5, 6])], temperature=1.0)
    assert sample_starts(mb).tolist() == [[True, False, False, True, True, False]]


@pytest.mark.parametrize("arch", ["tiny_model", "tiny_llama"])
def test_logprobs_of_a_packed_sample_equal_those_of_the_sample_alone(arch, request):
    model = build_model(str(request.getfixturevalue(arch)))
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randint(3, 1000, (n,), generator=g).tolist() for n in (9, 13, 6))
    alone = MicroBatch.pack([sample(a)], temperature=0.8)
    packed = MicroBatch.pack([sample(b), sample(a), sample(c)], temperature=0.8)

    with torch.no_grad():
        ref = forward_logprobs(model, alone, torch.device("cpu"))
        out = forward_logprobs(model, packed, torch.device("cpu"))
    start, end = len(b), len(b) + len(a)
    # Position 0 of a sample has no prefix; from position 1 on, every logprob and entropy must match.
    torch.testing.assert_close(out.logprobs[0, start + 1 : end], ref.logprobs[0, 1:], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.entropy[0, start + 1 : end], ref.entropy[0, 1:], atol=1e-5, rtol=0)
    # And the samples around it are unaffected by it: c alone gives c's packed logprobs.
    ref_c = forward_logprobs(model, MicroBatch.pack([sample(c)], 0.8), torch.device("cpu"))
    torch.testing.assert_close(out.logprobs[0, end + 1 :], ref_c.logprobs[0, 1:].detach(), atol=1e-5, rtol=0)


def test_activation_checkpointing_leaves_gradients_unchanged(tiny_model):
    mb = MicroBatch.pack([sample(list(range(5, 17))), sample(list(range(40, 47)))], temperature=1.0)
    grads = []
    for ac in (False, True):
        model = build_model(str(tiny_model))
        if ac:
            apply_ac(model)
        forward_logprobs(model, mb, torch.device("cpu")).logprobs.sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5)


def test_logprobs_at_loss_positions_only_match_the_full_forward_in_value_and_gradient(tiny_model):
    model = build_model(str(tiny_model))
    g = torch.Generator().manual_seed(2)
    a, b = (torch.randint(3, 1000, (n,), generator=g).tolist() for n in (11, 7))
    mb = MicroBatch.pack([sample(a), sample(b)], temperature=0.7)
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


def test_compiled_layers_give_the_eager_logprobs_and_gradients_for_any_row_length(tiny_model):
    """`--compile`: one dynamic-shape compile serves rows of every length, with activation checkpointing on,
    and parameter names (what checkpoints and weight export read) are unchanged."""
    g = torch.Generator().manual_seed(3)
    rows = [
        MicroBatch.pack([sample(torch.randint(3, 1000, (n,), generator=g).tolist()) for n in lengths], 1.0)
        for lengths in ([9, 300], [40, 7, 3], [5])
    ]
    eager = build_model(str(tiny_model))
    compiled = build_model(str(tiny_model))
    apply_ac(compiled)
    apply_compile(compiled, "cpu")
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    for mb in rows:
        for model in (eager, compiled):
            model.zero_grad()
            forward_logprobs(model, mb, torch.device("cpu"), where=mb.loss_mask).logprobs.sum().backward()
        want = forward_logprobs(eager, mb, torch.device("cpu")).logprobs
        got = forward_logprobs(compiled, mb, torch.device("cpu")).logprobs
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
