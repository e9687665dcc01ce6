"""The rank-file record: what the orchestrator hands trainer rank r for step n (docs/design.md §2).

`rollouts/step_{n}/rank_{r}.safetensors` holds the rank's micro batches: tensors `"{i}.{field}"` for row i, and in
its metadata `version` (RANK_FILE_VERSION), `step`, `rank` and `rows` (per row its temperature and env names, JSON).
Safetensors, not pickle: reading a rank file runs no code, and the orchestrator writes it with numpy alone (no
torch: ~2 s and ~600 MB less at its start). Each micro batch is one packed row (batch dim 1): `Sample`s (one
training sequence each, the record both sides build: rollouts, SFT rows, canaries, fake data) laid end to end by
`PackedRow.pack`, positions restarting at 0, `cu_seqlens` marking the boundaries; the trainer trains on it as
torch tensors (trainer/micro_batch.py). For two samples of lengths 3 and 2:

    input_ids    [[a0 a1 a2 b0 b1]]
    position_ids [[0  1  2  0  1 ]]
    cu_seqlens   [0, 3, 5]
    loss_mask    [[F  T  T  F  T ]]     # generated tokens only

Optional per-sample and per-token extras (empty when unused):
    env_names    ["math", "code"]       # the step's environment labels, the same list in every row
    sample_env   [1, 0]                 # int32 [k]: index into env_names per sample (-1: none, e.g. padding)
    kept_offsets [0 0 0 2 2 2]          # int64 [L+1] with kept_ids (int32): CSR of the sampling mask, the
    kept_ids     [7 9]                  # token ids the sampler could draw at each position (top-p/top-k);
                                        # an empty range (here all but position 2) = the full vocabulary
    policy_steps [[-1 3 4 -1 3]]        # int32 [1, L]: the weight step that sampled each generated token
                                        # (protocol/spans.py), -1 where no policy did (prompt, env replies)
    token_server [[-1 0 0 -1 1]]        # int32 [1, L]: the server that sampled each generated token, an index
                                        # into the orchestrator's client.base_url list, -1 where none did
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save as save_arrays

from prime_rl.protocol.files import atomic_write_bytes, unreadable
from prime_rl.protocol.paths import rank_file

RANK_FILE_VERSION = 5
# The per-token fields of a row, [1, L] each, and their dtypes.
PER_TOKEN = {
    "input_ids": np.int64,
    "position_ids": np.int64,
    "loss_mask": np.bool_,
    "advantages": np.float32,
    "inference_logprobs": np.float32,
}


@dataclass(frozen=True, slots=True)
class Sample:
    """One training sequence, before packing: what the orchestrator makes of a rollout (orchestrator/packing.py
    `rollout_sample`), SFT of a data row, the trainer of a canary or of fake data. Every per-token list has one
    entry per token of `input_ids`, checked here, once.

    `loss_mask` marks the tokens the loss trains on (the sampled completion tokens); `advantages` and
    `inference_logprobs` (μ, the sampler's logprob) are per token, None = 0.0 on each (SFT, canaries, padding);
    `env` indexes the step's env names (-1: none); `kept` per token the ids the sampler could draw (top-p/top-k,
    [] = the full vocabulary), None: sampled without a filter; `policy_steps` / `servers` per token the weight
    step / the server (its index in client.base_url) that sampled it, -1 where none did, None: unknown."""

    input_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float] | None = None
    inference_logprobs: list[float] | None = None
    env: int = -1
    kept: list[list[int]] | None = None
    policy_steps: list[int] | None = None
    servers: list[int] | None = None

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        for name in ("loss_mask", "advantages", "inference_logprobs", "kept", "policy_steps", "servers"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                label = {"loss_mask": "loss mask entries", "kept": "kept sets"}.get(name, name.replace("_", " "))
                raise ValueError(f"{len(values)} {label} for {n} tokens")

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def masked(self) -> Sample:
        """The sample with no advantage, logprob or kept set where `loss_mask` is False (prompt, env replies and
        the tokens of a rollout the step does not train on); a record is built whole, so this is a new one."""
        mask = self.loss_mask
        return replace(
            self,
            advantages=None if self.advantages is None else _where(mask, self.advantages, 0.0),
            inference_logprobs=None if self.inference_logprobs is None else _where(mask, self.inference_logprobs, 0.0),
            kept=None if self.kept is None else _where(mask, self.kept, []),
        )


def _where(mask: list[bool], values: list, off) -> list:
    return [v if m else off for v, m in zip(values, mask, strict=True)]


def _empty(dtype) -> np.ndarray:
    return np.zeros(0, dtype=dtype)


@dataclass(frozen=True)
class PackedRow:
    """One packed row of a rank file (module docstring), as numpy arrays: what the orchestrator writes, what the
    trainer reads (and trains on as `MicroBatch`, trainer/micro_batch.py)."""

    input_ids: np.ndarray  # int64 [1, L]
    position_ids: np.ndarray  # int64 [1, L]
    cu_seqlens: np.ndarray  # int32 [k+1]
    loss_mask: np.ndarray  # bool [1, L]
    advantages: np.ndarray  # float32 [1, L]
    inference_logprobs: np.ndarray  # float32 [1, L]
    temperature: float
    env_names: list[str] = field(default_factory=list)
    sample_env: np.ndarray = field(default_factory=lambda: _empty(np.int32))  # int32 [k] or [0]
    kept_offsets: np.ndarray = field(default_factory=lambda: _empty(np.int64))  # int64 [L+1] or [0]
    kept_ids: np.ndarray = field(default_factory=lambda: _empty(np.int32))  # int32 [M]
    policy_steps: np.ndarray = field(default_factory=lambda: _empty(np.int32))  # int32 [1, L] or [0]
    token_server: np.ndarray = field(default_factory=lambda: _empty(np.int32))  # int32 [1, L] or [0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def arrays(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("temperature", "env_names")}

    def validate(self) -> None:
        length = self.input_ids.shape[-1]
        for name, dtype in PER_TOKEN.items():
            a = getattr(self, name)
            if a.dtype != dtype or a.shape != (1, length):
                raise ValueError(f"micro batch field {name}: expected {np.dtype(dtype)} [1, {length}], got {_kind(a)}")
        cu = self.cu_seqlens
        if cu.dtype != np.int32 or cu.ndim != 1 or len(cu) < 1 or cu[0] != 0 or cu[-1] != length:
            raise ValueError(f"micro batch cu_seqlens must be int32 from 0 to {length}, got {cu.tolist()}")
        samples = len(cu) - 1
        env = self.sample_env
        if env.size and (env.dtype != np.int32 or env.shape != (samples,)):
            raise ValueError(f"micro batch sample_env: expected int32 [{samples}], got {_kind(env)}")
        if env.size and (int(env.min()) < -1 or int(env.max()) >= len(self.env_names)):
            raise ValueError(f"micro batch sample_env indexes {len(self.env_names)} env names: {env.tolist()}")
        for name in ("policy_steps", "token_server"):
            a = getattr(self, name)
            if a.size and (a.dtype != np.int32 or a.shape != (1, length)):
                raise ValueError(f"micro batch {name}: expected int32 [1, {length}], got {_kind(a)}")
        off, ids = self.kept_offsets, self.kept_ids
        if off.size:
            if off.dtype != np.int64 or off.shape != (length + 1,) or off[0] != 0 or off[-1] != ids.size:
                raise ValueError(f"micro batch kept_offsets must be int64 [{length + 1}] from 0 to {ids.size}")
            if bool((np.diff(off) < 0).any()) or ids.dtype != np.int32:
                raise ValueError("micro batch kept_offsets must not decrease and kept_ids must be int32")

    @classmethod
    def pack(cls, samples: list[Sample], temperature: float, env_names: list[str] = ()) -> PackedRow:
        """Lay `samples` end to end in one row (`env_names`: the labels their `env` indexes, given to pack_rows).

        A sample without advantages or logprobs gets 0.0 on each token; one without policy steps or servers, -1,
        when another sample of the row has them; one without kept sets, the full vocabulary on each token."""
        lengths = [s.num_tokens for s in samples]
        cu = np.zeros(len(samples) + 1, dtype=np.int32)
        cu[1:] = np.cumsum(lengths, dtype=np.int32)
        return cls(
            input_ids=_row(samples, "input_ids", np.int64, 0),
            position_ids=np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])[None],
            cu_seqlens=cu,
            loss_mask=_row(samples, "loss_mask", np.bool_, False),
            advantages=_row(samples, "advantages", np.float32, 0.0),
            inference_logprobs=_row(samples, "inference_logprobs", np.float32, 0.0),
            temperature=float(temperature),
            env_names=list(env_names),
            sample_env=np.array([s.env for s in samples], dtype=np.int32) if env_names else _empty(np.int32),
            policy_steps=_per_token(samples, "policy_steps"),
            token_server=_per_token(samples, "servers"),
            **_kept_csr(samples, int(cu[-1])),
        )

    @classmethod
    def padding(cls, length: int, temperature: float, pad_id: int = 0, env_names: list[str] = ()) -> PackedRow:
        """An all-masked row that keeps FSDP collectives in lockstep on ranks with less data."""
        return cls.pack([Sample([pad_id] * length, [False] * length)], temperature, env_names)


def _kind(a: np.ndarray) -> str:
    return f"{a.dtype} {list(a.shape)}"


def _row(samples: list[Sample], name: str, dtype, missing: float) -> np.ndarray:
    """The samples' per-token `name` laid end to end as a [1, L] row; `missing` on each token of a sample without
    it (advantages and logprobs of SFT, canary and padding samples)."""

    def part(s: Sample) -> np.ndarray:
        values = getattr(s, name)
        if values is None:
            return np.full(s.num_tokens, missing, dtype=dtype)
        return np.asarray(values, dtype=dtype)

    return np.concatenate([part(s) for s in samples])[None]


def _per_token(samples: list[Sample], name: str) -> np.ndarray:
    """The samples' per-token ints `name` (policy steps, servers) in one row, -1 for a sample without them;
    empty when no sample has them."""
    if all(getattr(s, name) is None for s in samples):
        return _empty(np.int32)
    return _row(samples, name, np.int32, -1)


def _kept_csr(samples: list[Sample], length: int) -> dict[str, np.ndarray]:
    """The samples' kept sets laid end to end as CSR (`kept_offsets`, `kept_ids`); none when no sample has one."""
    if not any(s.kept for s in samples):
        return {}
    sizes, ids = [], []
    for s in samples:
        for k in s.kept or [()] * s.num_tokens:
            sizes.append(len(k))
            ids.extend(k)
    offsets = np.zeros(length + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(sizes, dtype=np.int64)
    return {"kept_offsets": offsets, "kept_ids": np.asarray(ids, dtype=np.int32)}


def write_rank_file(output_dir: Path, step: int, rank: int, rows: list[PackedRow]) -> Path:
    arrays = {f"{i}.{name}": a for i, row in enumerate(rows) for name, a in row.arrays().items()}
    meta = [{"temperature": row.temperature, "env_names": row.env_names} for row in rows]
    header = {"version": str(RANK_FILE_VERSION), "step": str(step), "rank": str(rank), "rows": json.dumps(meta)}
    return atomic_write_bytes(rank_file(output_dir, step, rank), save_arrays(arrays, metadata=header))


def read_rank_file(path: Path, step: int, rank: int) -> list[PackedRow]:
    """The rows of a rank file; any problem is a ValueError whose message starts with the file."""
    try:
        with safe_open(path, framework="np") as f:
            header = f.metadata() or {}
            arrays = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, SafetensorError, ValueError) as e:
        raise ValueError(unreadable(path, "rank file", e)) from None
    if header.get("version") != str(RANK_FILE_VERSION):
        raise ValueError(f"{path}: rank file version {header.get('version')}, expected {RANK_FILE_VERSION}")
    if header.get("step") != str(step) or header.get("rank") != str(rank):
        raise ValueError(f"{path}: holds step {header.get('step')} rank {header.get('rank')}, expected {step}/{rank}")
    try:
        per_row: dict[str, dict[str, np.ndarray]] = {}
        for name, a in arrays.items():  # "{i}.{field}"
            i, key = name.split(".", 1)
            per_row.setdefault(i, {})[key] = a
        rows = []
        for i, meta in enumerate(json.loads(header["rows"])):
            mine = per_row.get(str(i), {})
            row = PackedRow(**mine, temperature=float(meta["temperature"]), env_names=list(meta["env_names"]))
            row.validate()
            rows.append(row)
        return rows
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ValueError(f"{path}: malformed rank file: {type(e).__name__}: {e}") from None
