"""The CPU packed attention op: same values and gradients as causal SDPA on each sample alone, with our
compiled kernel and with torch's per-sample fallback."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from prime_rl.trainer import attention
from prime_rl.trainer.attention import packed_attention_mask, packed_causal_attention

# Lengths around our kernel's 64-row query blocks and torch's 512-key blocks, and a single token.
LENGTHS = [300, 5, 129, 257, 1, 64, 520]


@pytest.fixture(params=["ours", "torch"])
def kernel(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(attention, "cpu_kernel", lambda: None)
    return request.param


def test_our_cpu_kernel_builds_on_this_machine():
    """Without it the op silently falls back to torch's kernel, at about half the attention speed."""
    assert attention.cpu_kernel() is not None


def _qkv(heads: int, kv_heads: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    length = sum(LENGTHS)
    # HF hands the kernel transposed views ([1, L, heads, dim] memory); keep that layout here.
    q, k, v = (torch.randn(1, length, h, 32, generator=g).transpose(1, 2) for h in (heads, kv_heads, kv_heads))
    return [t.requires_grad_() for t in (q, k, v)], torch.tensor([0, *LENGTHS], dtype=torch.int32).cumsum(0)


def _reference(q, k, v, scale):
    """Causal SDPA per sample, keys/values repeated for grouped heads: out [1, L, H, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    outs = [
        F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
        for qs, ks, vs in zip(q.split(LENGTHS, 2), k.split(LENGTHS, 2), v.split(LENGTHS, 2), strict=True)
    ]
    return torch.cat(outs, 2).transpose(1, 2)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (8, 2)])
def test_packed_causal_attention_matches_sdpa_per_sample_in_value_and_gradient(kernel, heads, kv_heads):
    (q, k, v), cu = _qkv(heads, kv_heads)
    grad = torch.randn(1, sum(LENGTHS), heads, 32, generator=torch.Generator().manual_seed(1))
    results = []
    for fn in (lambda: packed_causal_attention(q, k, v, cu, 0.2)[0], lambda: _reference(q, k, v, 0.2)):
        out = fn()
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_packed_causal_attention_never_reads_another_sample(kernel):
    (q, k, v), cu = _qkv(4, 2)
    out = packed_causal_attention(q, k, v, cu, 0.2)[0]
    # Change everything but the third sample: its output must not move.
    start, end = sum(LENGTHS[:2]), sum(LENGTHS[:3])
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, :start] += 1.0
    v2[:, :, end:] -= 3.0
    out2 = packed_causal_attention(q, k2, v2, cu, 0.2)[0]
    torch.testing.assert_close(out2[:, start:end], out[:, start:end], atol=0, rtol=0)
    assert not torch.allclose(out2[:, :start], out[:, :start])


def test_our_kernel_gives_the_same_result_for_any_query_block_size():
    (q, k, v), cu = _qkv(8, 2)
    grad = torch.randn(1, sum(LENGTHS), 8, 32, generator=torch.Generator().manual_seed(1))
    results = []
    for block in (7, attention.BLOCK, 1000):
        out, lse = attention.cpu_kernel().forward(q, k, v, cu, cu, 0.2, block)
        results.append((out, lse, *attention.cpu_kernel().backward(grad, q, k, v, out, lse, cu, cu, 0.2, block)))
    for other in results[1:]:
        for got, want in zip(other, results[0], strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_our_kernel_rejects_sample_boundaries_that_do_not_cover_the_row():
    (q, k, v), cu = _qkv(4, 2)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must run from 0 to its length"):
        attention.cpu_kernel().forward(q, k, v, cu[:-1], cu[:-1], 0.2, attention.BLOCK)


def test_packed_causal_attention_op_registration_is_consistent(kernel):
    """Fake (meta) kernels, autograd registration and schema agree with the real op (torch.compile relies on it)."""
    (q, k, v), cu = _qkv(4, 2)
    torch.library.opcheck(packed_causal_attention, (q, k, v, cu, 0.2))


# (queries, keys) per sample: a sample with more keys sees a prefix of keys - queries whole (trainer/prefix.py),
# lengths around the 64-row blocks; (n, n) is a plain causal sample.
PREFIXED = [(70, 150), (5, 5), (1, 81), (129, 129), (64, 65), (200, 300)]


def test_samples_attending_to_a_prefix_match_sdpa_with_a_bottom_right_causal_mask():
    g = torch.Generator().manual_seed(0)
    nq, nk = (sum(n for n, _ in PREFIXED), sum(m for _, m in PREFIXED))
    q = torch.randn(1, nq, 8, 32, generator=g).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(1, nk, 2, 32, generator=g).transpose(1, 2).requires_grad_() for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *side], dtype=torch.int32).cumsum(0) for side in zip(*PREFIXED, strict=True))
    grad = torch.randn(1, nq, 8, 32, generator=g)

    def reference():
        outs = []
        for qs, ks, vs, (n, m) in zip(q.split([n for n, _ in PREFIXED], 2), k.split([m for _, m in PREFIXED], 2),
                                      v.split([m for _, m in PREFIXED], 2), PREFIXED, strict=True):  # fmt: skip
            mask = torch.ones(n, m, dtype=torch.bool).tril(m - n)
            ks, vs = ks.repeat_interleave(4, 1), vs.repeat_interleave(4, 1)
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=0.2))
        return torch.cat(outs, 2).transpose(1, 2)

    results = []
    for fn in (lambda: packed_causal_attention(q, k, v, cu_q, 0.2, cu_k)[0], reference):
        out = fn()
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.library.opcheck(packed_causal_attention, (q, k, v, cu_q, 0.2, cu_k))
    with pytest.raises(RuntimeError, match="sample 0 has fewer keys than queries"):
        attention.cpu_kernel().forward(k.transpose(1, 2).repeat(1, 1, 4, 1).transpose(1, 2), q[:, :2], q[:, :2],
                                       cu_k, cu_q, 0.2, attention.BLOCK)  # fmt: skip


def test_packed_attention_mask_is_causal_within_samples_and_blocks_across():
    mask = packed_attention_mask(torch.tensor([0, 2, 3, 5], dtype=torch.int32), 5, torch.device("cpu"))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 0, 1, 0],
            [0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert mask.shape == (1, 1, 5, 5)
    assert torch.equal(mask[0, 0], expected)


def test_the_compile_note_is_said_only_when_torch_will_compile_the_kernel(tmp_path):
    """It printed "its first use on a machine compiles it, ~40 s" on every run, built or not."""

    def write(path, at):
        path.write_text("x")
        os.utime(path, (at, at))

    now = time.time()
    source = tmp_path / "k.cpp"
    write(source, now - 100)
    assert not attention.kernel_built(tmp_path, "k_avx2", source)  # nothing built yet
    write(tmp_path / "k_avx2.so", now - 50)
    assert attention.kernel_built(tmp_path, "k_avx2", source)
    write(source, now - 10)  # a changed source is rebuilt (as k_avx2_v1)
    assert not attention.kernel_built(tmp_path, "k_avx2", source)
    write(tmp_path / "k_avx2_v1.so", now)
    assert attention.kernel_built(tmp_path, "k_avx2", source)


def test_a_build_killed_mid_compile_does_not_stop_the_next_start():
    """torch's `lock` file outlives a killed build, and its `load` then waited forever (a CI run timed out
    on every test this way). The next process loads the kernel, removing the file where torch would wait on it
    (torch <= 2.13's FileBaton; torch 2.14 flocks the file itself and keeps it)."""
    from torch.utils.cpp_extension import _get_build_directory

    attention.cpu_kernel()  # built (the session fixture did it)
    stale = Path(_get_build_directory(attention.kernel_name(), verbose=False)) / "lock"
    stale.touch()
    code = "from prime_rl.trainer.attention import cpu_kernel; assert cpu_kernel() is not None"
    try:
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    finally:
        leftover = stale.exists()
        stale.unlink(missing_ok=True)
    assert leftover != attention.torch_uses_file_baton()


def test_each_torch_install_and_checkout_builds_its_own_kernel(monkeypatch):
    """Two checkouts' venvs shared one build dir, and their build commands name their own torch headers (and two
    worktrees of one venv, their own source): each load from the other one rebuilt the kernel (~30 s at a
    trainer's start, nothing logged)."""
    here = attention.kernel_name()
    assert here == attention.kernel_name() and here.isidentifier()  # stable, and a valid module name
    with monkeypatch.context() as m:
        m.setattr(torch, "__file__", "/elsewhere/.venv/lib/python3.11/site-packages/torch/__init__.py")
        assert attention.kernel_name() != here
    monkeypatch.setattr(attention, "__file__", "/worktree/src/prime_rl/trainer/attention.py")
    assert attention.kernel_name() != here


def test_the_build_lock_waits_for_a_live_builder_then_names_it(tmp_path):
    hold = "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); print(1, flush=True)"
    hold += "; time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / "prime_rl.lock")], stdout=subprocess.PIPE)
    try:
        holder.stdout.readline()
        (tmp_path / "lock").touch()  # a live build's marker stays
        with pytest.raises(TimeoutError, match="prime_rl.lock"):
            with attention.build_lock(tmp_path, timeout=0.5):
                pass
        assert (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()
    with attention.build_lock(tmp_path, timeout=5):  # its holder died: the flock is free, a FileBaton marker stale
        assert (tmp_path / "lock").exists() != attention.torch_uses_file_baton()


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_cuda_packed_attention_matches_sdpa_per_sample_in_value_and_gradient(kv_heads):
    """CUDA bf16: the packed path (torch's varlen flash attention where this torch has it) against causal SDPA
    on each sample alone, forward and gradients; and it is the varlen kernel on a torch that has one."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    lengths, heads, dim = [37, 1, 200, 64, 130], 4, 64
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    shape = lambda h: (1, h, sum(lengths), dim)  # noqa: E731
    # Laid out as HF does: [1, L, H, D] memory seen as [1, H, L, D].
    q, k, v = (torch.randn(*shape(h), device="cuda", dtype=torch.bfloat16).requires_grad_()
               for h in (heads, kv_heads, kv_heads))  # fmt: skip
    out, _ = attention.packed_attention(None, q, k, v, None, cu_seq_lens_q=cu, max_length_q=max(lengths))
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    group = heads // kv_heads
    ref = torch.cat([
        F.scaled_dot_product_attention(qs, ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1),
                                       is_causal=True).transpose(1, 2)
        for qs, ks, vs in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2), strict=True)
    ], 1)  # fmt: skip
    want = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=5e-2, rtol=5e-2)
    print(f"torch {torch.__version__}: varlen kernel {'used' if attention._varlen_params() else 'absent'}")


@pytest.mark.gpu
def test_cuda_varlen_attention_takes_prefix_keys_causal_from_the_bottom_right():
    """What shared prompts on CUDA would rest on (trainer/prefix.py, CPU-only until this holds on a GPU): torch's
    varlen flash attention, given a sample more keys than queries, lets query r see keys 0 .. m - n + r, as our
    CPU kernel and `prefixed_sdpa` do."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if not attention._varlen_params():
        pytest.skip(f"torch {torch.__version__} has no varlen attention")
    from torch.nn.attention.varlen import varlen_attn

    torch.manual_seed(0)
    q_lengths, k_lengths, heads, dim = [70, 5, 1, 64], [150, 5, 81, 65], 4, 64
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for n in (q_lengths, k_lengths))  # fmt: skip
    q = torch.randn(1, heads, sum(q_lengths), dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, heads, sum(k_lengths), dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    want = attention.prefixed_sdpa(q, k, v, cu_q, cu_k, dim**-0.5)
    params = attention._varlen_params()
    kwargs = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    got = varlen_attn(*(t[0].transpose(0, 1).contiguous() for t in (q, k, v)), cu_q, cu_k, max(q_lengths),
                      max(k_lengths), scale=dim**-0.5, **kwargs)[None]  # fmt: skip
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
