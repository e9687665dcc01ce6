"""`convert-checkpoint`: a trainer or SFT DCP checkpoint → a standalone HF safetensors model dir.

    uv run convert-checkpoint outputs/checkpoints/step_20/trainer outputs/step_20-hf [--max-shard-size 5GB]

A LoRA checkpoint (it holds the adapter only) becomes a peft adapter dir, or with `--merge` the base model
(the one `hf/adapter_config.json` names, or `--base`) with the adapter merged in: a full HF model dir.

Works on any machine and for any world size the checkpoint was written with: the shards are read
without a process group. The output loads with `transformers` and vLLM like a hub model (config,
generation config, tokenizer, `model.safetensors` or shards + `model.safetensors.index.json`).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

from prime_rl.protocol import DiskFull
from prime_rl.trainer.errors import TrainerError
from prime_rl.utils.logging import setup_logging

logger = logging.getLogger("prime_rl")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="convert-checkpoint", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="checkpoints/step_n/trainer (or checkpoints/step_n)")
    parser.add_argument("output", type=Path, help="HF model dir to write (must not exist or be empty)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB or 500MB")
    parser.add_argument("--merge", action="store_true", help="LoRA: write base + adapter merged, not the adapter")
    parser.add_argument("--base", help="LoRA --merge: the base model (hub id or dir); default: the one it names")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging("convert", None, "INFO", to_file=False)
    try:
        out = convert(args.checkpoint, args.output, args.max_shard_size, args.merge, args.base)
    except (FileNotFoundError, FileExistsError, ValueError, TrainerError, DiskFull) as e:
        print(f"convert-checkpoint: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    logger.info(f"wrote {out}")


def convert(
    checkpoint: Path, output: Path, max_shard_size: str = "5GB", merge: bool = False, base: str | None = None
) -> Path:
    output = Path(output)
    if output.exists() and any(output.iterdir()):  # before the heavy imports: a refusal is instant
        raise FileExistsError(f"{output} exists and is not empty")
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from prime_rl.trainer.ckpt import HF_FILES_DIR, load_hf_state_dict
    from prime_rl.trainer.weights import meta_model, saved_dtype, write_safetensors
    from prime_rl.utils.hf_layout import checkpoint_state_dict
    from prime_rl.utils.lora import ADAPTER_CONFIG

    checkpoint = Path(checkpoint)
    if not (checkpoint / HF_FILES_DIR).is_dir() and (checkpoint / "trainer").is_dir():
        checkpoint = checkpoint / "trainer"
    state_dict = load_hf_state_dict(checkpoint)
    hf = checkpoint / HF_FILES_DIR
    config = AutoConfig.from_pretrained(hf)
    if (hf / ADAPTER_CONFIG).is_file():
        return convert_adapter(state_dict, hf, output, merge, base, max_shard_size)
    if merge or base:
        raise ValueError(f"{checkpoint} is a full fine-tuning checkpoint: --merge and --base are for LoRA ones")
    # The DCP shards hold the model's own parameter names; the HF dir gets the checkpoint's (see weights.py).
    state_dict = checkpoint_state_dict(meta_model(config), state_dict)
    output.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(output)
    GenerationConfig.from_pretrained(hf).save_pretrained(output)
    AutoTokenizer.from_pretrained(hf).save_pretrained(output)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    write_safetensors(state_dict, output, saved_dtype(config), tied, max_shard_size)
    return output


def convert_adapter(
    state_dict: dict, hf: Path, output: Path, merge: bool, base: str | None, max_shard_size: str
) -> Path:
    """A LoRA checkpoint's adapter as a peft dir, or (`merge`) merged into its base as a full HF model dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from prime_rl.trainer.weights import peft_name, saved_dtype, write_safetensors
    from prime_rl.utils.hf_layout import checkpoint_state_dict
    from prime_rl.utils.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_pairs, merge_weight

    adapter_config = json.loads((hf / ADAPTER_CONFIG).read_text())
    adapter = {peft_name(k): v for k, v in state_dict.items()}
    output.mkdir(parents=True, exist_ok=True)
    if not merge:
        shutil.copyfile(hf / ADAPTER_CONFIG, output / ADAPTER_CONFIG)
        write_safetensors(adapter, output, torch.float32, tied=False, filename=ADAPTER_WEIGHTS)
        return output
    base = base or adapter_config["base_model_name_or_path"]
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the adapter's base model {base!r} (pass --base): {e}") from None
    state = model.state_dict()
    scale = adapter_config["lora_alpha"] / adapter_config["r"]
    for module, (a, b) in adapter_pairs(adapter).items():
        state[f"{module}.weight"] = merge_weight(state[f"{module}.weight"], a, b, scale)
    model.config.save_pretrained(output)
    GenerationConfig.from_pretrained(hf).save_pretrained(output)
    AutoTokenizer.from_pretrained(hf).save_pretrained(output)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    write_safetensors(checkpoint_state_dict(model, state), output, saved_dtype(model.config), tied, max_shard_size)
    return output


if __name__ == "__main__":
    main()
