"""Tiny, deterministic HF causal LMs with a locally built tokenizer, for tests and CPU examples.

Nothing is downloaded: the tokenizer is a byte-level BPE trained (deterministically) on a small
generated corpus, with ChatML special tokens and a chat template; the model is a randomly
initialised Qwen3 or Llama of ~0.3M parameters, a Qwen3-MoE / Mixtral with 4 experts (2 per token), or a
Gemma2 with attention-logit and final-logit softcapping and sliding-window layers (window 8) alternating with
full ones. Each is written with `save_pretrained`, so every part of prime-rl loads them exactly like a hub model.

`--preset` writes a real model's exact shape instead (`PRESETS`: Qwen3-0.6B, -1.7B, -4B, -8B as their hub
config.json gives them), randomly initialised in bfloat16, with the tokenizer's vocabulary padded to the
model's so that every id a random model samples decodes: a full-size model for GPU checks without the hub.

    uv run tiny-model outputs/tiny-qwen3 --arch qwen3
    uv run tiny-model outputs/qwen3-0.6b --preset qwen3-0.6b     # 596M parameters, 1.2 GB
    uv run tiny-model outputs/qwen3-8b-2l --preset qwen3-8b --num-layers 2   # 8B's layers, 2 of them: 3.3 GB
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

ARCHS = ("qwen3", "llama", "qwen3_moe", "mixtral", "gemma2")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Letters and short words: enough structure for BPE merges, and what the built-in environments write.
_ALPHABET = "abcdefghijklmnopqrstuvwxyz"
# The tiny Gemma2's softcaps (attention scores, final logits) and its sliding window (keys a query sees).
GEMMA2_ATTN_SOFTCAP = 2.0
GEMMA2_FINAL_SOFTCAP = 5.0
GEMMA2_SLIDING_WINDOW = 8
# Qwen3 shapes as the hub's config.json of each model gives them (each also: RoPE theta 1e6, 40,960 positions,
# RMSNorm eps 1e-6); `qwen3-micro` is a small one of the same kind, for tests.
PRESET_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")  # fmt: skip
PRESETS: dict[str, tuple] = {
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 128, 151936, True),  # 596,049,920 parameters
    "qwen3-1.7b": (2048, 6144, 28, 16, 8, 128, 151936, True),
    "qwen3-4b": (2560, 9728, 36, 32, 8, 128, 151936, True),
    "qwen3-8b": (4096, 12288, 36, 32, 8, 128, 151936, False),  # 8,190,735,360 parameters
    "qwen3-micro": (128, 384, 2, 4, 2, 32, 2048, True),
}


def _corpus(seed: int, lines: int = 2000) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choice(_ALPHABET) for _ in range(rng.randint(2, 7))) for _ in range(400)]
    digits = [str(rng.randint(0, 999)) for _ in range(100)]
    out = []
    for _ in range(lines):
        parts = [rng.choice(words if rng.random() < 0.8 else digits) for _ in range(rng.randint(3, 12))]
        out.append(" ".join(parts) + rng.choice([".", "?", "!", ""]))
    out += ["Reverse the text character by character.", "What is 12 + 30? Answer: 42", "system user assistant"]
    return out


def build_tokenizer(vocab_size: int = 1024, seed: int = 0, pad_to: int | None = None):
    """A byte-level BPE `PreTrainedTokenizerFast` with ChatML specials; same inputs give the same vocab.

    `pad_to`: grow the vocabulary to this many ids with filler tokens (two or three byte-level symbols that no
    merge produces, so encoding never yields them), so that every id a model of that vocabulary samples
    decodes to some bytes, as with a real tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if pad_to is not None and pad_to > tok.get_vocab_size():
        tok = _padded(tok, pad_to)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _padded(tok, size: int):
    """`tok` with filler tokens appended up to `size` ids (same order every time)."""
    from tokenizers import Tokenizer, pre_tokenizers

    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    fillers = ("".join(t) for n in (2, 3) for t in itertools.product(symbols, repeat=n))
    for filler in fillers:
        if len(vocab) >= size:
            break
        vocab.setdefault(filler, len(vocab))
    return Tokenizer.from_str(json.dumps(data))


def preset_config(preset: str, num_layers: int | None = None, vocab_size: int | None = None):
    """The `Qwen3Config` of a preset (`PRESETS`), bfloat16, cut to `num_layers` layers if given (the real layer
    shapes, fewer of them) and to a `vocab_size` if given (the embedding is then no longer the real one: a
    CPU-sized model of the real transformer); ValueError naming the choices for an unknown one."""
    from transformers import Qwen3Config

    if preset not in PRESETS:
        raise ValueError(f"unknown tiny-model preset {preset!r}; choose from {', '.join(PRESETS)}")
    shape = dict(zip(PRESET_FIELDS, PRESETS[preset], strict=True))
    if num_layers is not None:
        shape["num_hidden_layers"] = num_layers
    if vocab_size is not None:
        shape["vocab_size"] = vocab_size
    return Qwen3Config(rope_theta=1e6, max_position_embeddings=40960, rms_norm_eps=1e-6, dtype="bfloat16", **shape)


def meta_model(config):
    """The model of `config` on the meta device: its parameters' shapes and count, no memory, no init."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def build_config(arch: str, vocab_size: int, hidden_size: int = 64, num_layers: int = 2, max_len: int = 4096):
    from transformers import Gemma2Config, LlamaConfig, MixtralConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        tie_word_embeddings=False,
        dtype="float32",
    )
    if arch == "qwen3":
        return Qwen3Config(head_dim=hidden_size // 4, **common)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            head_dim=hidden_size // 4,
            num_experts=4,
            moe_intermediate_size=hidden_size // 2,
            num_experts_per_tok=2,
            **common,
        )
    if arch == "mixtral":
        return MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common)
    if arch == "gemma2":
        # Weights 5× the usual init scale and low caps (the released models use 50 and 30) so that both caps
        # bite at random init: ignoring the attention cap moves logprobs by ~0.2, the final one by ~0.05.
        # Layers alternate sliding / full as in Gemma 2; the window is shorter than the test samples.
        return Gemma2Config(
            head_dim=32,
            query_pre_attn_scalar=32,
            initializer_range=0.1,
            attn_logit_softcapping=GEMMA2_ATTN_SOFTCAP,
            final_logit_softcapping=GEMMA2_FINAL_SOFTCAP,
            sliding_window=GEMMA2_SLIDING_WINDOW,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
            **common,
        )
    raise ValueError(f"unknown tiny-model arch {arch!r}; choose from {ARCHS}")


def create_tiny_model(
    path: Path,
    arch: str = "qwen3",
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int | None = None,
    vocab_size: int | None = None,
    tokenizer_vocab_size: int = 1024,
    preset: str | None = None,
) -> Path:
    """Write a tiny model + tokenizer to `path` (an HF model dir) and return it. Deterministic in `seed`.

    `vocab_size` (default: the tokenizer's) may exceed the tokenizer, as real models pad theirs; the extra
    rows are never sampled by the tokenizer but cost what a large vocabulary costs in the lm_head and loss.
    `tokenizer_vocab_size` 259 (the 256 bytes + 3 specials) leaves BPE no merges: one token per character.
    `preset` (`PRESETS`) replaces `arch` and the sizes: that shape in bfloat16 (`num_layers` deep if given,
    else the real depth; its real vocabulary unless `vocab_size`), the tokenizer padded to the vocabulary.
    Without a preset, 2 layers unless `num_layers`.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    if vocab_size is not None and vocab_size < tokenizer_vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer_vocab_size}")
    if preset is not None:
        config = preset_config(preset, num_layers, vocab_size)
        tokenizer = build_tokenizer(vocab_size=tokenizer_vocab_size, seed=seed, pad_to=config.vocab_size)
        dtype = torch.bfloat16
    else:
        tokenizer = build_tokenizer(vocab_size=tokenizer_vocab_size, seed=seed)
        config = build_config(arch, vocab_size or len(tokenizer), hidden_size, num_layers or 2)
        dtype = torch.float32
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_perturbed_weights(
    model_dir: Path, output_dir: Path, step: int, noise: float = 0.05, stable: bool = True
) -> Path:
    """A trainer-like `OUTPUT_DIR/weights/step_n`: the model at `model_dir` plus seeded Gaussian noise, with
    its tokenizer, `STABLE`-marked unless `stable=False`. Tests use it as "a different policy"."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prime_rl.protocol import mark_stable, weights_dir

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn_like(p))
    path = weights_dir(output_dir, step)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(path)
    if stable:
        mark_stable(path)
    return path


def ensure_tiny_model(path: Path, arch: str = "qwen3", seed: int = 0) -> Path:
    """Create the tiny model at `path` unless a complete one is already there."""
    path = Path(path)
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    tmp = path.with_name(path.name + ".partial")
    create_tiny_model(tmp, arch=arch, seed=seed)
    if not path.exists():
        tmp.rename(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(prog="tiny-model", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="directory to write the model and tokenizer to")
    parser.add_argument("--arch", choices=ARCHS, default="qwen3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, help="layers (default 2; with --preset: cut its depth to this)")
    parser.add_argument("--tokenizer-vocab-size", type=int, default=1024, help="259: one token per character")
    parser.add_argument("--preset", choices=PRESETS, help="a real model's shape (bf16) instead of --arch and the sizes")
    parser.add_argument("--vocab-size", type=int, help="the vocabulary (with --preset: instead of the real one)")
    args = parser.parse_args()
    vocab = args.tokenizer_vocab_size
    try:
        create_tiny_model(args.path, args.arch, args.seed, args.hidden_size, args.num_layers, args.vocab_size,
                          tokenizer_vocab_size=vocab, preset=args.preset)  # fmt: skip
    except ValueError as e:
        parser.error(str(e))
    what = args.preset or f"tiny {args.arch}"
    print(f"wrote {what} model to {args.path}")


if __name__ == "__main__":
    main()
