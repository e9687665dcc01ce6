"""Checking a trainer's `weights/step_n` directory against the served model, for every backend (docs/design.md §4).

A dir is servable when it is complete (`STABLE`), its `config.json` (when present) describes the served
architecture, and its safetensors hold every served tensor under the checkpoint's name, with the served
shape and a floating dtype where the model's is floating (precision may differ and is cast on load). Only
the files' headers are read here, so a bad dir is refused before any backend touches its weights: the
built-in engine compares with its model's state dict, vLLM with the served checkpoint's own headers (its
loader expects checkpoint names; anything else would fail half-way through a load).

A server started with `model.lora` takes LoRA adapters instead: a peft adapter dir (`adapter_config.json` +
`adapter_model.safetensors`, what `save_pretrained` of a peft model writes) whose rank and target modules
the server allows and whose every `lora_A`/`lora_B` pair names a linear layer of the served model with its
in/out features (`check_adapter_dir`, headers only; `read_adapter` then reads the tensors and refuses
non-finite ones). Each kind of server refuses the other kind of dir with a 400 saying so. Only JSON and
safetensors are read: nothing in a dir can run code.

Every backend reports the weight checksum (protocol.parity) of what it read or received, in the
`/update_weights` answer and in `/health`, for the orchestrator to compare with the trainer's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prime_rl.protocol import is_stable, step_of
from prime_rl.protocol.parity import checksum_of
from prime_rl.utils.hf_layout import TensorSpecs, header_specs
from prime_rl.utils.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_pairs

if TYPE_CHECKING:
    import torch

    from prime_rl.configs import LoraConfig

# Config keys that fix the shapes and the computation of the served model.
ARCHITECTURE_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "head_dim",
    "tie_word_embeddings",
)


class WeightsError(ValueError):
    """A weight directory that cannot be served; the message says why."""


def check_weight_dir(weight_dir: Path, served_config: dict, served: TensorSpecs) -> tuple[int, list[Path]]:
    """(step, safetensors files) of a dir the served model can load, else WeightsError saying what is wrong."""
    step, files = check_weight_files(weight_dir)
    if (weight_dir / ADAPTER_CONFIG).exists():
        raise WeightsError(
            f"{weight_dir}: a LoRA adapter ({ADAPTER_CONFIG}), and this server serves full weights; "
            "start it with --model.lora to serve adapters"
        )
    check_config(weight_dir, served_config)
    check_specs(read_specs(files), served, tied=bool(served_config.get("tie_word_embeddings")))
    return step, files


def check_weight_files(weight_dir: Path) -> tuple[int, list[Path]]:
    """(step, safetensors files) of a complete `weights/step_n` dir, else WeightsError saying what is wrong."""
    step = step_of(weight_dir)
    if step is None:
        raise WeightsError(f"{weight_dir}: not a weights/step_<n> directory")
    try:
        if not weight_dir.is_dir():
            raise WeightsError(f"{weight_dir}: no such directory")
        if not is_stable(weight_dir):
            raise WeightsError(f"{weight_dir}: not complete (no STABLE marker)")
        files = sorted(weight_dir.glob("*.safetensors"))
        # A FIFO or device named *.safetensors would block its reader forever.
        odd = [f.name for f in files if not f.is_file()]
    except OSError as e:  # a name too long, a permission, an I/O error: the dir cannot be served
        raise WeightsError(f"{str(weight_dir)[:200]}: cannot read: {e.strerror or e}") from None
    if odd:
        raise WeightsError(f"{weight_dir}: not regular files: {', '.join(odd[:5])}")
    if not files:
        raise WeightsError(f"{weight_dir}: no *.safetensors files")
    return step, files


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object read from a weight dir, else WeightsError naming the file."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise WeightsError(f"{path}: cannot read: {e}") from None
    if not isinstance(value, dict):
        raise WeightsError(f"{path}: not a JSON object")
    return value


def check_config(weight_dir: Path, ours: dict) -> None:
    """Raise WeightsError when `weight_dir/config.json` describes another architecture than the served one."""
    path = weight_dir / "config.json"
    if not path.is_file():
        return  # a bare safetensors dir: the tensor check still catches shape mismatches
    theirs = read_json_object(path)
    differ = [
        f"{key} is {theirs[key]!r}, the served model has {ours.get(key)!r}"
        for key in ARCHITECTURE_KEYS
        if key in theirs and key in ours and theirs[key] != ours[key]
    ]
    if differ:
        raise WeightsError(f"{path}: another architecture than the served model: " + "; ".join(differ))


def read_specs(files: list[Path]) -> TensorSpecs:
    """Names, shapes and dtype kinds from the safetensors headers (no tensor data is read)."""
    specs: TensorSpecs = {}
    for file in files:
        try:
            specs |= header_specs(file)
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise WeightsError(f"{file}: cannot read: {e}") from None
    return specs


def check_specs(got: TensorSpecs, served: TensorSpecs, tied: bool) -> None:
    """Raise WeightsError naming the first few missing, unexpected or mis-shaped tensors.

    A tied `lm_head.weight` may be absent (the trainer may save it once) or present (it is the embedding).
    """
    problems = []
    for name, (shape, floating) in served.items():
        if name not in got:
            if not (tied and name == "lm_head.weight"):
                problems.append(f"missing {name}")
        elif got[name][0] != shape:
            problems.append(f"{name} has shape {got[name][0]}, the model needs {shape}")
        elif got[name][1] != floating:
            problems.append(f"{name} has a {'floating' if got[name][1] else 'non-floating'} dtype, the model's is not")
    problems += [f"unexpected {name}" for name in got if name not in served and not (tied and name == "lm_head.weight")]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise WeightsError("weights do not match the served model: " + "; ".join(problems[:5]) + more)


# ---- LoRA adapters ---------------------------------------------------------------------------------

# peft's saved names: `base_model.model.<module of the served model>.lora_{A,B}.weight`.
ADAPTER_TENSOR = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")
# adapter_config.json keys that change what the adapter computes, with the only value we serve: anything
# else (DoRA, rsLoRA's scale, per-module ranks, full copies of modules, biases) would be served wrong.
NEUTRAL_KEYS = {
    "use_dora": False,
    "use_rslora": False,
    "fan_in_fan_out": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "modules_to_save": None,
    "target_parameters": None,
    "bias": "none",
    "lora_bias": False,
}


@dataclass
class AdapterDir:
    """A checked adapter dir: its step, file, rank r, alpha and the linear modules it adapts."""

    step: int
    file: Path
    rank: int
    alpha: float
    modules: list[str]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass
class Adapter:
    """An adapter's float32 tensors: module -> (A [r, in], B [out, r]); the update is scale · B @ A."""

    step: int
    scale: float
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    checksum: str = ""  # the weight checksum of the tensors as read (protocol.parity)


def linear_shapes(served: TensorSpecs) -> dict[str, tuple[int, int]]:
    """module -> (in_features, out_features) of the linear layers in a checkpoint layout (2-D weights that
    are not embeddings)."""
    return {
        name.removesuffix(".weight"): (shape[1], shape[0])
        for name, (shape, floating) in served.items()
        if name.endswith(".weight") and len(shape) == 2 and floating and "embed" not in name
    }


def targeted(module: str, targets: list[str]) -> bool:
    """Whether `module` is one of `targets` (peft's rule: the full name, or its last dotted parts)."""
    return any(module == t or module.endswith(f".{t}") for t in targets)


def check_adapter_dir(weight_dir: Path, lora: LoraConfig, linears: dict[str, tuple[int, int]]) -> AdapterDir:
    """The checked adapter in a `weights/step_n` dir (headers only), else WeightsError saying what is wrong.

    `linears`: module -> (in, out) of the served model's linear layers (`linear_shapes`)."""
    step, files = check_weight_files(weight_dir)
    path = weight_dir / ADAPTER_CONFIG
    if not path.exists():
        raise WeightsError(
            f"{weight_dir}: no {ADAPTER_CONFIG}; this server serves LoRA adapters (model.lora), not full weights"
        )
    config = read_adapter_config(path)
    rank, alpha, targets = config["r"], config["lora_alpha"], config["target_modules"]
    if rank > lora.rank:
        raise WeightsError(f"{path}: rank r={rank} exceeds the served maximum model.lora.rank={lora.rank}")
    foreign = [t for t in targets if t not in lora.target_modules]
    if foreign:
        allowed = ", ".join(lora.target_modules)
        raise WeightsError(f"{path}: target_modules {foreign} are not served (model.lora.target_modules: {allowed})")
    if files != [weight_dir / ADAPTER_WEIGHTS]:
        names = ", ".join(f.name for f in files)
        raise WeightsError(f"{weight_dir}: an adapter dir holds exactly {ADAPTER_WEIGHTS}, this one has {names}")
    modules = check_adapter_specs(read_specs(files), rank, targets, linears)
    return AdapterDir(step=step, file=files[0], rank=rank, alpha=float(alpha), modules=modules)


def read_adapter_config(path: Path) -> dict[str, Any]:
    """adapter_config.json, checked to describe a plain LoRA adapter (r, lora_alpha, a list of targets)."""
    config = read_json_object(path)
    if config.get("peft_type", "LORA") != "LORA":
        raise WeightsError(f"{path}: peft_type {config['peft_type']!r}; only LORA adapters are served")
    rank, alpha, targets = config.get("r"), config.get("lora_alpha"), config.get("target_modules")
    if type(rank) is not int or rank < 1:
        raise WeightsError(f"{path}: r must be a positive integer, got {rank!r}")
    if type(alpha) not in (int, float) or not 0 < alpha < float("inf"):
        raise WeightsError(f"{path}: lora_alpha must be a positive number, got {alpha!r}")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise WeightsError(f"{path}: target_modules must be a non-empty list of module names, got {targets!r}")
    odd = [f"{key}={config[key]!r}" for key, neutral in NEUTRAL_KEYS.items() if config.get(key) not in (neutral, None)]
    if odd:
        raise WeightsError(f"{path}: unsupported LoRA options {', '.join(odd)} (only plain LoRA is served)")
    return config


def check_adapter_specs(
    specs: TensorSpecs, rank: int, targets: list[str], linears: dict[str, tuple[int, int]]
) -> list[str]:
    """The adapted modules, when every tensor is one half of a lora_A [r, in] / lora_B [out, r] pair on a
    targeted linear layer of the served model; else WeightsError naming the first few problems."""
    problems, halves = [], {}
    for name, (shape, floating) in specs.items():
        match = ADAPTER_TENSOR.fullmatch(name)
        if match is None:
            problems.append(f"unexpected {name} (not base_model.model.<module>.lora_A/lora_B.weight)")
            continue
        module, half = match.groups()
        halves.setdefault(module, set()).add(half)
        if module not in linears:
            problems.append(f"{name}: the served model has no linear layer {module}")
            continue
        if not targeted(module, targets):
            problems.append(f"{name}: {module} is not in the adapter's target_modules")
        fan_in, fan_out = linears[module]
        need = (rank, fan_in) if half == "A" else (fan_out, rank)
        if shape != need:
            problems.append(f"{name} has shape {shape}, the model needs {need} (r={rank})")
        elif not floating:
            problems.append(f"{name} has a non-floating dtype")
    problems += [f"{module}: lora_{'B' if 'A' in h else 'A'} is missing" for module, h in halves.items() if len(h) < 2]
    if not halves and not problems:
        problems.append("no lora_A/lora_B tensors")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise WeightsError("adapter does not match the served model: " + "; ".join(problems[:5]) + more)
    return sorted(halves)


def nonfinite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating tensors holding a NaN or an inf. Each is summed in float64, the sums read at once: one
    host sync, and ~4x faster than `isfinite(t).all()` on the CPU (0.17 against 0.74 s for 0.44 B). The sum is
    finite exactly when every value is: |values| <= 3.4e38 (fp32's largest) times 2^63 elements stays far below
    float64's 1.8e308, and inf - inf is NaN. Float64 tensors, whose sums could overflow, are checked value by value."""
    import torch

    floating = [(name, t) for name, t in tensors.items() if t.is_floating_point()]
    if not floating:
        return []
    finite = [
        t.isfinite().all() if t.dtype == torch.float64 else t.sum(dtype=torch.float64).isfinite() for _, t in floating
    ]
    return [name for (name, _), ok in zip(floating, torch.stack(finite).tolist(), strict=True) if not ok]


def read_adapter(weight_dir: Path, lora: LoraConfig, linears: dict[str, tuple[int, int]]) -> Adapter:
    """The adapter of a checked dir as float32 tensors, else WeightsError (a bad dir, non-finite values)."""
    from safetensors.torch import load_file

    checked = check_adapter_dir(Path(weight_dir), lora, linears)
    try:
        tensors = load_file(checked.file)
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise WeightsError(f"{checked.file}: cannot read: {e}") from None
    if broken := nonfinite(tensors):
        raise WeightsError(f"{checked.file}: non-finite values (NaN or inf) in {', '.join(broken[:5])}")
    pairs = {m: (a.float(), b.float()) for m, (a, b) in adapter_pairs(tensors).items()}
    return Adapter(step=checked.step, scale=checked.scale, pairs=pairs, checksum=checksum_of(tensors.items()).hex)
