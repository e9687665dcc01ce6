"""Token logprobs of the policy, the one module every trainer path computes them with (RL loss, SFT loss,
tests against inference): the packed forward (`forward_logprobs`) and the log-softmax at the targets.

Position t of a row's result is log π(input_ids[t] | sample prefix) under softmax(logits / temperature):
the logits at t − 1 of the same sample predict token t, so a sample's first token has none (0).

Where the micro batch carries kept sets (`kept_offsets`/`kept_ids`: the tokens the sampler could draw after
top-k / top-p, docs/design.md §2), that position's softmax (and entropy) runs over its kept set only, the
distribution the token was drawn from and the server reported its logprob under.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import FunctionCtx

from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.micro_batch import MicroBatch


@dataclass
class PolicyOutput:
    logprobs: torch.Tensor  # [1, L], differentiable; position t = log π(input_ids[t] | sample prefix)
    entropy: torch.Tensor  # [1, L], detached unless asked for with entropy_grad


def forward_logits(
    model: torch.nn.Module,
    mb: MicroBatch,
    device: torch.device,
    keep: torch.Tensor | None = None,
    keys: dict | None = None,
) -> torch.Tensor:
    """Logits [1, L, V] of one packed row, every sample attending only to itself (and, with `keys`, to the
    prompt it shares: trainer/prefix.py `SharedRow.attention_kwargs`); with `keep` (positions, long [K]) only
    those rows, [1, K, V]: the lm_head then never runs on the rest."""
    vocab = model.get_input_embeddings().num_embeddings
    if bad := outside_vocab(mb.input_ids, vocab):  # else an index error on CPU, a device-side assert on CUDA
        raise TrainerError(
            f"token ids outside the model's vocabulary [0, {vocab}): {bad} (tokenized for another model?)"
        )
    cu = mb.cu_seqlens.to(device=device, dtype=torch.int32)
    longest = int(mb.cu_seqlens.diff().max())
    return model(
        input_ids=mb.input_ids.to(device),
        position_ids=mb.position_ids.to(device),
        use_cache=False,
        logits_to_keep=0 if keep is None else keep,  # 0 = every position
        cu_seq_lens_q=cu,
        max_length_q=longest,
        **(keys or {"cu_seq_lens_k": cu, "max_length_k": longest}),
    ).logits


def forward_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    device: torch.device,
    entropy_grad: bool = False,
    where: torch.Tensor | None = None,
    keys: dict | None = None,
) -> PolicyOutput:
    """Token logprobs and entropies of the policy on one packed micro batch.

    With `where` (bool [1, L], e.g. the loss mask) only those positions are computed and the rest are 0:
    the lm_head and the [L, V] log-softmax then skip the prompts, which the loss never reads. `keys`: the
    attention's shared-prompt keys of a row laid out by trainer/prefix.py.
    """
    ids = mb.input_ids.to(device)
    if where is None:
        logits = forward_logits(model, mb, device, keys=keys)
        kept = kept_at(mb, torch.arange(1, ids.shape[1]))
        logprobs, entropy = token_logprobs_and_entropy(logits, ids, mb.temperature, entropy_grad, kept)
        return PolicyOutput(logprobs=logprobs, entropy=entropy)
    # Token t is predicted by the logits at t − 1 of the same sample, so a sample's first token has none.
    targets = (where.to(device) & ~sample_starts(mb).to(device))[0].nonzero().squeeze(-1)
    logits = forward_logits(model, mb, device, keep=targets - 1, keys=keys)
    kept = kept_at(mb, targets.cpu())
    logprobs, entropy = target_logprobs_and_entropy(logits, ids[:, targets], mb.temperature, entropy_grad, kept=kept)
    index = targets[None]
    zeros = torch.zeros(ids.shape, dtype=logprobs.dtype, device=device)
    return PolicyOutput(logprobs=zeros.scatter(1, index, logprobs), entropy=zeros.scatter(1, index, entropy))


Kept = tuple[torch.Tensor, torch.Tensor]  # (offsets int64 [K+1] on the CPU, ids long [M]): CSR, [] = full vocab


def kept_at(mb: MicroBatch, positions: torch.Tensor) -> Kept | None:
    """The micro batch's kept sets at `positions` (long [K]) as their own CSR; None when it has none.

    Example: kept_offsets [0 0 2 2 3], kept_ids [7 9 4] (position 1: {7, 9}, position 3: {4}); positions
    [1, 2, 3] → offsets [0 2 2 3], ids [7 9 4].
    """
    if not mb.has_kept_sets:
        return None
    off = mb.kept_offsets
    starts, sizes = off[positions], off[positions + 1] - off[positions]
    offsets = torch.zeros(len(positions) + 1, dtype=torch.int64)
    offsets[1:] = sizes.cumsum(0)
    total = int(offsets[-1])
    index = torch.repeat_interleave(starts - offsets[:-1], sizes) + torch.arange(total)
    return offsets, mb.kept_ids[index].long()


def sample_starts(mb: MicroBatch) -> torch.Tensor:
    """Bool [1, L]: True at the first token of each packed sample (it has no prefix to be predicted from)."""
    starts = torch.zeros_like(mb.loss_mask)
    starts[0, mb.cu_seqlens[:-1].long()] = True
    return starts


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logprob of each token under softmax(logits / temperature), aligned with `input_ids`.

    `logits[:, t]` predicts `input_ids[:, t + 1]`, so position t of the result holds the logprob of
    `input_ids[:, t]` given the tokens before it; position 0 has no prediction and is 0.

    Example (vocab 2, temperature 1): input_ids [[0, 1, 0]], logits [[[0, 0], [ln 3, 0], [9, 9]]]
        position 1: softmax([0, 0])[1]    = 0.5  → log 0.5  = −0.693
        position 2: softmax([ln 3, 0])[0] = 0.75 → log 0.75 = −0.288
        result [[0, −0.693, −0.288]]   (the last logits row predicts beyond the row and is unused)
    """
    scaled = logits[:, :-1].float() / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    # gather − logsumexp is log_softmax at the target without materialising a second [L, V] tensor.
    logprobs = scaled.gather(-1, targets).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
    return torch.nn.functional.pad(logprobs, (1, 0), value=0.0)


def token_entropy(logits: torch.Tensor, temperature: float, grad: bool = False) -> torch.Tensor:
    """Entropy of the distribution that predicted each token, aligned like `token_logprobs` (position 0 = 0).

    Differentiable only with `grad=True` (an entropy bonus needs it; plain logging does not).
    Example: logits [[[0, 0], [ln 3, 0], ...]] → position 1: ln 2 = 0.693; position 2:
    −(0.75 ln 0.75 + 0.25 ln 0.25) = 0.562.
    """
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        scaled = logits[:, :-1].float() / temperature
        logp = torch.log_softmax(scaled, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        return torch.nn.functional.pad(entropy, (1, 0), value=0.0)


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float,
    entropy_grad: bool = False,
    kept: Kept | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and `token_entropy` in one chunked pass over the vocabulary (the trainer's hot path;
    those two are the plain references the tests hold it to, and the trainer itself no longer calls them).

    Same values as the two functions (see their examples): `target_logprobs_and_entropy` on the logits
    shifted against their next tokens, with position 0 (no prefix) set to 0; `kept` holds the sets of
    positions 1.. (kept_at(mb, arange(1, L))).
    """
    shifted = (logits[:, :-1], input_ids[:, 1:], temperature, entropy_grad)
    logprobs, entropy = target_logprobs_and_entropy(*shifted, kept=kept)
    pad = torch.nn.functional.pad
    return pad(logprobs, (1, 0), value=0.0), pad(entropy, (1, 0), value=0.0)


def target_logprobs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    entropy_grad: bool = False,
    chunk_rows: int | None = None,
    kept: Kept | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature) at `targets` [B, K] and the entropy, for logits [B, K, V] already
    aligned with their targets (no shift).

    Same values and gradients as log_softmax + gather + −Σ p log p, but the [K, V] work runs `chunk_rows`
    rows at a time (default: ~8 MiB of fp32 on CPU, ~256 MiB on a GPU) and nothing of size [K, V] is
    kept besides the logits themselves: forward and backward read the logits once each and the backward
    writes the gradient once, where autograd's log-softmax makes ~10 passes over [K, V] in memory and
    keeps a second [K, V] tensor (~30% of a CPU step at vocab 32k; 4% at 1k).

    With `kept` (CSR over the B·K rows, `kept_at`) a row with a kept set is scored under the softmax of its
    logits masked to that set: logits [2, 1, 0, −1] with set {0, 1} give log(.644 / .881) = −0.313 for token 0
    and entropy 0.582 (that of [.731, .269]); the gradient outside the set is 0. Rows without a set: as above.
    """
    # CPU: ~8 MiB of fp32 per chunk, so it stays in cache. CUDA: ~256 MiB, so a chunk is a few big kernels
    # (at vocab 152k, 8 MiB is 13 rows: thousands of chunks per row, the step bound by kernel launches).
    budget = 2**21 if logits.device.type == "cpu" else 2**26
    rows = chunk_rows or max(1, budget // logits.shape[-1])
    if kept is not None:
        kept = _checked(kept, targets, logits.shape[-1])
    logprobs, entropy = _TargetLogprobs.apply(logits, targets, temperature, entropy_grad, rows, kept)
    return logprobs, entropy if entropy_grad else entropy.detach()


class _TargetLogprobs(torch.autograd.Function):
    """(logits [B, K, V], targets [B, K]) → (logprobs [B, K], entropy [B, K]), chunked over the K rows.

    With z = logits / T, lse = logsumexp(z), p = softmax(z): logprob = z_target − lse, entropy = lse − Σ p z.
    Gradients: d logprob / dz = onehot(target) − p;  d entropy / dz = −p (z − lse + entropy).
    A row with a kept set masks z to −inf outside it, so p = 0 there; z is read as 0 there wherever it is
    multiplied by p (p · z would be 0 · −inf = NaN), which leaves the gradient outside the set exactly 0.
    Accumulates in fp32 (fp64 logits: in fp64).
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        logits: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        entropy_grad: bool,
        rows: int,
        kept: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        flat, index = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, 1)
        acc = torch.promote_types(logits.dtype, torch.float32)
        lse, target, entropy = (flat.new_empty(flat.shape[0], dtype=acc) for _ in range(3))
        for start in range(0, flat.shape[0], rows):
            chunk = slice(start, start + rows)
            z, z0 = _masked(_scaled(flat[chunk], temperature), kept, chunk)
            lse[chunk] = torch.logsumexp(z, -1)
            target[chunk] = z.gather(-1, index[chunk]).squeeze(-1)
            p = (z - lse[chunk, None]).exp_()
            entropy[chunk] = lse[chunk] - torch.linalg.vecdot(p, z0)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature, ctx.entropy_grad, ctx.rows, ctx.kept = temperature, entropy_grad, rows, kept
        return (target - lse).view(targets.shape), entropy.view(targets.shape)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor) -> tuple:
        logits, targets, lse, entropy = ctx.saved_tensors
        flat, index = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1, 1)
        g_lp = grad_logprobs.reshape(-1, 1).to(lse.dtype) / ctx.temperature  # dz/dlogits = 1 / T
        g_ent = grad_entropy.reshape(-1, 1).to(lse.dtype) / ctx.temperature if ctx.entropy_grad else None
        grad = torch.empty_like(flat)
        for start in range(0, flat.shape[0], ctx.rows):
            chunk = slice(start, start + ctx.rows)
            z, z0 = _masked(_scaled(flat[chunk], ctx.temperature), ctx.kept, chunk)
            p = (z - lse[chunk, None]).exp_()
            if g_ent is None:
                dz = p.mul_(-g_lp[chunk])
            else:  # −g_lp p − g_ent p (z − lse + entropy)
                shift = (entropy[chunk] - lse[chunk])[:, None]
                dz = p.mul_((z0 + shift).mul_(g_ent[chunk]).add_(g_lp[chunk])).neg_()
            dz.scatter_add_(-1, index[chunk], g_lp[chunk])
            grad[chunk] = dz
        return grad.view(logits.shape), None, None, None, None, None


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 (fp64: fp64) logits / temperature (the logits themselves at fp32 and T = 1: read, never written)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return z / temperature if temperature != 1.0 else z


def _masked(z: torch.Tensor, kept: Kept | None, chunk: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """(z with −inf outside each row's kept set, z with 0 there) for the chunk's rows; (z, z) without sets."""
    keep = _chunk_keep(kept, chunk, z.shape) if kept is not None else None
    if keep is None:
        return z, z
    return z.masked_fill(~keep, float("-inf")), z.masked_fill(~keep, 0.0)


def _chunk_keep(kept: Kept, chunk: slice, shape: torch.Size) -> torch.Tensor | None:
    """Bool [rows, V]: True on each row's kept set, everywhere on rows without one; None when no row has one."""
    offsets, ids = kept
    start, stop = chunk.start, min(chunk.stop, len(offsets) - 1)
    lo, hi = int(offsets[start]), int(offsets[stop])
    if lo == hi:
        return None
    sizes = offsets[start + 1 : stop + 1] - offsets[start:stop]
    rows = torch.repeat_interleave(torch.arange(stop - start), sizes).to(ids.device)
    keep = torch.zeros(shape, dtype=torch.bool, device=ids.device)
    keep[rows, ids[lo:hi]] = True
    keep[(sizes == 0).to(ids.device)] = True
    return keep


def outside_vocab(ids: torch.Tensor, vocab: int) -> list[int]:
    """The first few ids outside [0, vocab), [] when there are none."""
    if not ids.numel() or (int(ids.min()) >= 0 and int(ids.max()) < vocab):
        return []
    return ids[(ids < 0) | (ids >= vocab)][:5].tolist()


def _checked(kept: Kept, targets: torch.Tensor, vocab: int) -> Kept:
    """`kept` on the targets' device, refusing ids outside the vocabulary and targets outside their own set (the
    sampler can only draw from its set: either means the rank file does not belong to this model)."""
    offsets, ids = kept
    flat = targets.reshape(-1)
    if len(offsets) != flat.numel() + 1:
        raise TrainerError(f"kept sets for {len(offsets) - 1} positions, {flat.numel()} targets")
    if bad := outside_vocab(ids, vocab):
        raise TrainerError(f"sampling-mask token ids outside the model's vocabulary [0, {vocab}): {bad}")
    ids = ids.to(flat.device)
    sizes = (offsets[1:] - offsets[:-1]).to(flat.device)
    hit = (ids == torch.repeat_interleave(flat, sizes)).long()
    found = torch.zeros_like(flat).index_add_(
        0, torch.repeat_interleave(torch.arange(len(flat), device=flat.device), sizes), hit
    )
    missing = ((sizes > 0) & (found == 0)).nonzero().squeeze(-1)
    if missing.numel():
        row = int(missing[0])
        raise TrainerError(
            f"{missing.numel()} sampled token(s) outside their own kept set (first: row {row}, "
            f"token {int(flat[row])}): the sampling masks do not match the tokens"
        )
    return offsets, ids
