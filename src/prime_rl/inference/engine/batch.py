"""The running batch of the engine: its rows and their KV cache, behind one small interface.

    join(requests, rows) -> logits   prefill newly admitted requests (each once, n rows each), append rows
    step() -> logits                 one decode step for every row, fed each row's last token
    keep(indices)                    keep only those rows (they may be reordered: `rows` says the new order)
    recompute()                      rebuild every row's cache under the current weights (after a swap)

`NativeBatch` runs the engine's own Llama-family forward over a slot cache (native.py); `TransformersBatch`
runs any HF causal LM through its generic forward and `DynamicCache`, left-padding rows to one length.
"""

from __future__ import annotations

from typing import Any

import torch

from prime_rl.inference.engine.native import NativeDecoder


def _source(requests: list[Any]) -> list[int]:
    """Index of the request each new row belongs to: a request of n samples is prefilled once, used n times."""
    return [i for i, r in enumerate(requests) for _ in range(r.params.n)]


class NativeBatch:
    def __init__(self, decoder: NativeDecoder):
        self.decoder = decoder
        self.device = decoder.device
        self.rows: list[Any] = []

    def join(self, requests: list[Any], rows: list[Any]) -> torch.Tensor:
        start = len(self.rows)
        slots = torch.arange(start, start + len(rows), device=self.device)
        source = torch.tensor(_source(requests), device=self.device)
        logits = self.decoder.prefill([r.prompt_ids for r in requests], slots, source)
        self.rows += rows
        return logits

    def recompute(self) -> None:
        """Prefill each row's context (`Row.context`) again into its own slot."""
        slots = torch.arange(len(self.rows), device=self.device)
        self.decoder.prefill([row.context() for row in self.rows], slots, slots)

    def step(self) -> torch.Tensor:
        return self.decoder.decode(torch.tensor([row.token_ids[-1] for row in self.rows], device=self.device))

    def keep(self, keep: list[int]) -> None:
        """Rows past the new size fill the holes below it, so only the rows that move are copied."""
        size, kept = len(keep), set(keep)
        holes = [b for b in range(size) if b not in kept]
        movers = [b for b in keep if b >= size]
        self.decoder.move(movers, holes)
        for hole, mover in zip(holes, movers, strict=True):
            self.rows[hole] = self.rows[mover]
        del self.rows[size:]


class TransformersBatch:
    """Rows share one `DynamicCache`: `mask` [B, L] marks real cache columns (left padding is 0), `next_pos`
    [B] is each row's next position id. Invariant: the cache holds exactly L columns."""

    def __init__(self, model: torch.nn.Module, device: torch.device, pad_id: int):
        self.model, self.device, self.pad_id = model, device, pad_id
        self.rows: list[Any] = []
        self.cache: Any = None
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=device)
        self.next_pos = torch.zeros(0, dtype=torch.long, device=device)

    def join(self, requests: list[Any], rows: list[Any]) -> torch.Tensor:
        logits, cache, mask = self._prefill([r.prompt_ids for r in requests], _source(requests))
        self._add(rows, cache, mask, mask.sum(-1))
        return logits

    def recompute(self) -> None:
        """Prefill every row's context (`Row.context`) again, as one new left-padded cache."""
        rows = self.rows
        _, self.cache, self.mask = self._prefill([row.context() for row in rows], list(range(len(rows))))
        self.next_pos = self.mask.sum(-1)

    def _prefill(self, prompts: list[list[int]], source: list[int]) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """Run the left-padded `prompts` once; (last logits, cache, mask) with row i from prompt `source[i]`."""
        from transformers import DynamicCache

        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, prompt in enumerate(prompts):
            input_ids[b, width - len(prompt) :] = torch.tensor(prompt)
            mask[b, width - len(prompt) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        cache = DynamicCache()
        logits = self._forward(input_ids, mask, left_padded_positions(mask), cache)
        index = torch.tensor(source, device=self.device)
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        return logits[index], cache, mask[index]

    def step(self) -> torch.Tensor:
        next_ids = torch.tensor([row.token_ids[-1] for row in self.rows], device=self.device)[:, None]
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        logits = self._forward(next_ids, self.mask, self.next_pos[:, None], self.cache)
        self.next_pos = self.next_pos + 1
        return logits

    def keep(self, keep: list[int]) -> None:
        """Keep only the rows at `keep`, then drop cache columns that are padding in every remaining row."""
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[b] for b in keep]
        if not self.rows:
            self.cache, self.mask, self.next_pos = None, self.mask[:0, :0], self.next_pos[:0]
            return
        index = torch.tensor(keep, device=self.device)
        self.mask, self.next_pos = self.mask[index], self.next_pos[index]
        first = int(self.mask.any(dim=0).int().argmax())
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[index, :, first:], layer.values[index, :, first:]
        self.mask = self.mask[:, first:]

    def _add(self, rows: list[Any], cache: Any, mask: torch.Tensor, next_pos: torch.Tensor) -> None:
        """Append rows whose prefilled cache is `cache`; the shorter of the two caches is left-padded."""
        if not self.rows:
            self.rows, self.cache, self.mask, self.next_pos = list(rows), cache, mask, next_pos
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for old, new in zip(self.cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_pad_left(old.keys, width, -2), _pad_left(new.keys, width, -2)])
            old.values = torch.cat([_pad_left(old.values, width, -2), _pad_left(new.values, width, -2)])
        self.mask = torch.cat([_pad_left(self.mask, width, -1), _pad_left(mask, width, -1)])
        self.next_pos = torch.cat([self.next_pos, next_pos])
        self.rows += rows

    def _forward(self, input_ids, mask, positions, cache) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def left_padded_positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on each row's first real token (pads get 1, they are masked anyway).

    mask [[0, 0, 1, 1], [1, 1, 1, 1]] -> [[1, 1, 0, 1], [0, 1, 2, 3]]
    """
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
