"""The engine's own Llama-family forward against transformers' forward of the same model, step by step."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, Qwen2Config

from prime_rl.configs.inference import StartupError
from prime_rl.inference.engine import build_engine
from prime_rl.inference.engine.native import NativeDecoder, native_unsupported

PROMPTS = [[74, 71, 331, 81, 521, 71, 586], [5, 6], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [9]]


def qwen2_with_bias():
    config = Qwen2Config(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(params=["qwen3", "llama", "qwen2"])
def model(request, tiny_model, tiny_llama):
    if request.param == "qwen2":  # q/k/v biases and tied embeddings
        return qwen2_with_bias()
    path = tiny_model if request.param == "qwen3" else tiny_llama
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits for the next token after `ids`, the sequence run alone."""
    return model(input_ids=torch.tensor([ids])).logits[0, -1]


@torch.inference_mode()
def test_prefill_and_decode_match_transformers_while_rows_join_and_leave(model):
    decoder = NativeDecoder(model, slots=8, device=torch.device("cpu"))
    seqs = [list(PROMPTS[0]), list(PROMPTS[1])]
    logits = decoder.prefill(seqs, torch.tensor([0, 1]), torch.tensor([0, 1]))
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(logits[row], reference_logits(model, seq), atol=1e-4, rtol=1e-4)

    def decode_and_check():
        tokens = [int(t) for t in torch.randint(3, 290, (len(seqs),))]
        for seq, token in zip(seqs, tokens, strict=True):
            seq.append(token)
        logits = decoder.decode(torch.tensor(tokens))
        for row, seq in enumerate(seqs):
            torch.testing.assert_close(logits[row], reference_logits(model, seq), atol=1e-4, rtol=1e-4)

    torch.manual_seed(1)
    for _ in range(3):
        decode_and_check()
    # A longer prompt joins twice (n=2): it is prefilled once and cached in two slots.
    joined = decoder.prefill([PROMPTS[2]], torch.tensor([2, 3]), torch.tensor([0, 0]))
    torch.testing.assert_close(joined[0], joined[1])
    seqs += [list(PROMPTS[2]), list(PROMPTS[2])]
    decode_and_check()
    # Row 0 leaves: the last row moves into its slot.
    decoder.move([3], [0])
    seqs = [seqs[3], seqs[1], seqs[2]]
    for _ in range(70):  # past the first cache capacity (64 columns): the cache grows and keeps its contents
        decode_and_check()
    assert decoder.capacity > 64


@torch.inference_mode()
def test_a_weight_copy_into_the_state_dict_reaches_the_fused_weights(model):
    decoder = NativeDecoder(model, slots=2, device=torch.device("cpu"))
    before = decoder.prefill([PROMPTS[0]], torch.tensor([0]), torch.tensor([0]))[0]
    torch.manual_seed(2)
    for param in model.state_dict().values():
        param.add_(torch.randn_like(param) * 0.05)
    after = decoder.prefill([PROMPTS[0]], torch.tensor([0]), torch.tensor([0]))[0]
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, reference_logits(model, PROMPTS[0]), atol=1e-4, rtol=1e-4)


def test_architectures_outside_the_native_set_are_named():
    assert native_unsupported(GPT2Config()) == "architecture 'gpt2' is not one of llama, mistral, qwen2, qwen3"
    assert native_unsupported(Qwen2Config(use_sliding_window=True, sliding_window=64)) == "sliding-window attention"
    assert native_unsupported(Qwen2Config()) is None


def test_native_on_an_unsupported_model_is_a_startup_error_and_auto_falls_back(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    config = GPT2Config(vocab_size=1024, n_embd=32, n_layer=1, n_head=2, n_positions=128)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(tmp_path)
    with pytest.raises(StartupError, match="engine.model_impl = native cannot serve this model: architecture 'gpt2'"):
        build_engine(str(tmp_path), device="cpu", model_impl="native")
    engine = build_engine(str(tmp_path), device="cpu")
    try:
        assert engine.model_impl == "transformers"
    finally:
        engine.close()
