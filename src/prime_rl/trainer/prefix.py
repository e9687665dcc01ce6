"""A prompt that several samples of a row share, computed once (`TrainingConfig.share_prompts`).

An RL step trains every prompt's group of completions: in a packed row each sample carries its copy of the
prompt, and the forward and backward compute it again for every completion. `share_prompts` lays such a row out
again before its forward: each group's prompt once, then each member's own tokens, which attend to the prompt's
keys and values as well as their own (the attention kernel's prefix keys, trainer/attention.py). For a group of
two samples p0 p1 p2 a0 and p0 p1 p2 b0 b1 (loss from a0 / b0 on):

    row            p0 p1 p2 a0 | p0 p1 p2 b0 b1
    shared row     p0 p1 | p2 a0 | p2 b0 b1       keys of p2 a0: p0 p1 p2 a0; of p2 b0 b1: p0 p1 p2 b0 b1

A member keeps its last prompt token (p2): its logits predict the member's first loss token, and the loss reads
position t's logprob from the logits at t − 1 of the same sample. Positions keep their values (p2 is at 2
everywhere), so every token sees the same keys at the same positions as in the original row: the logprobs are
the same up to float summation order, and the loss and its gradient with them (tests/unit/trainer/
test_prefix.py). Only positions the loss never reads are computed once: a prompt is shared when every member
holds the same tokens before its first loss position (protocol/packing.py `shareable_prompt`, the rule by which
the packer puts a prompt's samples in one row).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from prime_rl.protocol.packing import shareable_prompt
from prime_rl.protocol.records import MicroBatch
from prime_rl.trainer.logprobs import PolicyOutput, forward_logprobs, kept_at


@dataclass(frozen=True)
class SharedRow:
    mb: MicroBatch  # the row laid out again; its cu_seqlens are the queries' boundaries
    where: torch.Tensor  # bool [1, L']: the positions to compute, as `where` of the original row
    index: torch.Tensor  # long [L']: the original row's position of each of its positions
    kv_index: torch.Tensor  # long [Lk]: per sample, the positions whose keys/values it attends to, in order
    cu_seqlens_k: torch.Tensor  # int32 [k + 1]: the samples' boundaries in kv_index

    def attention_kwargs(self, device: torch.device) -> dict[str, torch.Tensor | int]:
        """What the packed forward passes the attention function (trainer/attention.py `packed_attention`)."""
        return {
            "kv_index": self.kv_index.to(device),
            "cu_seq_lens_k": self.cu_seqlens_k.to(device),
            "max_length_k": int(self.cu_seqlens_k.diff().max()),
        }

    def expand(self, out: PolicyOutput, length: int) -> PolicyOutput:
        """`out` of the shared row back at the original row's positions (0 at the shared prompts' copies, which
        `where` leaves out anyway)."""
        index = self.index.to(out.logprobs.device)[None]

        def back(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros((1, length), dtype=t.dtype, device=t.device).scatter(1, index, t)

        return PolicyOutput(logprobs=back(out.logprobs), entropy=back(out.entropy))


def shared_row(mb: MicroBatch, where: torch.Tensor) -> SharedRow | None:
    """`mb` with each prompt that several of its samples share computed once; None where none shares one.
    `where` (bool [1, L]) marks the positions whose logprobs are wanted (the loss mask)."""
    cu = mb.cu_seqlens.tolist()
    wanted = where[0].tolist()
    ids = mb.input_ids[0].tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    for s in range(len(cu) - 1):
        if prompt := shareable_prompt(ids[cu[s] : cu[s + 1]], wanted[cu[s] : cu[s + 1]]):
            groups.setdefault(prompt, []).append(s)
    shared = {members[0]: (len(prompt), members) for prompt, members in groups.items() if len(members) > 1}
    if not shared:
        return None
    members_of = {m for _, members in shared.values() for m in members}
    spans: list[tuple[int, int]] = []  # (start, end) in the original row, one per sample of the new row
    prefix: list[int] = []  # per sample of the new row: the new-row sample whose positions it attends to first
    source: list[int] = []  # per sample of the new row: the original sample it holds tokens of

    def add(start: int, end: int, of: int, first: int = -1) -> None:
        spans.append((start, end))
        prefix.append(first)
        source.append(of)

    for s in range(len(cu) - 1):
        if s in shared:
            length, members = shared[s]
            prompt = len(spans)
            add(cu[s], cu[s] + length, s)
            for m in members:
                add(cu[m] + length, cu[m + 1], m, prompt)
        elif s not in members_of:
            add(cu[s], cu[s + 1], s)
    index = torch.cat([torch.arange(a, b) for a, b in spans])
    lengths = [b - a for a, b in spans]
    cu_q = _offsets(lengths)
    starts = cu_q[:-1].tolist()
    kv = []
    for i, p in enumerate(prefix):
        own = torch.arange(starts[i], starts[i] + lengths[i])
        kv.append(own if p < 0 else torch.cat([torch.arange(starts[p], starts[p] + lengths[p]), own]))
    return SharedRow(
        mb=_take(mb, index, cu_q, source),
        where=where[:, index.to(where.device)],
        index=index,
        kv_index=torch.cat(kv),
        cu_seqlens_k=_offsets([len(k) for k in kv]),
    )


def _offsets(lengths: list[int]) -> torch.Tensor:
    """int32 [n + 1]: the boundaries of consecutive spans of `lengths`."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return cu


def _take(mb: MicroBatch, index: torch.Tensor, cu_seqlens: torch.Tensor, source: list[int]) -> MicroBatch:
    """The micro batch of the original row's positions `index`, in that order, as the samples `cu_seqlens`, each
    holding tokens of the original sample `source` gives (its env)."""
    per_token = {
        name: getattr(mb, name)[:, index]
        for name in ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs")
    }
    for name in ("policy_steps", "token_server"):
        if getattr(mb, name).numel():
            per_token[name] = getattr(mb, name)[:, index]
    if mb.has_kept_sets:
        offsets, ids = kept_at(mb, index)
        per_token |= {"kept_offsets": offsets, "kept_ids": ids.to(torch.int32)}
    sample_env = mb.sample_env[source] if mb.sample_env.numel() else mb.sample_env
    return replace(mb, cu_seqlens=cu_seqlens, sample_env=sample_env, **per_token)


def shares_prompts(model: torch.nn.Module, device: torch.device) -> bool:
    """Whether rows of `model` get their shared prompts computed once: where the attention is ours
    (`packed_attention`: transformers' flash-attention path knows no prefix keys) and on the CPU, whose kernel
    takes prefix keys at full speed. (On CUDA, torch's varlen flash attention takes them the same way, causal
    from the bottom right; not measured there yet, so rows stay as they are.)"""
    return device.type == "cpu" and model.config._attn_implementation == "packed_attention"


def policy_output(
    model: torch.nn.Module,
    mb: MicroBatch,
    device: torch.device,
    where: torch.Tensor,
    entropy_grad: bool,
    shared: SharedRow | None,
) -> PolicyOutput:
    """`forward_logprobs(model, mb, device, entropy_grad, where)`, computed on `shared` (`shared_row(mb, where)`)
    where given: each prompt that several samples of the row share computed once."""
    if shared is None:
        return forward_logprobs(model, mb, device, entropy_grad, where=where)
    keys = shared.attention_kwargs(device)
    return shared.expand(forward_logprobs(model, shared.mb, device, entropy_grad, shared.where, keys), mb.num_tokens)
