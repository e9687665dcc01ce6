"""tiny-model's presets: real models' shapes, built offline."""

import pytest

from prime_rl.utils.tiny_model import PRESETS, create_tiny_model, meta_model, preset_config


def test_qwen3_0_6b_preset_has_the_hub_models_shape_and_size():
    config = preset_config("qwen3-0.6b")
    shape = {k: getattr(config, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings",
             "max_position_embeddings", "rms_norm_eps")}  # fmt: skip
    assert shape == {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                     "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True,
                     "max_position_embeddings": 40960, "rms_norm_eps": 1e-6}  # fmt: skip
    assert config.rope_parameters["rope_theta"] == 1e6
    model = meta_model(config)  # no 1.2 GB of weights: shapes only
    assert sum(p.numel() for p in model.parameters()) == 596_049_920  # Qwen3-0.6B, embeddings tied


@pytest.mark.parametrize(("preset", "params"), [("qwen3-8b", 8_190_735_360), ("qwen3-4b", 4_022_468_096)])
def test_larger_presets_have_the_hub_models_size(preset, params):
    assert sum(p.numel() for p in meta_model(preset_config(preset)).parameters()) == params


def test_num_layers_cuts_a_presets_depth_but_keeps_its_layer_shapes():
    full, cut = meta_model(preset_config("qwen3-8b")), meta_model(preset_config("qwen3-8b", num_layers=2))
    assert cut.config.num_hidden_layers == 2 and len(cut.model.layers) == 2
    shapes = lambda m: {n: tuple(p.shape) for n, p in m.model.layers[1].named_parameters()}  # noqa: E731
    assert shapes(cut) == shapes(full)
    assert cut.lm_head.weight.shape == full.lm_head.weight.shape == (151936, 4096)


def test_small_preset_builds_and_loads(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    create_tiny_model(tmp_path, preset="qwen3-micro")
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    vocab = PRESETS["qwen3-micro"][6]
    assert model.dtype == torch.bfloat16 and model.config.vocab_size == vocab
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    # The tokenizer is padded to the model's vocabulary: every id a random model samples decodes ...
    assert len(tokenizer) == vocab
    assert tokenizer.decode(list(range(vocab))) != ""
    # ... while text encodes with the trained merges only, never into the fillers.
    ids = tokenizer("Reverse the text character by character: abc xyz 42")["input_ids"]
    assert max(ids) < 1024
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), vocab) and torch.isfinite(logits).all()


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="qwen3-0.6b"):
        preset_config("qwen3-70b")
