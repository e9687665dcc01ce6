"""Leading tokens that several samples of a row hold alike, computed once (`TrainingConfig.share_prompts`).

An RL step trains every prompt's group of completions, and a chat data set's samples open with one system
prompt: in a packed row each sample carries its copy, and the forward and backward compute it again for every
sample. `share_prompts` lays such a row out again before its forward, as a prefix tree of the samples'
prompts: each start that several samples hold alike once, then each sample's own tokens, which attend to the
keys and values of every start above them as well as their own (the attention kernel's prefix keys,
trainer/attention.py). For a group of two samples p0 p1 p2 a0 and p0 p1 p2 b0 b1 (loss from a0 / b0 on):

    row            p0 p1 p2 a0 | p0 p1 p2 b0 b1
    shared row     p0 p1 | p2 a0 | p2 b0 b1       keys of p2 a0: p0 p1 p2 a0; of p2 b0 b1: p0 p1 p2 b0 b1

and where two groups open with one system prompt s0 s1 (prompts s0 s1 p0 p1 and s0 s1 q0), the tree has two
levels: s0 s1 once, then p0 (the p-group's start) and each sample's own tokens below them.

A sample keeps its last prompt token (p2): its logits predict the sample's first loss token, and the loss reads
position t's logprob from the logits at t − 1 of the same sample. Positions keep their values (p2 is at 2
everywhere), so every token sees the same keys at the same positions as in the original row: the logprobs are
the same up to float summation order, and the loss and its gradient with them (tests/unit/trainer/
test_prefix.py). Only positions the loss never reads are computed once: those before each sample's first loss
position (protocol/packing.py `shareable_prompt`; the packer counts a row's tokens by the same tree).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from prime_rl.protocol.packing import shareable_prompt
from prime_rl.trainer.logprobs import PolicyOutput, forward_logprobs, kept_at
from prime_rl.trainer.micro_batch import MicroBatch


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
    """`mb` with the leading tokens that several of its samples hold alike computed once; None where none do.
    `where` (bool [1, L]) marks the positions whose logprobs are wanted (the loss mask)."""
    cu = mb.cu_seqlens.tolist()
    wanted = where[0].tolist()
    ids = mb.input_ids[0].tolist()
    samples = range(len(cu) - 1)
    spans = _tree([shareable_prompt(ids[cu[s] : cu[s + 1]], wanted[cu[s] : cu[s + 1]]) for s in samples],
                  [cu[s + 1] - cu[s] for s in samples])  # fmt: skip
    if len(spans) == len(samples):  # every sample whole: nothing is shared
        return None
    index = torch.cat([torch.arange(cu[s] + a, cu[s] + b) for s, a, b, _ in spans])
    lengths = [b - a for _, a, b, _ in spans]
    cu_q = _offsets(lengths)
    starts = cu_q[:-1].tolist()
    kv = []
    for i, (*_, parent) in enumerate(spans):
        chain = [i]
        while parent >= 0:
            chain.append(parent)
            parent = spans[parent][3]
        kv.append(torch.cat([torch.arange(starts[j], starts[j] + lengths[j]) for j in reversed(chain)]))
    return SharedRow(
        mb=_take(mb, index, cu_q, [s for s, *_ in spans]),
        where=where[:, index.to(where.device)],
        index=index,
        kv_index=torch.cat(kv),
        cu_seqlens_k=_offsets([len(k) for k in kv]),
    )


def _tree(prompts: list[tuple[int, ...]], lengths: list[int]) -> list[tuple[int, int, int, int]]:
    """The spans of the shared row, parents first, each (sample, start, end, parent span or -1): a start that
    several samples' prompts hold alike once (the sample's tokens [start, end) stand for all of them), then each
    sample's tokens past the starts it shares, [start, its length). With no start held twice: every sample whole,
    (s, 0, length, -1)."""
    spans: list[tuple[int, int, int, int]] = []
    # Depth first, each branch's subtree before its next sibling: (samples holding the same first `depth`
    # tokens, depth, parent span, end of their common start or None: to be split by their next token).
    todo: list[tuple[list[int], int, int, int | None]] = [(list(range(len(prompts))), 0, -1, None)]
    while todo:
        members, depth, parent, end = todo.pop()
        if end is not None:  # a start several samples hold: once, then what lies below it
            spans.append((members[0], depth, end, parent))
            todo.append((members, end, len(spans) - 1, None))
            continue
        if len(members) == 1:
            spans.append((members[0], depth, lengths[members[0]], parent))
            continue
        branches: dict[int | None, list[int]] = {}  # by the next prompt token (None: the prompt ends here)
        for m in members:
            branches.setdefault(prompts[m][depth] if len(prompts[m]) > depth else None, []).append(m)
        work = []
        for token, branch in branches.items():
            if token is None or len(branch) == 1:
                work += [([m], depth, parent, None) for m in branch]
                continue
            first, end = prompts[branch[0]], depth + 1
            while all(len(prompts[m]) > end and prompts[m][end] == first[end] for m in branch):
                end += 1
            work.append((branch, depth, parent, end))
        todo.extend(reversed(work))
    return spans


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
