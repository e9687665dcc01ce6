"""A trainer or SFT DCP checkpoint → a standalone HF safetensors model dir (what `convert-checkpoint`,
`entrypoints/convert.py`, runs).

A LoRA checkpoint (it holds the adapter only) becomes a peft adapter dir, or with `--merge` the base model
(the one `hf/adapter_config.json` names, or `--base`) with the adapter merged in: a full HF model dir.

Works on any machine and for any world size the checkpoint was written with: the shards are read
without a process group. The output loads with `transformers` and vLLM like a hub model (config,
generation config, tokenizer, `model.safetensors` or shards + `model.safetensors.index.json`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from prime_rl.trainer.ckpt import HF_FILES_DIR, load_hf_state_dict
from prime_rl.trainer.weights import meta_model, peft_name, saved_dtype, write_safetensors
from prime_rl.utils.hf_layout import checkpoint_state_dict
from prime_rl.utils.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_pairs, merge_weight


def convert(
    checkpoint: Path, output: Path, max_shard_size: str = "5GB", merge: bool = False, base: str | None = None
) -> Path:
    """`checkpoint` (checkpoints/step_n or its trainer/ dir) written to `output` as an HF model or adapter dir."""
    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise FileExistsError(f"{output} exists and is not empty")
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
