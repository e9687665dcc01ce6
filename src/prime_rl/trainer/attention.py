"""Attention over packed rows: every sample attends causally to itself and never to its neighbours.

A packed row holds several samples end to end (positions restart at 0 per sample). For
`cu_seqlens = [0, 2, 3]` (samples a0 a1 | b0), True = may attend:

        a0 a1 b0
    a0 [ T  .  . ]
    a1 [ T  T  . ]
    b0 [ .  .  T ]

Rather than materialising that L×L mask, the model gets the sample boundaries (`cu_seq_lens_q/k`,
`max_length_q/k`, passed through the HF forward as keyword arguments) and one of these kernels:
- `flash_attention_2` (CUDA with flash-attn installed): transformers' varlen flash-attention path;
- `packed_attention` (registered here) everywhere else:
  - on CPU, the `prime_rl::packed_causal_attention` op (below);
  - on CUDA in 16-bit, torch's own varlen flash attention (`torch.nn.attention.varlen`, torch >= 2.10): one
    kernel per layer for the whole row, as flash-attn's;
  - otherwise causal SDPA per sample (a launch per sample and layer: fine for a few samples, slow for rows
    of many short ones).
  Either way attention costs Σ len² rather than L² (our CPU kernel: Σ len²/2). `packed_attention_mask`
  is the same rule as an explicit mask, kept as the reference the tests compare against.

Models may ask the attention function for two more things (Gemma 2 asks for both):
- `softcap`: scores become tanh(scores / softcap)·softcap before the softmax;
- `sliding_window` w: a query sees only itself and the w − 1 keys before it.
Our fast kernels implement neither, so `packed_attention` then runs `capped_window_attention` per sample,
transformers' eager attention on plain torch ops (memory Σ len², like its eager path). transformers'
`flash_attention_2` honours both on packed rows: `_flash_attention_forward` takes the varlen path for
`cu_seq_lens_*` and `_process_flash_attention_kwargs` passes `softcap` and window_size = (w − 1, w − 1)
to flash-attn, whose window is per sample on varlen input (read in transformers 5.x, not run here). A
flash-attn without those parameters (< 2.3: no window_size, < 2.6: no softcap) would have the window
dropped silently (softcap raises); that, and what no path reproduces, `check_supported` refuses at load.

On CPU the op is opaque to torch.compile, so a compiled decoder layer stays one graph around it whatever
the sample lengths. Its kernel is ours (`csrc/causal_attention.cpp`, built with the local C++ compiler on
first use, cached per machine and torch install): query blocks of 64 rows read only the keys up to their last
row, so a sample costs its causal triangle. torch's CPU flash-attention kernel computes 512-key blocks whole and so
pays the full square up to 512 tokens; it remains the fallback where the kernel cannot be built, for
dtypes other than float32, and for rows holding a sample of `LONG_FROM` tokens or more.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import inspect
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from prime_rl.trainer.errors import TrainerError

logger = logging.getLogger("prime_rl")

BLOCK = 64  # query rows per work item of the CPU kernel
# From ~3k tokens torch's kernel wins (it tiles the keys, ours holds a block's whole score rows):
# forward + backward at 2,048 tokens 80 vs 110 ms, at 4,096 374 vs 337 ms. Rows with such a sample use it.
LONG_FROM = 3072
BUILD_WAIT_S = 300  # a build takes ~40 s alone, minutes beside a busy machine's other work


@functools.cache
def cpu_kernel():
    """The compiled CPU kernel module, or None where it cannot be built (no C++ compiler, no BLAS symbols)."""
    # Imported here, its logger quieted first: its import warns "no CUDA" (and only CPU training builds it).
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from torch.utils.cpp_extension import _get_build_directory, load

    capability = torch.backends.cpu.get_cpu_capability()
    flags = ["-O3", "-ffast-math", "-fopenmp"]  # fast-math: a vectorised exp; no inf or NaN is ever formed
    if capability in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    name = kernel_name()
    source = Path(__file__).parent / "csrc" / "causal_attention.cpp"
    build_dir = Path(_get_build_directory(name, verbose=False))
    if kernel_built(build_dir, name, source):
        logger.debug("loading the CPU attention kernel (built before)")
    else:
        logger.info("compiling the CPU attention kernel (once per machine and kernel source, ~40 s)")
    try:
        with build_lock(build_dir):
            return load(name, [str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"])
    except Exception as e:  # a failed build or load of any kind: fall back rather than fail training
        logger.warning(f"CPU attention kernel unavailable, using torch's slower per-sample kernel: {e}")
        return None


@contextlib.contextmanager
def build_lock(build_dir: Path, timeout: float = BUILD_WAIT_S):
    """Hold the kernel's build dir against other processes of ours while torch builds or loads it.

    torch up to 2.13 marks a build in progress with a `lock` file (FileBaton) that outlives a process killed
    mid-compile, and then every later `load` waits on it forever. Ours is a flock, which the OS drops when its
    holder dies, so under it any such `lock` file is stale and is removed. (torch 2.14 flocks that same file
    itself, which leaves it in place and never waits on a dead holder: nothing to remove there.) Waits at most
    `timeout` for a live builder.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    path = build_dir / "prime_rl.lock"
    with open(path, "w") as f:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    msg = f"another process held {path} (building the kernel) for over {timeout:.0f} s"
                    raise TimeoutError(msg) from None
                time.sleep(0.2)
        stale = build_dir / "lock"
        if stale.exists() and torch_uses_file_baton():
            logger.warning(f"removing {stale}, left by a kernel build that was killed before it finished")
            stale.unlink()
        yield


def torch_uses_file_baton() -> bool:
    """Whether torch's extension builds mark themselves with a plain `lock` file (FileBaton, torch <= 2.13)."""
    import torch.utils.cpp_extension as cpp_extension  # imported by cpu_kernel, its logger quieted

    return hasattr(cpp_extension, "FileBaton")


def kernel_name() -> str:
    """The kernel's module name: per CPU capability, torch install and checkout. torch's build dir is shared by
    every environment on the machine, and its build commands name the torch headers and our source by path, so two
    venvs (or two checkouts of one venv, as git worktrees) sharing one name rebuilt it (~30 s, unlogged) each time
    a process of the other one loaded it."""
    paths = f"{Path(torch.__file__).parent}|{Path(__file__).parent}"
    install = hashlib.sha256(paths.encode()).hexdigest()[:8]
    return f"prime_rl_causal_attention_{torch.backends.cpu.get_cpu_capability().lower()}_{install}"


def kernel_built(build_dir: Path, name: str, source: Path) -> bool:
    """Whether torch's extension build dir holds a module of `name` built after `source` last changed (else
    `load` compiles: a changed source gets a new `name_vN` module)."""
    built = [so.stat().st_mtime for so in build_dir.glob(f"{name}*.so")]
    return bool(built) and max(built) >= source.stat().st_mtime


def _our_kernel(q: torch.Tensor, cu_seqlens: torch.Tensor):
    if q.dtype != torch.float32 or int(cu_seqlens.diff().max()) >= LONG_FROM:
        return None
    return cpu_kernel()


def serves_prefixes(dtype: torch.dtype, cu_seqlens_k: torch.Tensor) -> bool:
    """Whether our kernel takes rows whose samples attend to a shared prefix's keys too (trainer/prefix.py):
    torch's fallback knows plain causal samples only."""
    return dtype == torch.float32 and int(cu_seqlens_k.diff().max()) < LONG_FROM and cpu_kernel() is not None


def _prefix_kernel(q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    if not serves_prefixes(q.dtype, cu_seqlens_k):
        raise RuntimeError("samples with shared-prefix keys need our CPU kernel (float32, every sample's keys "
                           f"under {LONG_FROM}), which cannot serve this row")  # fmt: skip
    return cpu_kernel()


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@torch.library.custom_op("prime_rl::packed_causal_attention", mutates_args=(), device_types="cpu")
def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    cu_seqlens_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, H, L, D], k/v [1, KV, L, D] (KV divides H) → out [1, L, H, D], logsumexp [1, H, L].

    With `cu_seqlens_k` the keys are laid out per sample on their own ([1, KV, Lk, D]), a sample's first keys
    beyond its queries' count being a prefix it sees whole (causal from the bottom right, as flash-attn's)."""
    if cu_seqlens_k is not None:
        return tuple(_prefix_kernel(q, cu_seqlens_k).forward(q, k, v, cu_seqlens, cu_seqlens_k, scale, BLOCK))
    if kernel := _our_kernel(q, cu_seqlens):
        return tuple(kernel.forward(q, k, v, cu_seqlens, cu_seqlens, scale, BLOCK))
    lengths = cu_seqlens.diff().tolist()
    per_sample = zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2), strict=True)
    parts = [_flash(*qkv, 0.0, True, scale=scale)[:2] for qkv in per_sample]
    # The kernel's out is [1, H, l, D] over [1, l, H, D] memory: concatenating in that layout is one copy.
    out = torch.cat([o.transpose(1, 2) for o, _ in parts], 1)
    return out, torch.cat([lse for _, lse in parts], 2)


@packed_causal_attention.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float, cu_seqlens_k: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    batch, heads, length, dim = q.shape
    return q.new_empty(batch, length, heads, dim), q.new_empty(batch, heads, length, dtype=torch.float32)


@torch.library.custom_op("prime_rl::packed_causal_attention_backward", mutates_args=(), device_types="cpu")
def packed_causal_attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    cu_seqlens_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if cu_seqlens_k is not None:
        kernel = _prefix_kernel(q, cu_seqlens_k)
        return tuple(kernel.backward(grad, q, k, v, out, lse, cu_seqlens, cu_seqlens_k, scale, BLOCK))
    if kernel := _our_kernel(q, cu_seqlens):
        return tuple(kernel.backward(grad, q, k, v, out, lse, cu_seqlens, cu_seqlens, scale, BLOCK))
    lengths = cu_seqlens.diff().tolist()
    per_sample = (t.split(lengths, 2) for t in (grad.transpose(1, 2), q, k, v, out.transpose(1, 2), lse))
    grads = [_flash_backward(*tensors, 0.0, True, scale=scale) for tensors in zip(*per_sample, strict=True)]
    return tuple(torch.cat(g, 2).contiguous() for g in zip(*grads, strict=True))


@packed_causal_attention_backward.register_fake
def _(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor,
    scale: float,
    cu_seqlens_k: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx: FunctionCtx, inputs: tuple, output: tuple[Tensor, Tensor]) -> None:
    q, k, v, cu_seqlens, scale, *cu_k = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens, *(t for t in cu_k if t is not None))
    ctx.scale = scale


def _backward(ctx: FunctionCtx, grad_out: Tensor, grad_lse: Tensor) -> tuple:
    q, k, v, out, lse, cu_seqlens, *cu_k = ctx.saved_tensors
    grad = grad_out.contiguous()
    grads = packed_causal_attention_backward(grad, q, k, v, out, lse, cu_seqlens, ctx.scale, *cu_k)
    return *grads, None, None, None


packed_causal_attention.register_autograd(_backward, setup_context=_setup_context)


def attention_implementation(device_type: str) -> str:
    """`flash_attention_2` on CUDA when flash-attn is importable, else our `packed_attention`."""
    if device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    if device_type == "cpu":
        cpu_kernel()  # build it now, logged, rather than inside the first step

    AttentionInterface.register("packed_attention", packed_attention)
    return "packed_attention"


def packed_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    cu_seq_lens_q: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """HF attention interface: query/key/value [1, heads, L, dim] → out [1, L, heads, dim].

    Without `cu_seq_lens_q` (a plain HF forward, e.g. generation) it is ordinary SDPA with the given mask.
    With `softcap` or a `sliding_window` that some sample outgrows (Gemma 2/3, Mistral, Qwen2 with
    use_sliding_window) it is `capped_window_attention`, per sample (or on the whole rows of a plain forward).
    """
    kv_index, cu_k = kwargs.pop("kv_index", None), kwargs.pop("cu_seq_lens_k", None)
    for unused in ("max_length_k", "is_causal"):
        kwargs.pop(unused, None)
    longest = kwargs.pop("max_length_q", None)
    softcap, window = kwargs.pop("softcap", None), kwargs.pop("sliding_window", None)
    scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
    if kv_index is not None:  # a row with shared prompts (trainer/prefix.py): each sample's keys gathered
        if softcap is not None or window is not None or kwargs.get("dropout"):
            raise TrainerError("shared prompts (share_prompts) know plain causal attention only")
        key, value = key.index_select(2, kv_index), value.index_select(2, kv_index)
        if query.device.type == "cpu" and serves_prefixes(query.dtype, cu_k):
            return packed_causal_attention(query, key, value, cu_seq_lens_q, scale, cu_k)[0], None
        return prefixed_sdpa(query, key, value, cu_seq_lens_q, cu_k, scale), None
    if cu_seq_lens_q is None:
        if softcap is None and window is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        dropout = kwargs.get("dropout", 0.0)
        return capped_window_attention(query, key, value, scale, softcap, window, dropout, attention_mask), None
    if window is not None and longest is not None and longest <= window:
        window = None  # every sample fits in the window: it hides no key (Mistral's 4096 on short samples)
    if softcap is not None or window is not None:
        lengths = cu_seq_lens_q.diff().tolist()
        per_sample = zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2), strict=True)
        dropout = kwargs.get("dropout", 0.0)
        outs = [capped_window_attention(q, k, v, scale, softcap, window, dropout) for q, k, v in per_sample]
        return torch.cat(outs, dim=1), None
    if query.device.type == "cpu" and not kwargs.get("dropout"):
        return packed_causal_attention(query, key, value, cu_seq_lens_q, scale)[0], None
    if (varlen := _cuda_varlen(query)) is not None and not kwargs.get("dropout"):
        return varlen(query, key, value, cu_seq_lens_q, longest, scale), None
    # `split`, not slicing: the backward of n slices zero-fills and adds n full-length [1, heads, L, dim]
    # gradients, while split's backward is one concatenation.
    lengths = cu_seq_lens_q.diff().tolist()
    outs = [
        sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)[0]
        for q, k, v in zip(query.split(lengths, 2), key.split(lengths, 2), value.split(lengths, 2), strict=True)
    ]
    return torch.cat(outs, dim=1), None


def prefixed_sdpa(query: Tensor, key: Tensor, value: Tensor, cu_q: Tensor, cu_k: Tensor, scale: float) -> Tensor:
    """query [1, H, L, D], key/value [1, KV, Lk, D] laid out per sample (`cu_k`) → out [1, L, H, D]: each
    sample's queries causal from the bottom right over its keys, by SDPA with a mask per sample."""
    q_lengths, k_lengths = cu_q.diff().tolist(), cu_k.diff().tolist()
    outs = []
    per_sample = zip(query.split(q_lengths, 2), key.split(k_lengths, 2), value.split(k_lengths, 2), strict=True)
    for (q, k, v), n, m in zip(per_sample, q_lengths, k_lengths, strict=True):
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True))
    return torch.cat(outs, 2).transpose(1, 2)


def _cuda_varlen(query: torch.Tensor):
    """`varlen_causal` where torch's varlen flash attention serves `query` (CUDA, fp16/bf16), else None."""
    if query.device.type != "cuda" or query.dtype not in (torch.float16, torch.bfloat16):
        return None
    return varlen_causal if _varlen_params() else None


@functools.cache
def _varlen_params() -> frozenset[str]:
    """The keyword arguments of torch's `varlen_attn` (they changed between releases); empty without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return frozenset()
    params = frozenset(inspect.signature(varlen_attn).parameters)
    return params if {"window_size", "is_causal"} & params else frozenset()


def varlen_causal(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, longest: int | None, scale: float
) -> Tensor:
    """query [1, H, L, D], key/value [1, KV, L, D] → out [1, L, H, D]: causal within each sample, by torch's
    varlen flash attention on the whole packed row."""
    from torch.nn.attention.varlen import varlen_attn  # not in every torch release: _varlen_params checked

    params = _varlen_params()
    # HF's [1, H, L, D] is a transposed view of [1, L, H, D] memory: [L, H, D] is that memory again.
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
    longest = int(longest) if longest is not None else int(cu.diff().max())
    return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, **kwargs)[None]


def capped_window_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    softcap: float | None,
    window: int | None,
    dropout: float = 0.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of one sample as transformers' eager attention computes it (Gemma 2's
    `eager_attention_forward`): query [B, H, q, D], key/value [B, KV, k, D] (KV divides H; the queries are
    the last q of the k positions) → out [B, q, H, D].

    scores = (query @ keyᵀ)·scale, then with `softcap` tanh(scores / softcap)·softcap, then masked and
    softmaxed in float32. With `window` a query sees itself and the `window − 1` keys before it: transformers'
    `sliding_window_overlay` keeps kv > q − window, and its flash-attention path passes window_size
    (window − 1, window − 1). `mask` (a 4-D HF mask, boolean or additive) further restricts the keys.
    Without softcap (and additive mask) the boolean mask goes to SDPA, which need not hold the [q, k] weights
    per head. Memory is q·k (per head with softcap): a packed row costs Σ len² here, not the fast kernels' Σ len.
    """
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    q_len, k_len = query.shape[2], key.shape[2]
    q_pos = torch.arange(k_len - q_len, k_len, device=query.device)[:, None]
    k_pos = torch.arange(k_len, device=query.device)[None]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    if mask is not None and mask.dtype == torch.bool:
        allowed, mask = allowed & mask, None
    if softcap is None and mask is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, dropout_p=dropout, scale=scale)
        return out.transpose(1, 2)
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if dropout:
        weights = F.dropout(weights, p=dropout)
    return torch.matmul(weights, value).transpose(1, 2)


def packed_attention_mask(cu_seqlens: torch.Tensor, length: int, device: torch.device) -> torch.Tensor:
    """Boolean [1, 1, L, L] mask: causal within each sample of the packed row, nothing across samples."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    sample_of = torch.repeat_interleave(torch.arange(len(cu) - 1, device=device), cu.diff(), output_size=length)
    same_sample = sample_of[:, None] == sample_of[None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return (same_sample & causal)[None, None]


SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_supported(model: torch.nn.Module) -> None:
    """Raise TrainerError naming any attention feature of `model` that packed rows would silently get wrong.

    The packed paths know causal attention within each sample, softcap and sliding windows. They ignore the
    attention mask (HF builds none for a custom attention function), so mask-only features are lost:
    chunked attention (Llama 4), bidirectional attention (Gemma 3 `use_bidirectional_attention`), and
    layers that are not attention (linear attention / state-space layers would run across sample
    boundaries). Attention sinks (gpt-oss) are an extra softmax column no packed path adds.
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    arch = type(model).__name__
    features = []
    if getattr(config, "attention_chunk_size", None):
        features.append(f"chunked attention (attention_chunk_size = {config.attention_chunk_size})")
    if getattr(config, "use_bidirectional_attention", False):
        features.append("bidirectional attention (use_bidirectional_attention)")
    other = sorted(set(getattr(config, "layer_types", None) or []) - set(SUPPORTED_LAYER_TYPES))
    if other:
        features.append(f"layer types {', '.join(other)} (only {' and '.join(SUPPORTED_LAYER_TYPES)})")
    if any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in model.named_parameters()):
        features.append("attention sinks")
    if model.config._attn_implementation == "flash_attention_2":
        from flash_attn import flash_attn_varlen_func  # optional: CUDA nodes that installed it

        supported = inspect.signature(flash_attn_varlen_func).parameters
        if getattr(config, "sliding_window", None) is not None and "window_size" not in supported:
            features.append("sliding windows with this flash-attn (< 2.3, no window_size)")
        if getattr(config, "attn_logit_softcapping", None) is not None and "softcap" not in supported:
            features.append("attention softcapping with this flash-attn (< 2.6, no softcap)")
    if features:
        raise TrainerError(f"{arch}: the trainer's packed attention cannot reproduce {'; '.join(features)}")
