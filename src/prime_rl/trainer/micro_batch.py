"""The trainer's micro batch: one packed row (protocol/records.py `PackedRow`, whose docstring shows the layout) as
torch tensors, what the forward, the losses and the shared-prompt rows (prefix.py) take."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from prime_rl.protocol.records import PackedRow, Sample


def _empty(dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(0, dtype=dtype)


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
    sample_env: torch.Tensor = field(default_factory=lambda: _empty(torch.int32))  # int32 [k] or [0]
    kept_offsets: torch.Tensor = field(default_factory=lambda: _empty(torch.int64))  # int64 [L+1] or [0]
    kept_ids: torch.Tensor = field(default_factory=lambda: _empty(torch.int32))  # int32 [M]
    policy_steps: torch.Tensor = field(default_factory=lambda: _empty(torch.int32))  # int32 [1, L] or [0]
    token_server: torch.Tensor = field(default_factory=lambda: _empty(torch.int32))  # int32 [1, L] or [0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def has_kept_sets(self) -> bool:
        """Whether any position was sampled from a filtered (top-p/top-k) set."""
        return self.kept_ids.numel() > 0

    @classmethod
    def from_row(cls, row: PackedRow) -> MicroBatch:
        """`row`'s arrays as tensors (sharing their memory)."""
        values = {f.name: getattr(row, f.name) for f in fields(row)}
        return cls(**{k: torch.from_numpy(v) if hasattr(v, "dtype") else v for k, v in values.items()})

    def to_row(self) -> PackedRow:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return PackedRow(**{k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in values.items()})

    def validate(self) -> None:
        """`PackedRow.validate`: the rows the trainer lays out itself (prefix.py) keep the rank file's rules."""
        self.to_row().validate()

    @classmethod
    def pack(cls, samples: list[Sample], temperature: float, env_names: list[str] = ()) -> MicroBatch:
        """`PackedRow.pack` as tensors: the trainer's own rows (canaries, SFT, fake data) and the tests'."""
        return cls.from_row(PackedRow.pack(samples, temperature, env_names))

    @classmethod
    def padding(cls, length: int, temperature: float, pad_id: int = 0, env_names: list[str] = ()) -> MicroBatch:
        return cls.from_row(PackedRow.padding(length, temperature, pad_id, env_names))
