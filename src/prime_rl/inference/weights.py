"""Checking a trainer's `weights/step_n` directory against the served model, for every backend (DESIGN §4).

A dir is servable when it is complete (`STABLE`), its `config.json` (when present) describes the served
architecture, and its safetensors hold every served tensor under the checkpoint's name, with the served
shape and a floating dtype where the model's is floating (precision may differ and is cast on load). Only
the files' headers are read here, so a bad dir is refused before any backend touches its weights: the
built-in engine compares with its model's state dict, vLLM with the served checkpoint's own headers (its
loader expects checkpoint names; anything else would fail half-way through a load).
"""

from __future__ import annotations

import json
from pathlib import Path

from prime_rl.protocol import is_stable, step_of
from prime_rl.utils.hf_layout import TensorSpecs, header_specs

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


def check_config(weight_dir: Path, ours: dict) -> None:
    """Raise WeightsError when `weight_dir/config.json` describes another architecture than the served one."""
    path = weight_dir / "config.json"
    if not path.is_file():
        return  # a bare safetensors dir: the tensor check still catches shape mismatches
    try:
        theirs = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise WeightsError(f"{path}: cannot read: {e}") from None
    if not isinstance(theirs, dict):
        raise WeightsError(f"{path}: not a JSON object")
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


class BroadcastReceiver:
    """One inference worker's seat in the trainer's weight broadcast group (protocol.broadcast).

    Kept across steps (forming a group costs a round of connections, and seconds with nccl); a request for
    another group (a restarted trainer) or a failed transfer leaves the old one, so the next request joins
    afresh. Only one transfer runs at a time (the control plane serializes weight swaps).
    """

    def __init__(self) -> None:
        self.rdv = None
        self.store = None
        self.pg = None

    def receive(self, rdv, rank: int, step: int, device, served: TensorSpecs, tied: bool) -> dict:
        """Step `step`'s tensors in the sender's dtypes on `device`, checked against `served`; the served
        weights are untouched. Raises WeightsError naming the trainer when the transfer fails."""
        from prime_rl.protocol.broadcast import BroadcastError, ask_for, connect_store, join_group, receive_step

        def check(got_step: int, specs: dict) -> None:
            if got_step != step:
                raise WeightsError(f"the trainer sent weight step {got_step}, the request named {step}")
            check_specs({n: (shape, dtype.is_floating_point) for n, (shape, dtype) in specs.items()}, served, tied)

        try:
            if self.rdv != rdv:
                self.leave()
                self.store = connect_store(rdv, master=False)
                self.rdv = rdv
            ask_for(self.store, rdv, step)
            if self.pg is None:
                self.pg = join_group(self.store, rdv, rank)
            stream = receive_step(self.pg, device, check)
            next(stream)  # the checked header
            return dict(stream)
        except WeightsError:  # the header does not fit the served model: the transfer is abandoned
            self.leave()
            raise
        except BroadcastError as e:
            self.leave()
            raise WeightsError(
                f"weight broadcast of step {step} from the trainer at {rdv.where} failed ({e}); "
                "is the trainer alive? The previous weights keep serving"
            ) from None
        except (RuntimeError, OSError) as e:  # the store client: the trainer went away
            self.leave()
            message = f"weight broadcast of step {step}: lost the trainer's rendezvous at {rdv.where}: {e}"
            raise WeightsError(message) from None

    def leave(self) -> None:
        self.rdv = self.store = self.pg = None  # dropping the handles closes the connections
