"""Models that ask the attention function for more than causal attention (Gemma 2: attention-logit softcap
and sliding windows) get, on packed rows, the logprobs of their own HF eager forward on each sample alone."""

import shutil

import pytest
import torch

from prime_rl.trainer import attention
from prime_rl.trainer.attention import check_supported
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.logprobs import forward_logprobs
from prime_rl.trainer.micro_batch import MicroBatch
from prime_rl.trainer.model import build_model
from prime_rl.utils.tiny_model import GEMMA2_SLIDING_WINDOW, create_tiny_model
from tests.samples import sample

CPU = torch.device("cpu")
# Longer than the window of 8 (but for the 5-token one), so the window hides keys in most samples.
LENGTHS = (21, 5, 30, 12)


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory):
    return create_tiny_model(tmp_path_factory.mktemp("models") / "tiny-gemma2", "gemma2")


def _variant(base, tmp_path, **config):
    """A copy of the model at `base` (same weights) with some config fields changed."""
    from transformers import AutoConfig

    path = shutil.copytree(base, tmp_path / "variant")
    changed = AutoConfig.from_pretrained(path)
    for key, value in config.items():
        setattr(changed, key, value)
    changed.save_pretrained(path)
    return path


def _samples(lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


def _eager_logprobs(path, samples):
    """Each sample alone through the model's own HF forward with eager attention: logprobs of tokens 1.., and
    the gradient of their sum."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    out = []
    for ids in samples:
        ids = torch.tensor([ids])
        out.append(model(ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0])
    torch.cat(out).sum().backward()
    return [lp.detach() for lp in out], {n: p.grad for n, p in model.named_parameters()}


def _check_packed_matches_eager(path, where: bool):
    samples = _samples(LENGTHS)
    want, want_grads = _eager_logprobs(path, samples)
    model = build_model(str(path))
    check_supported(model)
    mb = MicroBatch.pack([sample(ids) for ids in samples], temperature=1.0)
    out = forward_logprobs(model, mb, CPU, where=mb.loss_mask if where else None).logprobs
    got = out[0].split(list(LENGTHS))
    for g, w in zip(got, want, strict=True):  # position 0 of a sample has no prefix
        torch.testing.assert_close(g[1:].detach(), w, atol=1e-5, rtol=0)
    sum(g[1:].sum() for g in got).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        torch.testing.assert_close(p.grad, want_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("where", [False, True], ids=["all-positions", "logits-to-keep"])
def test_gemma2_packed_logprobs_and_gradients_equal_its_eager_forward_per_sample(tiny_gemma2, where):
    """Attention softcap 2, window 8 on alternate layers, final-logit softcap 5 (applied by the HF forward the
    trainer calls, also when it keeps only some positions). Ignoring either attention feature moves
    logprobs by 0.2 (softcap) to 1.6 (window), the final softcap by 0.05."""
    _check_packed_matches_eager(tiny_gemma2, where)


@pytest.mark.parametrize(
    "config",
    [
        {"sliding_window": 4096},
        {"attn_logit_softcapping": None},
    ],
    ids=["softcap-alone", "window-alone"],
)
def test_gemma2_with_softcap_alone_or_window_alone_matches_its_eager_forward(tiny_gemma2, tmp_path, config):
    _check_packed_matches_eager(_variant(tiny_gemma2, tmp_path, **config), where=False)


def _count_calls(monkeypatch, *names: str) -> dict[str, int]:
    """Count the calls `packed_attention` makes to these functions of attention.py."""
    calls = dict.fromkeys(names, 0)

    def counting(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return counted

    for name in names:
        monkeypatch.setattr(attention, name, counting(name, getattr(attention, name)))
    return calls


@pytest.mark.parametrize("arch", ["qwen3", "gemma2-window-only-short-samples"])
def test_plain_causal_attention_keeps_the_fast_packed_op(arch, tiny_model, tiny_gemma2, tmp_path, monkeypatch):
    """Qwen3 asks for neither feature; a window no sample outgrows hides nothing (Mistral's 4096)."""
    calls = _count_calls(monkeypatch, "packed_causal_attention", "capped_window_attention")
    path = tiny_model if arch == "qwen3" else _variant(tiny_gemma2, tmp_path, attn_logit_softcapping=None)
    model = build_model(str(path))
    lengths = (GEMMA2_SLIDING_WINDOW, 3, GEMMA2_SLIDING_WINDOW - 1)
    with torch.no_grad():
        forward_logprobs(model, MicroBatch.pack([sample(ids) for ids in _samples(lengths)], 1.0), CPU)
    assert calls == {"packed_causal_attention": model.config.num_hidden_layers, "capped_window_attention": 0}


def test_check_supported_refuses_attention_the_packed_path_cannot_reproduce(tiny_gemma2):
    model = build_model(str(tiny_gemma2))
    check_supported(model)
    model.config.attention_chunk_size = 4
    with pytest.raises(TrainerError, match="chunked attention"):
        check_supported(model)
    del model.config.attention_chunk_size
    model.model.layers[0].self_attn.sinks = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(TrainerError, match="attention sinks"):
        check_supported(model)
