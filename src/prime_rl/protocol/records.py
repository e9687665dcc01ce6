"""The rank-file record: what the orchestrator hands trainer rank r for step n (docs/design.md §2).

`rollouts/step_{n}/rank_{r}.pt` is a `torch.save`d dict
`{"version": RANK_FILE_VERSION, "step": n, "rank": r, "micro_batches": [MicroBatch.to_dict(), ...]}`.
Each micro batch is one packed row (batch dim 1): `Sample`s (one training sequence each, the record both
sides build: rollouts, SFT rows, canaries, fake data) laid end to end by `MicroBatch.pack`, positions restarting
at 0, `cu_seqlens` marking the boundaries. For two samples of lengths 3 and 2:

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

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from prime_rl.protocol.files import atomic_write, unreadable
from prime_rl.protocol.paths import rank_file

RANK_FILE_VERSION = 4


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


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # int64 [1, L]
    position_ids: torch.Tensor  # int64 [1, L]
    cu_seqlens: torch.Tensor  # int32 [k+1]
    loss_mask: torch.Tensor  # bool [1, L]
    advantages: torch.Tensor  # float32 [1, L]
    inference_logprobs: torch.Tensor  # float32 [1, L]
    temperature: float
    env_names: list[str] = field(default_factory=list)
    sample_env: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))  # int32 [k] or [0]
    kept_offsets: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # [L+1] or [0]
    kept_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))  # int32 [M]
    policy_steps: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))  # [1, L] or [0]
    token_server: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int32))  # [1, L] or [0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> MicroBatch:
        mb = cls(**d)
        mb.validate()
        return mb

    def validate(self) -> None:
        length = self.input_ids.shape[-1]
        expected = {
            "input_ids": torch.int64,
            "position_ids": torch.int64,
            "loss_mask": torch.bool,
            "advantages": torch.float32,
            "inference_logprobs": torch.float32,
        }
        for name, dtype in expected.items():
            t = getattr(self, name)
            if t.dtype != dtype or tuple(t.shape) != (1, length):
                got = f"{t.dtype} {list(t.shape)}"
                raise ValueError(f"micro batch field {name}: expected {dtype} [1, {length}], got {got}")
        cu = self.cu_seqlens
        if cu.dtype != torch.int32 or cu.ndim != 1 or cu[0] != 0 or cu[-1] != length:
            raise ValueError(f"micro batch cu_seqlens must be int32 from 0 to {length}, got {cu.tolist()}")
        samples = len(cu) - 1
        env = self.sample_env
        if env.numel() and (env.dtype != torch.int32 or tuple(env.shape) != (samples,)):
            raise ValueError(f"micro batch sample_env: expected int32 [{samples}], got {env.dtype} {list(env.shape)}")
        if env.numel() and (int(env.min()) < -1 or int(env.max()) >= len(self.env_names)):
            raise ValueError(f"micro batch sample_env indexes {len(self.env_names)} env names: {env.tolist()}")
        for name in ("policy_steps", "token_server"):
            t = getattr(self, name)
            if t.numel() and (t.dtype != torch.int32 or tuple(t.shape) != (1, length)):
                raise ValueError(f"micro batch {name}: expected int32 [1, {length}], got {t.dtype} {list(t.shape)}")
        off, ids = self.kept_offsets, self.kept_ids
        if off.numel():
            if off.dtype != torch.int64 or tuple(off.shape) != (length + 1,) or off[0] != 0 or off[-1] != ids.numel():
                raise ValueError(f"micro batch kept_offsets must be int64 [{length + 1}] from 0 to {ids.numel()}")
            if bool((off.diff() < 0).any()) or ids.dtype != torch.int32:
                raise ValueError("micro batch kept_offsets must not decrease and kept_ids must be int32")

    @property
    def has_kept_sets(self) -> bool:
        """Whether any position was sampled from a filtered (top-p/top-k) set."""
        return self.kept_ids.numel() > 0

    @classmethod
    def pack(cls, samples: list[Sample], temperature: float, env_names: list[str] = ()) -> MicroBatch:
        """Lay `samples` end to end in one row (`env_names`: the labels their `env` indexes, given to pack_rows).

        A sample without advantages or logprobs gets 0.0 on each token; one without policy steps or servers, -1,
        when another sample of the row has them; one without kept sets, the full vocabulary on each token."""
        lengths = [s.num_tokens for s in samples]
        cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
        return cls(
            input_ids=_row(samples, "input_ids", torch.int64, 0),
            position_ids=torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0),
            cu_seqlens=cu,
            loss_mask=_row(samples, "loss_mask", torch.bool, False),
            advantages=_row(samples, "advantages", torch.float32, 0.0),
            inference_logprobs=_row(samples, "inference_logprobs", torch.float32, 0.0),
            temperature=float(temperature),
            env_names=list(env_names),
            sample_env=torch.tensor([s.env for s in samples], dtype=torch.int32)
            if env_names
            else torch.zeros(0, dtype=torch.int32),
            policy_steps=_per_token(samples, "policy_steps"),
            token_server=_per_token(samples, "servers"),
            **_kept_csr(samples, int(cu[-1])),
        )

    @classmethod
    def padding(cls, length: int, temperature: float, pad_id: int = 0, env_names: list[str] = ()) -> MicroBatch:
        """An all-masked micro batch that keeps FSDP collectives in lockstep on ranks with less data."""
        return cls.pack([Sample([pad_id] * length, [False] * length)], temperature, env_names)


def _row(samples: list[Sample], name: str, dtype: torch.dtype, missing: float) -> torch.Tensor:
    """The samples' per-token `name` laid end to end as a [1, L] row; `missing` on each token of a sample without
    it (advantages and logprobs of SFT, canary and padding samples)."""

    def part(s: Sample) -> torch.Tensor:
        values = getattr(s, name)
        if values is None:
            return torch.full((s.num_tokens,), missing, dtype=dtype)
        return torch.as_tensor(values, dtype=dtype)

    return torch.cat([part(s) for s in samples]).unsqueeze(0)


def _per_token(samples: list[Sample], name: str) -> torch.Tensor:
    """The samples' per-token ints `name` (policy steps, servers) in one row, -1 for a sample without them;
    empty when no sample has them."""
    if all(getattr(s, name) is None for s in samples):
        return torch.zeros(0, dtype=torch.int32)
    return _row(samples, name, torch.int32, -1)


def _kept_csr(samples: list[Sample], length: int) -> dict[str, torch.Tensor]:
    """The samples' kept sets laid end to end as CSR (`kept_offsets`, `kept_ids`); none when no sample has one."""
    if not any(s.kept for s in samples):
        return {}
    sizes, ids = [], []
    for s in samples:
        for k in s.kept or [()] * s.num_tokens:
            sizes.append(len(k))
            ids.extend(k)
    offsets = torch.zeros(length + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(sizes, dtype=torch.int64).cumsum(0)
    return {"kept_offsets": offsets, "kept_ids": torch.tensor(ids, dtype=torch.int32)}


def write_rank_file(output_dir: Path, step: int, rank: int, micro_batches: list[MicroBatch]) -> Path:
    record = {
        "version": RANK_FILE_VERSION,
        "step": step,
        "rank": rank,
        "micro_batches": [mb.to_dict() for mb in micro_batches],
    }
    return atomic_write(rank_file(output_dir, step, rank), lambda f: torch.save(record, f))


def read_rank_file(path: Path, step: int, rank: int) -> list[MicroBatch]:
    """The micro batches of a rank file; any problem is a ValueError whose message starts with the file (a
    truncated one fails in torch.load as EOFError, RuntimeError, UnpicklingError or OSError [Errno 22])."""
    try:
        record = torch.load(path, weights_only=True)
    except Exception as e:
        raise ValueError(unreadable(path, "rank file", e)) from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}: not a rank file (a {type(record).__name__}, not a dict)")
    if record.get("version") != RANK_FILE_VERSION:
        raise ValueError(f"{path}: rank file version {record.get('version')}, expected {RANK_FILE_VERSION}")
    if record.get("step") != step or record.get("rank") != rank:
        raise ValueError(f"{path}: holds step {record.get('step')} rank {record.get('rank')}, expected {step}/{rank}")
    try:
        return [MicroBatch.from_dict(d) for d in record["micro_batches"]]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: malformed rank file: {type(e).__name__}: {e}") from None
