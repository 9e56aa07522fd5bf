"""Paged attention on CPU (localllm_kernels.cpu_attention): our C++ op and the torch reference it
falls back to, each against float64 attention computed here from the same (rounded) cache values.

Tolerances: the op and the reference accumulate in fp32 from the same inputs as the fp64 reference
(q fp32, cache values already rounded to the cache dtype), so the only error is fp32 rounding:
max |out - ref| <= 5e-6 (outputs are O(1); the largest error seen is ~2e-6).
Unused cache rows (past each context, unused blocks) hold NaN: reading one shows in the output.
"""

import functools
import os
import platform
import shutil
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from localllm_kernels import cpu_attention, cpu_build

ATOL = 5e-6
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GQA = [(4, 4), (9, 3), (8, 2), (16, 2)]  # (H, KVH): ratios 1, 3 (SmolLM2), 4, 8

needs_cxx = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")


def make_batch(specs, H, kvh, D, bs, dtype, seed=0):
    """specs: [(n new rows, context)] -> (q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    with every sequence in shuffled blocks, NaN in every cache row outside the contexts and the
    block tables padded with random valid ids."""
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-ctx // bs) for _, ctx in specs]
    nb = sum(nblk) + 3
    order = torch.randperm(nb, generator=g).tolist()
    width = max(nblk) + 1
    tables = torch.randint(0, nb, (len(specs), width), generator=g)
    k = torch.full((nb, bs, kvh, D), float("nan"))
    v = torch.full((nb, bs, kvh, D), float("nan"))
    for b, (_, ctx) in enumerate(specs):
        ids = [order.pop() for _ in range(nblk[b])]
        tables[b, :len(ids)] = torch.tensor(ids)
        for p in range(ctx):
            k[ids[p // bs], p % bs] = torch.randn(kvh, D, generator=g)
            v[ids[p // bs], p % bs] = torch.randn(kvh, D, generator=g)
    q = torch.randn(sum(n for n, _ in specs), H, D, generator=g) * 2  # peakier than unit scores
    cu = torch.tensor([0] + [n for n, _ in specs]).cumsum(0)
    ctx = torch.tensor([c for _, c in specs])
    return q, k.to(dtype), v.to(dtype), tables, cu, ctx


def fp64_attention(q, k_cache, v_cache, block_tables, cu, ctx, scale, window=None, softcap=None, sinks=None):
    """Dense attention in float64: explicit scores, cap, causal + window mask, softmax (with sinks:
    each head's sink logit one more column of the softmax, dropped after it)."""
    T, H, D = q.shape
    _, bs, kvh, _ = k_cache.shape
    kc, vc = k_cache.double().reshape(-1, kvh, D), v_cache.double().reshape(-1, kvh, D)
    out = torch.empty(T, H, D, dtype=torch.float64)
    for b in range(len(ctx)):
        s, e, L = int(cu[b]), int(cu[b + 1]), int(ctx[b])
        pos = torch.arange(L)
        slots = block_tables[b, pos // bs] * bs + pos % bs
        kk = kc[slots].repeat_interleave(H // kvh, dim=1)  # [L, H, D]: head h uses KV head h // G
        vv = vc[slots].repeat_interleave(H // kvh, dim=1)
        scores = torch.einsum("nhd,lhd->hnl", q[s:e].double(), kk) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        qpos = torch.arange(L - (e - s), L)[:, None]  # row i sits at position L - n + i
        visible = (pos[None, :] <= qpos) & (pos[None, :] > qpos - (window or L + 1))
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.double().view(H, 1, 1).expand(H, e - s, 1)
            p = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            p = scores.softmax(-1)
        out[s:e] = torch.einsum("hnl,lhd->nhd", p, vv)
    return out


def check(out, args, scale, atol=ATOL, window=None, softcap=None):
    ref = fp64_attention(*args, scale, window, softcap)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    err = (out.double() - ref).abs().max().item()
    assert err <= atol, err


@pytest.fixture(scope="module")
def op():
    """Our op, built into the normal cache."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")
    assert cpu_attention.load()
    return torch.ops.localllm.paged_attention


IMPLS = ["op", "reference"]


def impl(name, request):
    return request.getfixturevalue("op") if name == "op" else cpu_attention.reference


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("bs", [16, 12])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H,kvh", GQA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode(name, dtype, H, kvh, D, bs, request):
    """One new token per sequence, contexts on and around block boundaries."""
    fn = impl(name, request)
    args = make_batch([(1, c) for c in (1, 15, 16, 17, 32, 33, 100)], H, kvh, D, bs, dtype, seed=H + D + bs)
    check(fn(*args, D ** -0.5), args, D ** -0.5)


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("H,kvh", GQA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_token_with_cached_prefix(name, dtype, H, kvh, D, request):
    """Speculative verify / prefix-hit extend: n = 2..6 new rows after a cached prefix, causal among them."""
    fn = impl(name, request)
    args = make_batch([(2, 3), (3, 17), (4, 16), (5, 40), (6, 33), (6, 7)], H, kvh, D, 16, dtype, seed=H * D)
    check(fn(*args, 0.1), args, 0.1)


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("H,kvh", GQA)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fresh_prefill(name, dtype, H, kvh, request):
    """n = ctx: no cached prefix; 70 and 150 rows span several query tiles."""
    fn = impl(name, request)
    for specs in ([(1, 1)], [(16, 16)], [(33, 33)], [(70, 70)], [(150, 150)]):
        args = make_batch(specs, H, kvh, 64, 16, dtype, seed=specs[0][0])
        check(fn(*args, 0.125), args, 0.125)


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("D", [16, 80, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_head_dims(name, dtype, D, request):
    """Any multiple of 16: one 16-column chunk, 64 + 16 columns, the largest."""
    fn = impl(name, request)
    args = make_batch([(1, 40), (3, 20), (17, 17)], 8, 2, D, 16, dtype, seed=D)
    check(fn(*args, D ** -0.5), args, D ** -0.5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch(name, dtype, threads, request):
    """Decodes, verifies, extends and fresh prefills of ragged lengths in one flattened batch."""
    fn = impl(name, request)
    specs = [(1, 1), (1, 33), (4, 20), (20, 20), (1, 300), (6, 300), (40, 41), (1, 16), (3, 3), (1, 17)]
    args = make_batch(specs, 9, 3, 64, 16, dtype, seed=3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check(fn(*args, 0.125), args, 0.125)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ctx,n,H,kvh,D", [(4096, 1, 9, 3, 64), (8000, 1, 32, 8, 128), (6001, 4, 8, 2, 64)])
def test_long_context_split(op, dtype, ctx, n, H, kvh, D):
    """One long sequence: on 2 threads its context is split into chunks merged afterwards, on 1 it
    is not; both match fp64 and each other."""
    args = make_batch([(n, ctx)], H, kvh, D, 16, dtype, seed=ctx)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(op(*args, D ** -0.5))
    finally:
        torch.set_num_threads(before)
    for out in outs:
        check(out, args, D ** -0.5)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=2e-6)


def test_op_equals_reference_and_keeps_inputs(op):
    """The two implementations agree (to fp32 summation order) and neither writes its inputs."""
    args = make_batch([(1, 50), (5, 21), (30, 30)], 8, 2, 64, 16, torch.float16, seed=7)
    kept = [a.clone() for a in args]
    a, b = op(*args, 0.125), cpu_attention.reference(*args, 0.125)
    torch.testing.assert_close(a, b, rtol=0, atol=4e-6)
    for x, y in zip(args, kept):
        assert torch.equal(x.nan_to_num(), y.nan_to_num())
    assert cpu_attention.paged_attention(*args, 0.125).equal(a)
    assert cpu_attention.isa() in ("avx512", "avx2", "generic")


def test_wrapper_falls_back_to_reference(monkeypatch):
    monkeypatch.setattr(cpu_attention, "load", lambda: False)
    args = make_batch([(1, 20), (3, 9)], 9, 3, 64, 16, torch.bfloat16, seed=1)
    check(cpu_attention.paged_attention(*args, 0.125), args, 0.125)


def bad_inputs():
    good = make_batch([(1, 20), (2, 9)], 4, 2, 64, 16, torch.float16)
    q, k, v, bt, cu, ctx = good

    def with_(i, x):
        return tuple(x if j == i else a for j, a in enumerate(good))

    return [
        ("q must be float32", with_(0, q.half())),
        ("q must be float32", with_(0, q[0])),
        ("must both be float32, float16, bfloat16 or uint8", with_(2, v.float())),
        ("must both be float32, float16, bfloat16 or uint8", (q, k.double(), v.double(), bt, cu, ctx)),
        ("must both be \\[num_blocks", with_(2, v[:, :8])),
        ("head dim", (q[..., :40].contiguous(), k[..., :40].contiguous(), v[..., :40].contiguous(), bt, cu, ctx)),
        ("multiple of KV heads", (q[:, :3].contiguous(), k, v, bt, cu, ctx)),
        ("must be int64", with_(3, bt.int())),
        ("must be int64", with_(5, ctx.int())),
        ("context_lens must be \\[B\\]", with_(5, ctx[:1])),
        ("cu_seqlens_q must run from 0 to T", with_(4, torch.tensor([0, 1, 2]))),
        ("query rows|context length", with_(4, torch.tensor([0, 0, 3]))),
        ("context length", with_(5, torch.tensor([20, 1]))),
        ("context length", with_(5, torch.tensor([20, 1000]))),
    ]


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("case", range(len(bad_inputs())))
def test_bad_inputs_raise(name, case, request):
    fn = impl(name, request)
    match, args = bad_inputs()[case]
    with pytest.raises(RuntimeError, match=match):
        fn(*args, 0.125)


def test_bad_inputs_op_only(op):
    """Errors only the op can see before it reads memory (the reference lets torch's indexing fail)."""
    q, k, v, bt, cu, ctx = make_batch([(1, 20), (2, 9)], 4, 2, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match="block id 99 out of range"):
        op(q, k, v, torch.tensor([[0, 1, 0], [99, 0, 0]]), cu, ctx, 0.125)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(q, k.transpose(0, 1).contiguous().transpose(0, 1), v, bt, cu, ctx, 0.125)
    empty = op(q[:0], k, v, bt[:0], cu[:1], ctx[:0], 0.125)
    assert empty.shape == (0, 4, 64)


class Tiny(torch.nn.Module):
    def forward(self, q, k_cache, v_cache, block_tables, cu, ctx):
        # the call without window and cap (Llama-style layers) and one with both (Gemma 2 style)
        plain = torch.ops.localllm.paged_attention(q, k_cache, v_cache, block_tables, cu, ctx, 0.125)
        return plain * 2 + torch.ops.localllm.paged_attention(q, k_cache, v_cache, block_tables, cu, ctx, 0.125, 5, 30.0)


# contexts across several blocks of 16, windows starting mid-block; decode, verify/extend rows
# after a cached prefix, and fresh rows over several query tiles (16 rows per tile at G = 4)
WINDOW_SPECS = [(1, 1), (1, 17), (1, 100), (3, 50), (6, 70), (20, 85), (40, 40)]


@functools.cache
def window_case(D, dtype, window, softcap):
    """(args, scale, fp64 result, fp64 result without window and cap), shared by the op's and the
    reference's test of one case. The scale with a cap makes scores reach ~+-150 so that capping
    them at 50 changes the output."""
    args = make_batch(WINDOW_SPECS, 8, 2, D, 16, dtype, seed=D)
    scale = 20 * D ** -0.5 if softcap else D ** -0.5
    return args, scale, fp64_attention(*args, scale, window, softcap), fp64_attention(*args, scale)


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("softcap", [None, 50.0])
@pytest.mark.parametrize("window", [None, 1, 5, 16, 37])
def test_window_and_softcap(name, window, softcap, dtype, D, request):
    """Sliding window (a row at position p sees p - window < k <= p) and score soft-capping against
    dense fp64 attention, which each case also checks differs from plain attention (so the test
    sees the feature). fp32 scores near +-50 carry ~1e-5 of rounding: a looser tolerance with the cap."""
    fn = impl(name, request)
    args, scale, ref, plain = window_case(D, dtype, window, softcap)
    out = fn(*args, scale, window or 0, softcap or 0.0)  # the op takes 0 for off
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert (out.double() - ref).abs().max().item() <= (5e-5 if softcap else ATOL)
    if window or softcap:
        assert (ref - plain).abs().max() > 0.1


@pytest.mark.parametrize("ctx,n,window", [(3000, 1, 1000), (3000, 4, 37), (2500, 1, 2499)])
def test_window_long_context_split(op, ctx, n, window):
    """A long sequence with a window on 1 and 2 threads (there its window is split into chunks from
    its first visible block, merged afterwards): both match fp64."""
    args = make_batch([(n, ctx)], 8, 2, 64, 16, torch.float16, seed=ctx + n)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            check(op(*args, 0.125, window, 30.0), args, 0.125, atol=2e-5, window=window, softcap=30.0)
    finally:
        torch.set_num_threads(before)


def test_window_skips_the_keys_below_it(op):
    """The keys below the window are never read (that is where the time goes on long contexts):
    with NaN there the output stays the same, bit for bit."""
    window, specs = 37, [(1, 300), (1, 1000), (4, 500)]
    q, k, v, tables, cu, ctx = args = make_batch(specs, 8, 2, 64, 16, torch.float16, seed=9)
    want = op(*args, 0.125, window, 0.0)
    kf, vf = k.view(-1, 2, 64), v.view(-1, 2, 64)
    for b, (n, c) in enumerate(specs):
        pos = torch.arange(c - n - window + 1)  # below what the first row sees
        kf[tables[b, pos // 16] * 16 + pos % 16] = vf[tables[b, pos // 16] * 16 + pos % 16] = float("nan")
    assert torch.equal(op(*args, 0.125, window, 0.0), want)


@pytest.mark.parametrize("name", IMPLS)
def test_bad_window_and_softcap_raise(name, request):
    fn = impl(name, request)
    args = make_batch([(1, 20)], 4, 2, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        fn(*args, 0.125, -1, 0.0)
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        fn(*args, 0.125, 0, -1.0)


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 5, 37])
def test_sinks(name, window, dtype, request):
    """Attention sinks (gpt-oss): each query head's logit joins its softmax's denominator. Against
    dense fp64 attention, with sinks above and below the scores (one head's sink dominates: its
    rows shrink toward 0), decode and multi-row steps, windows; the sinks change the output."""
    fn = impl(name, request)
    args = make_batch(WINDOW_SPECS, 8, 2, 64, 16, dtype, seed=11)
    sinks = torch.tensor([-3.0, 0.0, 1.5, 4.0, -1.0, 20.0, 0.5, 2.5])
    out = fn(*args, 0.125, window or 0, 0.0, sinks)
    ref = fp64_attention(*args, 0.125, window, sinks=sinks)
    assert (out.double() - ref).abs().max().item() <= ATOL
    assert (ref - fp64_attention(*args, 0.125, window)).abs().max() > 0.1
    assert ref[:, 5].abs().max() < 1e-3  # head 5's sink of 20 takes nearly all the weight


@pytest.mark.parametrize("ctx,n,window", [(3000, 1, None), (3000, 4, 37)])
def test_sinks_long_context_split(op, ctx, n, window):
    """Sinks where a long context is split into chunks (2 threads) and merged: one normalization."""
    args = make_batch([(n, ctx)], 8, 2, 64, 16, torch.float16, seed=ctx + n + 1)
    sinks = torch.linspace(-2.0, 6.0, 8)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = op(*args, 0.125, window or 0, 0.0, sinks)
            assert (out.double() - fp64_attention(*args, 0.125, window, sinks=sinks)).abs().max() <= 2e-5
    finally:
        torch.set_num_threads(before)


def test_bad_sinks_raise(op):
    args = make_batch([(1, 20)], 4, 2, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match=r"sinks must be float32 \[H\]"):
        op(*args, 0.125, 0, 0.0, torch.zeros(3))


@pytest.mark.parametrize("window,softcap", [(37, None), (None, 50.0), (37, 50.0), (None, None)])
def test_torch_attention_fresh_prompt(window, softcap):
    """localllm's CPU attention backend on a fresh 100-token prompt (the SDPA path's case without
    window and cap) next to a 20-row extend after a cached prefix: dense fp64 attention over what it
    wrote to the cache."""
    from localllm.model.attention import SDPA_MIN_TOKENS, AttnMeta, torch_attention

    g = torch.Generator().manual_seed(5)
    H, kvh, D, bs, specs = 8, 2, 64, 16, [(100, 100), (20, 60)]
    assert specs[0][0] >= SDPA_MIN_TOKENS
    nblk = [-(-c // bs) for _, c in specs]
    tables = torch.arange(sum(nblk)).flip(0).split(nblk)
    tables = torch.stack([torch.cat([t, t.new_zeros(max(nblk) - len(t))]) for t in tables])
    k_cache = torch.randn(sum(nblk), bs, kvh, D, generator=g).half()  # the extend's cached prefix
    v_cache = torch.randn(sum(nblk), bs, kvh, D, generator=g).half()
    T = sum(n for n, _ in specs)
    q, k, v = (torch.randn(T, h, D, generator=g) * 2 for h in (H, kvh, kvh))
    slots = torch.cat([tables[b, torch.arange(c - n, c) // bs] * bs + torch.arange(c - n, c) % bs
                       for b, (n, c) in enumerate(specs)])
    meta = AttnMeta(slots, tables, torch.tensor([0, 100, 120]), torch.tensor([100, 60]),
                    q_lens=[n for n, _ in specs], ctx_lens=[c for _, c in specs])
    scale = 4 * D ** -0.5 if softcap else D ** -0.5
    out = torch_attention(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
    args = (q, k_cache, v_cache, tables, meta.cu_seqlens_q, meta.context_lens)
    ref = fp64_attention(*args, scale, window, softcap)
    assert (out.view(T, H, D).double() - ref).abs().max() <= (5e-5 if softcap else 1e-5)
    if window or softcap:
        assert (ref - fp64_attention(*args, scale)).abs().max() > 0.1


def test_torch_export(op):
    """torch.export traces the op through its fake implementation, with a dynamic token count."""
    from torch.export import Dim

    args = make_batch([(1, 20), (3, 9)], 9, 3, 64, 16, torch.float32, seed=2)
    T = Dim("T", min=1, max=64)
    ep = torch.export.export(Tiny(), args, dynamic_shapes=({0: T}, None, None, None, None, None), strict=False)
    assert any(n.target is torch.ops.localllm.paged_attention.default for n in ep.graph.nodes)
    assert torch.equal(ep.module()(*args), Tiny()(*args))
    q, k, v, bt, _, _ = args
    other = (torch.randn(7, 9, 64), k, v, bt, torch.tensor([0, 4, 7]), torch.tensor([20, 9]))
    assert torch.equal(ep.module()(*other), Tiny()(*other))


def test_aot_inductor_equals_eager(op, tmp_path):
    """AOTInductor compiles a function calling the op (it runs through the proxy executor) and the
    package, loaded as localllm.model.compiled loads its packages, gives the eager result."""
    args = make_batch([(1, 20), (3, 9)], 9, 3, 64, 16, torch.float16, seed=4)
    ep = torch.export.export(Tiny(), args, strict=False)
    t = time.perf_counter()
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "tiny.pt2"))
    print(f"AOTInductor compile: {time.perf_counter() - t:.1f} s")
    runner = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
    (out,) = runner.boxed_run(list(args))
    torch.testing.assert_close(out, Tiny()(*args), rtol=0, atol=1e-6)


# ---- building and caching ------------------------------------------------------------------


def test_library_key_and_failed_build(monkeypatch, tmp_path, caplog):
    """The cached library is keyed by the CPU's flags (it is built with -march=native) and by the
    flags; a failing compiler makes load() False with a log message and leaves no file behind."""
    monkeypatch.setenv("LOCALLLM_KERNEL_CACHE", str(tmp_path))
    path = cpu_attention.library_path()
    assert path.parent == tmp_path and path.name.startswith("paged_attention-")
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: "x86_64:sse2")
    assert cpu_attention.library_path() != path
    assert cpu_attention.library_path(["-O2"]) != cpu_attention.library_path()
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match="failed"):
        cpu_attention.build(tmp_path / "lib.so")
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="failed"):
        cpu_attention.build(tmp_path / "lib.so")
    with caplog.at_level("WARNING"):
        assert cpu_attention.load.__wrapped__() is False
    assert "paged attention kernel unavailable" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_damaged_library_is_rebuilt(op, tmp_path):
    """A truncated library file in the cache (a crash mid-copy, a full disk) is built again, in a
    fresh process as a real start would (the build there copies the library this process built)."""
    env = {**os.environ, "LOCALLLM_KERNEL_CACHE": str(tmp_path)}
    code = "from localllm_kernels import cpu_attention; print(cpu_attention.library_path())"
    path = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()
    open(path, "wb").write(b"\x7fELF truncated")
    built = cpu_attention.library_path()
    code = textwrap.dedent(f"""
        import shutil, torch
        from localllm_kernels import cpu_attention as ca
        builds = []
        ca.build = lambda out: (builds.append(out), shutil.copyfile({str(built)!r}, out))
        assert ca.load() and len(builds) == 1
        q = torch.ones(1, 2, 16); k = torch.ones(1, 4, 1, 16); t = torch.tensor
        print(ca.paged_attention(q, k, k, t([[0]]), t([0, 1]), t([3]), 1.0).sum().item())
    """)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "32.0"
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(path)]


PORTABLE = {"avx2": "-march=x86-64-v3", "generic": "-march=x86-64"}


@needs_cxx
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 builds")
@pytest.mark.slow  # ~25 s of compiling the kernels for a baseline CPU: `make test-slow`, outside CI's budget
def test_portable_builds(tmp_path):
    """The AVX2 and the plain-loop paths (what CPUs without AVX-512 get from -march=native), each
    built for that baseline (both at once) and run in a fresh process against fp64 (q8_0 caches:
    on the dequantized K/V)."""
    libs = {isa: tmp_path / f"{isa}.so" for isa in PORTABLE}
    base = [f for f in cpu_attention.CXXFLAGS if not f.startswith("-march")]
    with ThreadPoolExecutor(len(PORTABLE)) as pool:
        list(pool.map(lambda isa: cpu_attention.build(libs[isa], [*base, PORTABLE[isa]]), PORTABLE))
    for isa, lib in libs.items():
        code = textwrap.dedent(f"""
            import torch
            from test_cpu_attention import check, make_batch
            torch.ops.load_library({str(lib)!r})
            assert torch.ops.localllm.paged_attention_isa() == {isa!r}
            torch.set_num_threads(2)
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                for specs, H, kvh, D in [([(1, 33), (4, 20), (20, 20), (1, 2000)], 9, 3, 64),
                                         ([(1, 17), (6, 40), (1, 700)], 16, 2, 128)]:
                    args = make_batch(specs, H, kvh, D, 16, dtype)
                    check(torch.ops.localllm.paged_attention(*args, 0.1), args, 0.1)
                    # window (from mid-block) and soft-cap: the masks and the vector tanh of this path
                    check(torch.ops.localllm.paged_attention(*args, 0.1, 21, 5.0), args, 0.1, atol=2e-5,
                          window=21, softcap=5.0)
            from localllm_kernels import kv_quant
            for specs, H, kvh, D in [([(1, 33), (4, 20), (20, 20), (1, 700)], 9, 3, 64), ([(1, 300), (6, 40)], 16, 2, 128)]:
                q, k, v, *rest = make_batch(specs, H, kvh, D, 16, torch.float32)
                args = (q, kv_quant.quantize(k), kv_quant.quantize(v), *rest)
                deq = (q, kv_quant.dequantize(args[1]), kv_quant.dequantize(args[2]), *rest)
                check(torch.ops.localllm.paged_attention(*args, 0.1), deq, 0.1)
                check(torch.ops.localllm.paged_attention(*args, 0.1, 21, 5.0), deq, 0.1, atol=2e-5, window=21,
                      softcap=5.0)
            print("ok")
        """)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (isa, done.stderr[-3000:])
        assert done.stdout.strip() == "ok"
