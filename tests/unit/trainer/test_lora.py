"""LoRA in the trainer: only the adapter trains, ships and is checkpointed; what ships is a peft adapter dir
whose merge into the base is the policy the trainer computed; dropout of the base config is off."""

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from prime_rl.configs.trainer import TrainerConfig
from prime_rl.inference.engine.weights import model_linears
from prime_rl.inference.weights import read_adapter
from prime_rl.protocol import is_stable
from prime_rl.protocol.parity import read_checksum
from prime_rl.trainer.ckpt import Progress, _safe_reader, load_checkpoint, save_checkpoint
from prime_rl.trainer.convert import convert
from prime_rl.trainer.loading import build_training
from prime_rl.trainer.logprobs import forward_logprobs
from prime_rl.trainer.micro_batch import MicroBatch
from prime_rl.trainer.rl.train import train_step
from prime_rl.trainer.weights import save_weights
from prime_rl.utils.lora import adapter_pairs, merge_weight
from tests.samples import sample


def _config(model, out, **lora) -> TrainerConfig:
    return TrainerConfig(
        model={"name": str(model), "lora": {"rank": 4, "alpha": 8, **lora}},
        output_dir=out,
        device="cpu",
        optim={"lr": 1e-2},
    )


def _batch(seed: int) -> MicroBatch:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in (12, 9):
        ids = torch.randint(3, 1000, (n,), generator=g).tolist()
        advantage = float(torch.randn((), generator=g))
        samples.append((ids, [-1.0] * n, advantage))
    return MicroBatch.pack([sample(ids, 3, adv, lp) for ids, lp, adv in samples], temperature=1.0)


def _train(config, one_rank, steps: range, state=None):
    from prime_rl.trainer.weights import build_model_files

    # lora_A starts random: a resumed run starts from another draw, which its checkpoint must overwrite.
    torch.manual_seed(1 if state is not None else 0)
    model, optimizer, scheduler = build_training(config, one_rank, max_steps=10)
    if state is not None:
        load_checkpoint(config.output_dir, state, model, optimizer, scheduler, 0)
    for step in steps:
        train_step(model, optimizer, [_batch(step)], config, one_rank)
        scheduler.step()
    return model, optimizer, scheduler, build_model_files(config.model.name, config.model.lora)


def test_only_adapters_train_and_the_shipped_adapter_is_the_trainers_policy(tiny_model, tmp_path, one_rank):
    config = _config(tiny_model, tmp_path)
    base = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(tiny_model).state_dict().items()}
    model, _, _, files = _train(config, one_rank, range(2))

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    for name, value in model.state_dict().items():
        own = name.replace(".base_layer.", ".")
        if name not in trainable:  # every base tensor is bit-identical to the checkpoint's
            assert torch.equal(value, base[own]), name
    assert any(model.get_parameter(n).abs().sum() > 0 for n in trainable if ".lora_B." in n)

    path = save_weights(model, files, tmp_path, step=2)
    assert is_stable(path) and sorted(p.name for p in path.iterdir()) == [
        "STABLE", "adapter_config.json", "adapter_model.safetensors", "checksum.json"
    ]  # fmt: skip
    # what a server reading the adapter reports is what the trainer wrote
    linears = model_linears(AutoModelForCausalLM.from_pretrained(tiny_model))
    assert read_adapter(path, config.model.lora, linears).checksum == read_checksum(path)
    adapter = load_file(path / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in adapter
    assert adapter["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"].shape == (64, 4)
    cfg = json.loads((path / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"], cfg["base_model_name_or_path"]) == (
        4,
        8,
        0.0,
        str(tiny_model),
    )

    # The trainer's logprobs = peft's own loading of the dir = the merged base, all within 1e-5.
    mb = _batch(7)
    with torch.no_grad():
        trainer = forward_logprobs(model, mb, torch.device("cpu")).logprobs
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), path)
        merged_model = AutoModelForCausalLM.from_pretrained(tiny_model)
        state = merged_model.state_dict()
        for module, (a, b) in adapter_pairs(adapter).items():
            state[f"{module}.weight"] = merge_weight(state[f"{module}.weight"], a, b, cfg["lora_alpha"] / cfg["r"])
        merged_model.load_state_dict(state)
        ids = mb.input_ids[:, :12]
        for other in (peft_model, merged_model):
            logits = other(ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
            torch.testing.assert_close(logits, trainer[0, 1:12], atol=1e-5, rtol=0)


def test_a_lora_checkpoint_holds_the_adapter_resumes_exactly_and_converts(tiny_model, tmp_path, one_rank):
    straight = _train(_config(tiny_model, tmp_path / "a"), one_rank, range(4))[0]

    config = _config(tiny_model, tmp_path / "b")
    model, optimizer, scheduler, files = _train(config, one_rank, range(2))
    ckpt = save_checkpoint(config.output_dir, 2, model, optimizer, scheduler, Progress(step=2), files, 0)
    tensors = [k for k, v in _safe_reader(ckpt).read_metadata().state_dict_metadata.items() if hasattr(v, "size")]
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors)  # adapter + its AdamW moments
    resumed = _train(config, one_rank, range(2, 4), state=2)[0]
    for name, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name

    adapter_dir = convert(ckpt, tmp_path / "adapter")
    assert (adapter_dir / "adapter_config.json").is_file()
    merged_dir = convert(ckpt, tmp_path / "merged", merge=True)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), adapter_dir)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    want = peft_model(ids).logits
    torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(merged_dir)(ids).logits, want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="cannot load the adapter's base model"):
        convert(ckpt, tmp_path / "nobase", merge=True, base=str(tmp_path / "missing"))


def test_rl_refuses_adapter_dropout_but_every_config_dropout_is_off(tiny_model, tmp_path, one_rank):
    with pytest.raises(ValueError, match="lora.dropout = 0.1: .* set it to 0"):
        _config(tiny_model, tmp_path, dropout=0.1)

    dropped = tmp_path / "dropout-model"
    hf = AutoModelForCausalLM.from_pretrained(tiny_model)
    hf.config.attention_dropout = 0.1
    hf.save_pretrained(dropped)
    (dropped / "tokenizer.json").write_bytes((tiny_model / "tokenizer.json").read_bytes())
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model / name).is_file():
            (dropped / name).write_bytes((tiny_model / name).read_bytes())
    config = TrainerConfig(model={"name": str(dropped)}, output_dir=tmp_path, device="cpu")
    model = build_training(config, one_rank, max_steps=1)[0]
    assert model.training and model.config.attention_dropout == 0.0
    mb = _batch(3)
    first, second = (forward_logprobs(model, mb, torch.device("cpu")).logprobs for _ in range(2))
    assert torch.equal(first, second)  # with dropout 0.1 they differed by ~0.09
    assert json.loads((dropped / "config.json").read_text())["attention_dropout"] == 0.1
