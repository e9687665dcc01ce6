"""weights/step_n: a complete, STABLE HF dir with the base model's parameter names."""

import json

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from prime_rl.protocol import is_stable, weights_dir
from prime_rl.trainer.model import build_model
from prime_rl.trainer.parallel import apply_fsdp
from prime_rl.trainer.weights import build_model_files, save_weights, write_safetensors


def test_saved_weights_are_a_loadable_hf_dir_identical_to_the_base(tiny_model, tmp_path, one_rank):
    model = build_model(str(tiny_model))
    apply_fsdp(model, one_rank, torch.float32)
    stale = weights_dir(tmp_path, 1)
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_text("half-written by a crashed run")

    path = save_weights(model, build_model_files(str(tiny_model)), tmp_path, step=1)

    assert path == weights_dir(tmp_path, 1) and is_stable(path)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file(), name
    base, saved = load_file(tiny_model / "model.safetensors"), load_file(path / "model.safetensors")
    assert saved.keys() == base.keys()
    for name in base:
        assert torch.equal(saved[name], base[name]), name
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3"
    reloaded = AutoModelForCausalLM.from_pretrained(path)
    assert AutoTokenizer.from_pretrained(path).eos_token == "<|im_end|>"
    ids = torch.tensor([[5, 6, 7]])
    original = AutoModelForCausalLM.from_pretrained(tiny_model)
    torch.testing.assert_close(reloaded(ids).logits, original(ids).logits)


def test_tied_embeddings_are_stored_once_and_load_back(tiny_model, tmp_path):
    config = AutoConfig.from_pretrained(tiny_model, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config)
    model.config.save_pretrained(tmp_path)
    write_safetensors(model.state_dict(), tmp_path, torch.float32, tied=True)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(reloaded.lm_head.weight, model.model.embed_tokens.weight)


def test_weights_are_saved_in_the_base_models_dtype(tmp_path):
    state = {"w": torch.ones(2, 2), "step": torch.tensor([3])}
    write_safetensors(state, tmp_path, torch.bfloat16, tied=False)
    saved = load_file(tmp_path / "model.safetensors")
    assert saved["w"].dtype == torch.bfloat16 and saved["step"].dtype == torch.int64
