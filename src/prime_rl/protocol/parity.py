"""What proves that every server serves the trainer's weights (docs/design.md §2, §4): weight checksums and
the parity canaries' files.

Weight checksum. One number for a set of named tensors, computed the same way wherever they are: by the
trainer on what it exports (in the export dtype; each FSDP rank on the tensors it writes, the ranks' values
summed), by a server on what it received (the safetensors it read, the tensors of a broadcast, the pairs
vLLM's `load_weights` is fed, an adapter's tensors). It is cheap at any size: no bytes are hashed, each
tensor is reduced on its own device, in row chunks of at most CHUNK_ELEMENTS, to one integer:

    value(t) = Σ_r (r + 1) · rowsum_r(words(t)) mod P,        P = 2^31 - 1

where rows are along dim 0 (a 1-D tensor: each element a row) and words(t) is each row's bytes viewed as
int32 words, summed with wrap-around (mod 2^32: exact in any order, on any device; fast), or, where a row's
bytes are no multiple of 4, as signed ints of the item size, summed in int64. So a change of any element,
of the dtype (other bits) or of the order of rows changes it. Tensors combine order-independently (a sum),
each weighted by a 64-bit key of its name, dtype and shape:

    checksum = Σ_tensors key(name, dtype, shape) · value(t) mod 2^64,   written as 16 hex digits.

Worked example: a float32 tensor "w" = [[1.0], [2.0]] has words [[1065353216], [1073741824]]:
value = 1 · 1065353216 + 2 · 1073741824 mod P = 1065353217 (P = 2147483647); its checksum is
key("w", float32, (2, 1)) · 1065353217 mod 2^64. Products stay below 2^63 before each `mod`, so CPU and
CUDA give the same integer.

The trainer writes `checksum.json` {"checksum", "tensors", "earlier"} into each `weights/step_n` (before
`STABLE`; "earlier": the checksums of the step's earlier publishes, when a resumed trainer redid it) and adds
"checksum" to the broadcast announcement once the step is sent.

Parity canaries (`OUTPUT_DIR/parity/`, JSON only): their paths and formats are at the end of this module; the
orchestrator's gate (orchestrator/parity.py) and the trainer (trainer/rl/parity.py) read and write them here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from prime_rl.protocol.files import atomic_write_json

if TYPE_CHECKING:
    import torch

CHECKSUM_FILE = "checksum.json"
CHUNK_ELEMENTS = 1 << 24  # elements reduced at once: bounds the temporaries (an int64 row sum per row) on any device
P = 2**31 - 1
MASK = 2**64 - 1


def tensor_key(name: str, dtype: torch.dtype, shape: Iterable[int]) -> int:
    """A 64-bit key of a tensor's identity: its name, dtype and shape."""
    text = f"{name}|{str(dtype).removeprefix('torch.')}|{','.join(str(int(x)) for x in shape)}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def tensor_value(t: torch.Tensor, device: torch.device | None = None) -> int:
    """Σ_r (r + 1) · rowsum_r(words(t)) mod P, reduced in chunks of rows on `device` (default: `t`'s; a GPU
    server hashes the host tensors it reads from files there, a chunk at a time) (see the module doc)."""
    return int(device_value(t, device))


def device_value(t: torch.Tensor, device: torch.device | None = None, first_row: int = 0) -> torch.Tensor:
    """`tensor_value` as a 0-d int64 tensor on the reducing device: reading it is the only host sync. With
    `first_row`, `t` is rows first_row, first_row + 1, ... of a larger tensor: its part of that tensor's value
    (the parts' values summed mod P are the whole one's)."""
    import torch

    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    t = t.detach()
    device = t.device if device is None else device
    total = torch.zeros((), dtype=torch.int64, device=device)
    if t.numel() == 0:
        return total
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    rows = t.reshape(t.shape[0] if t.dim() else 1, -1)  # 1-D: (n, 1); a scalar: one row
    per_chunk = max(1, CHUNK_ELEMENTS // max(1, rows.shape[1]))
    for start in range(0, rows.shape[0], per_chunk):
        chunk = rows[start : start + per_chunk].to(device).contiguous()
        if chunk.shape[1] * chunk.element_size() % 4 == 0:
            # int32 accumulation wraps mod 2^32 (14x faster than widening to int64 on a CPU)
            sums = chunk.view(torch.int32).sum(dim=1, dtype=torch.int32).to(torch.int64) & 0xFFFFFFFF
        else:  # 1- or 2-byte items, an odd count: |row sum| < row length · 2^15
            sums = chunk.view(ints).sum(dim=1, dtype=torch.int64)
        sums = sums.remainder(P)  # times a weight <= 2^31: < 2^62
        first = first_row + start + 1
        weights = torch.arange(first, first + chunk.shape[0], dtype=torch.int64, device=device)
        total = (total + (sums * weights.remainder(P)).remainder(P).sum()).remainder(P)
    return total


class Checksum:
    """An order-independent checksum of named tensors: `add` each one (any device), read `hex`.

    Each tensor's term key · value mod 2^64 is kept on the device that reduced it, as two 32-bit limbs in
    int64 (key = kh · 2^32 + kl, value < 2^31: kl · value and kh · value < 2^63), so adding a tensor never
    waits for the device; `value` reads each device's limbs once.

    >>> c = Checksum(); c.add("w", torch.tensor([[1.0], [2.0]])); c.hex  # doctest: +SKIP
    """

    def __init__(self, value: int = 0, tensors: int = 0, device: torch.device | None = None):
        self._value, self.tensors, self.device = value, tensors, device
        self._limbs: dict = {}  # device -> int64 tensor [low 32-bit limbs, high limbs]: Σ of the pending terms

    def add(self, name: str, tensor: torch.Tensor) -> None:
        import torch

        value = device_value(tensor, self.device)
        key = tensor_key(name, tensor.dtype, tensor.shape)
        low = value * (key & 0xFFFFFFFF)
        limbs = torch.stack([low & 0xFFFFFFFF, (low >> 32) + ((value * (key >> 32)) & 0xFFFFFFFF)])
        pending = self._limbs.get(value.device)
        self._limbs[value.device] = limbs if pending is None else pending + limbs
        self.tensors += 1

    @property
    def value(self) -> int:
        for low, high in (limbs.tolist() for limbs in self._limbs.values()):
            self._value = (self._value + low + (high << 32)) & MASK
        self._limbs.clear()
        return self._value

    def merge(self, other: Checksum) -> None:
        """Add another part's tensors (another FSDP rank's, another file's)."""
        self._value = (self.value + other.value) & MASK
        self.tensors += other.tensors

    @property
    def hex(self) -> str:
        return f"{self.value:016x}"

    def record(self) -> dict:
        return {"checksum": self.hex, "tensors": self.tensors}


class RowSums:
    """A checksum of tensors whose rows (dim 0) are spread over ranks, each holding a contiguous run of some:
    every rank `add`s its run of every tensor, in the same order (an empty run too), and `checksum` sums the
    parts' values over the ranks (`reduce`: an all-reduce of an int64 tensor) before keying them, so the result
    is the whole tensors' Checksum. One host sync, in `checksum`."""

    def __init__(self, device: torch.device):
        self.device, self.keys, self.values = device, [], []

    def add(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], rows: torch.Tensor, first_row: int) -> None:
        self.keys.append(tensor_key(name, dtype, shape))
        self.values.append(device_value(rows, self.device, first_row))

    def checksum(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> Checksum:
        import torch

        values = reduce(torch.stack(self.values)).remainder(P).tolist() if self.values else []
        return Checksum(sum(k * v for k, v in zip(self.keys, values, strict=True)) & MASK, len(values))


def checksum_of(tensors: Iterable[tuple[str, torch.Tensor]]) -> Checksum:
    c = Checksum()
    for name, tensor in tensors:
        c.add(name, tensor)
    return c


def summing(tensors: Iterable[tuple[str, torch.Tensor]], into: Checksum) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors` passed through unchanged, each added to `into` on the way (for a stream fed to a loader)."""
    for name, tensor in tensors:
        into.add(name, tensor)
        yield name, tensor


def checksum_file(weight_dir: Path) -> Path:
    return Path(weight_dir) / CHECKSUM_FILE


def write_checksum(weight_dir: Path, checksum: Checksum, earlier: Iterable[str] = ()) -> None:
    """`weight_dir/checksum.json` (the trainer, before the dir is marked STABLE). `earlier`: the checksums of
    the step's earlier publishes (a resumed trainer redoes steps, and CUDA training is not bit-reproducible: a
    server may still hold an earlier attempt's weights of the step, which the trainer did publish)."""
    atomic_write_json(checksum_file(weight_dir), checksum.record() | {"earlier": list(dict.fromkeys(earlier))})


def read_checksums(weight_dir: Path) -> list[str]:
    """Every checksum the trainer published as this step, the newest first ([] when it wrote none: a dir from
    elsewhere)."""
    try:
        data = json.loads(checksum_file(weight_dir).read_text())
        values = [data["checksum"], *data.get("earlier", [])]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    return [v for v in values if isinstance(v, str)] if isinstance(values[0], str) else []


def read_checksum(weight_dir: Path) -> str | None:
    """The checksum the trainer wrote with a weight dir (its newest publish); None when it wrote none."""
    return next(iter(read_checksums(weight_dir)), None)


# ---- parity canaries (OUTPUT_DIR/parity/) ---------------------------------------------------------------
#
# canary.json  {"canaries": [{"env", "token_ids", "scored"}]}: fixed token sequences chosen once by the
#              orchestrator; `scored` marks the sampled tokens (True) the comparison reads, prompts and env
#              replies are False. Written before the rank files of the step that chose them.
# step_n.json  {"step", "logprobs": [[...] per canary]}: the trainer's logprob of every token given its
#              prefix (0.0 at index 0) with the weights of step n, written at the start of its step n.
# sampled_step_n_rank_r.json  {"step", "entries": [[server, tokens, Σ k3, max |Δ logprob|] per sample and
#              server]}: the on-policy loss tokens of trainer rank r's step n (a gate step), each server an
#              index in the orchestrator's client.base_url; written after the step's backward, read and
#              deleted by the orchestrator.


def parity_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "parity"


def canary_file(output_dir: Path) -> Path:
    return parity_dir(output_dir) / "canary.json"


def trainer_scores_file(output_dir: Path, step: int) -> Path:
    return parity_dir(output_dir) / f"step_{step}.json"


def is_gate_step(step: int, interval: int) -> bool:
    """Weight steps 0, interval, 2·interval, ... are compared; interval 0: none."""
    return interval > 0 and step % interval == 0


def write_canaries(output_dir: Path, canaries: list[dict]) -> None:
    """canary.json from [{"env", "token_ids", "scored"}]."""
    atomic_write_json(canary_file(output_dir), {"canaries": canaries})


def read_canaries(output_dir: Path) -> list[dict] | None:
    """The canaries, or None while there are none (not chosen yet, or an unreadable file: a clear message is
    the caller's, which knows whether one is due)."""
    try:
        canaries = json.loads(canary_file(output_dir).read_text())["canaries"]
        for c in canaries:
            ids, scored = c["token_ids"], c["scored"]
            if not (len(ids) == len(scored) >= 2 and all(type(i) is int and i >= 0 for i in ids)):
                return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return canaries


def write_trainer_scores(output_dir: Path, step: int, logprobs: list[list[float]]) -> None:
    atomic_write_json(trainer_scores_file(output_dir, step), {"step": step, "logprobs": logprobs})


def read_trainer_scores(output_dir: Path, step: int) -> list[list[float]] | None:
    """The trainer's canary logprobs at weight step `step`, None until written."""
    try:
        data = json.loads(trainer_scores_file(output_dir, step).read_text())
    except (OSError, ValueError):
        return None
    return data.get("logprobs") if isinstance(data, dict) and data.get("step") == step else None


def sampled_file(output_dir: Path, step: int, rank: int) -> Path:
    return parity_dir(output_dir) / f"sampled_step_{step}_rank_{rank}.json"


def write_sampled(output_dir: Path, step: int, rank: int, entries: list[list[float]]) -> None:
    atomic_write_json(sampled_file(output_dir, step, rank), {"step": step, "entries": entries})


def read_sampled(output_dir: Path, step: int, ranks: int) -> list[list[float]] | None:
    """Every trainer rank's sampled-token entries of step `step`, None until all `ranks` wrote theirs."""
    entries = []
    for rank in range(ranks):
        try:
            data = json.loads(sampled_file(output_dir, step, rank).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("step") != step or not isinstance(data.get("entries"), list):
            return None
        entries += data["entries"]
    return entries


def clear_sampled(output_dir: Path, step: int, ranks: int) -> None:
    for rank in range(ranks):
        sampled_file(output_dir, step, rank).unlink(missing_ok=True)


def clear_parity(output_dir: Path) -> None:
    """A fresh run's canaries and scores are its own (an earlier run's would be compared with other weights)."""
    root = parity_dir(output_dir)
    for path in root.glob("*.json") if root.is_dir() else ():
        path.unlink(missing_ok=True)
