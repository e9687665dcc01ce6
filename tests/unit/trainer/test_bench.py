"""MFU's FLOPs per token (trainer/rl/bench.py), checked against upstream prime-rl's published figure."""

import pytest

from prime_rl.trainer.rl.bench import flops_per_token, mean_causal_context
from prime_rl.utils.tiny_model import meta_model, preset_config


def test_mean_causal_context_averages_over_tokens():
    assert mean_causal_context([1, 3]) == (1 + 6) / 4
    assert mean_causal_context([16384]) == 8192.5


def test_qwen3_0_6b_at_16k_gives_upstreams_mfu():
    """Upstream: Qwen3-0.6B, one 16,384-token sample a row, 11.9k tokens/s on one H100 (989 TFLOP/s) = 11.1 % MFU."""
    model = meta_model(preset_config("qwen3-0.6b"))
    flops = flops_per_token(model, mean_causal_context([16384]))
    # 6 x 596,049,920 parameters (tied: the embedding counted once, as the head; 1-D norms are no matmul)
    # + 12 x 28 layers x 2048 (16 heads x 128) x 8192.5
    matmul = sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    assert flops == 6 * matmul + 12 * 28 * 2048 * 8192.5
    assert flops == pytest.approx(9.22e9, rel=1e-3)
    assert 100 * 11.9e3 * flops / 989e12 == pytest.approx(11.1, abs=0.05)


def test_untied_embedding_is_a_lookup_not_a_matmul():
    tied = meta_model(preset_config("qwen3-0.6b", num_layers=1))
    untied = meta_model(preset_config("qwen3-8b", num_layers=1))
    embedding = untied.get_input_embeddings().weight.numel()
    matmul = sum(p.numel() for p in untied.parameters() if p.dim() >= 2)
    assert flops_per_token(untied, 0) == 6 * (matmul - embedding)
    assert flops_per_token(tied, 0) == 6 * sum(p.numel() for p in tied.parameters() if p.dim() >= 2)
