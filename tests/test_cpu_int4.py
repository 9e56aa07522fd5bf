"""The CPU int4 kernels: ours (AVX-512 VNNI or AVX2, localllm_kernels.cpu_int4) and torch's
fallback, each against an fp64 reference; the int4 layer's dense prefill path; the LM head's
candidate search."""

import pytest
import torch

from localllm.model import layers
from localllm.model.int4 import Int4Weight, quantize_rtn
from localllm.model.layers import Int4Linear, top_indices
from localllm_kernels import cpu_int4, cpu_repack

needs_kernel = pytest.mark.skipif(not cpu_int4.supported(), reason="this CPU has no AVX2 (with FMA and F16C)")


@pytest.fixture(params=["auto", "avx2"])
def isa(request):
    """The instruction set the kernel picks for this CPU, and its AVX2 path forced (on a CPU with
    AVX-512 VNNI the two differ; without, both are AVX2)."""
    assert cpu_int4.load()
    torch.ops.localllm.int4_isa(request.param == "avx2")
    yield torch.ops.localllm.int4_isa()
    torch.ops.localllm.int4_isa(False)


def rand_weight(n: int, k: int, group: int, fp16_scales: bool, seed: int = 0) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(k // group, n, generator=g) * 0.02 + 1e-3
    mins = torch.randn(k // group, n, generator=g) * 0.05
    if fp16_scales:  # as in GGUF / AWQ / GPTQ files
        scales, mins = scales.half().float(), mins.half().float()
    return Int4Weight(q, scales, mins + 8 * scales, group)


def reference(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    return x.double() @ w.dequantize(torch.float64).t()


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


@needs_kernel
@pytest.mark.parametrize("n,k,group", [(16, 64, 32), (40, 256, 64), (96, 256, 128), (33, 128, 128)])
@pytest.mark.parametrize("m", [1, 3, 5, 17])
@pytest.mark.parametrize("fp16_scales", [True, False])
def test_cpu_int4_kernel_matches_fp64(n, k, group, m, fp16_scales, isa):
    """16-bit activations (two int8 parts): ~50x closer than torch's bf16 path; N is padded to 16 rows."""
    w = rand_weight(n, k, group, fp16_scales, seed=n + k + m)
    qw, qsc = cpu_int4.pack(w.q, w.scales, w.zeros)
    assert qsc.dtype == (torch.float16 if fp16_scales else torch.float32)
    assert qw.shape == ((n + 15) // 16, k // 8, 64)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    x[0, :32] *= 1e-3  # a block far smaller than the rest: per-block scales
    y = cpu_int4.int4_gemm(x, qw, qsc, group)
    assert y.shape == (m, qw.shape[0] * 16)
    assert rel_err(y[:, :n], reference(x, w)) < 2e-4
    assert torch.equal(y[:, n:], torch.zeros_like(y[:, n:]))  # padding rows


@needs_kernel
@pytest.mark.parametrize("m", [1, 6, 13])
def test_eight_bit_activations_are_one_part(m, isa):
    """parts=1 (--act-bits 8): x = e * p0 per 32-block, a relative error near 8-bit rounding's
    (~5e-3: far above the two parts' 2e-4, far below bf16 weights'), the other cases unchanged."""
    w = rand_weight(48, 256, 32, True, seed=m)
    qw, qsc = cpu_int4.pack(w.q, w.scales, w.zeros)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)) * 3
    ref = reference(x, w)
    one, two = cpu_int4.int4_gemm(x, qw, qsc, 32, 1), cpu_int4.int4_gemm(x, qw, qsc, 32)
    assert 1e-3 < rel_err(one[:, :48], ref) < 1.5e-2
    assert rel_err(two[:, :48], ref) < 2e-4
    with pytest.raises(RuntimeError, match="parts must be 1"):
        cpu_int4.int4_gemm(x, qw, qsc, 32, 3)


@needs_kernel
@pytest.mark.parametrize("parts", [2, 1])
def test_avx2_path_equals_the_vnni_path_bit_for_bit(parts):
    """Both paths compute the same exact int32 block sums and the same fp32 steps per output lane
    (the activations' group sums in _mm512_reduce_add_ps's order): equal outputs, for every tile
    edge (VNNI tiles of 6 rows, AVX2 of 3) and both group-size paths. On a CPU without VNNI both
    runs take the AVX2 path."""
    outs = {}
    for avx2 in (False, True):
        torch.ops.localllm.int4_isa(avx2)
        try:
            res = []
            for group, m in [(32, 1), (32, 2), (32, 7), (128, 3), (128, 13), (64, 6)]:
                w = rand_weight(48, 256, group, True, seed=group + m)
                qw, qsc = cpu_int4.pack(w.q, w.scales, w.zeros)
                x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)) * 2
                res.append(cpu_int4.int4_gemm(x, qw, qsc, group, parts))
            outs[torch.ops.localllm.int4_isa()] = res
        finally:
            torch.ops.localllm.int4_isa(False)
    assert len(outs) == (2 if cpu_int4.has_vnni() else 1)
    first, *rest = outs.values()
    for other in rest:
        assert all(torch.equal(a, b) for a, b in zip(first, other))


@needs_kernel
def test_cpu_int4_kernel_edge_inputs():
    assert cpu_int4.load()
    w = rand_weight(32, 64, 32, True)
    qw, qsc = cpu_int4.pack(w.q, w.scales, w.zeros)
    x = torch.zeros(4, 64)
    x[1] = 1e-38  # denormal-scale block: treated as zeros, no inf/nan
    x[2, 5] = 3e4  # one huge value among zeros
    x[3] = torch.linspace(-1, 1, 64)
    y = cpu_int4.int4_gemm(x, qw, qsc, 32)[:, :32]
    assert torch.isfinite(y).all()
    assert torch.equal(y[0], torch.zeros(32))
    ref = reference(x, w)
    assert rel_err(y[2:], ref[2:]) < 2e-4
    assert (y[1].double() - ref[1]).abs().max() < 1e-30
    with pytest.raises(RuntimeError, match="K mismatch"):
        cpu_int4.int4_gemm(torch.zeros(1, 32), qw, qsc, 32)
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_int4.int4_gemm(x.double(), qw, qsc, 32)


@pytest.mark.parametrize("kind", ["cpu_int4", "aten"])
def test_int4_linear_kernels_and_dense_prefill(kind, monkeypatch):
    """Each CPU kind against fp64 (ours with 16-bit activations; torch's within its bf16 rounding), and
    its dense prefill path (from dense_min_rows rows) against its kernel up to summation order."""
    if kind == "cpu_int4" and not cpu_int4.supported():
        pytest.skip("this CPU has no AVX2 (with FMA and F16C)")
    monkeypatch.setattr(layers, "_cpu_int4_kernel", lambda *a: kind == "cpu_int4" and cpu_int4.load())
    w = quantize_rtn(torch.randn(208, 256, generator=torch.Generator().manual_seed(1)) * 0.05, 64)
    lin = Int4Linear(w, torch.float32, dense=True)
    assert lin.kind == kind and lin.dense is not None
    x = torch.randn(lin.dense_min_rows + 8, 256, generator=torch.Generator().manual_seed(2))
    small = torch.cat([lin(x[i:i + 7]) for i in range(0, x.shape[0], 7)])  # kernel calls
    big = lin(x)  # dense path
    ref = reference(x, w)
    tol = 2e-4 if kind == "cpu_int4" else 1e-2
    assert rel_err(small, ref) < tol and rel_err(big, ref) < tol
    torch.testing.assert_close(big, small, rtol=1e-3 if kind == "cpu_int4" else 8e-3, atol=1e-3 if kind == "cpu_int4" else 1e-2)
    again = Int4Linear.from_kernel_tensors(lin.kernel_tensors(), lin.out_features, lin.group_size)
    assert again.kind == kind and torch.equal(again(x[:3]), lin(x[:3]))


def test_kernel_switch_and_failed_build(monkeypatch, tmp_path):
    """cpu_kernel=False (load_model(cpu_kernels=False)) puts a layer on torch's kernel; a compiler
    failure is an error build() reports (load() then falls back to torch's kernel) and leaves no
    partial library behind."""
    w = quantize_rtn(torch.randn(32, 64), 32)
    assert Int4Linear(w, torch.float32, cpu_kernel=False).kind == "aten"
    monkeypatch.setenv("CXX", "false")
    out = tmp_path / "lib.so"
    with pytest.raises(RuntimeError, match="failed"):
        cpu_int4.build(out)
    assert list(tmp_path.iterdir()) == []


@needs_kernel
@pytest.mark.slow  # ~18 s of rebuilding; test_cache_integrity damages a kernel library in CI's run
def test_damaged_library_is_rebuilt(tmp_path):
    """A truncated library file in the cache (a crash mid-copy, a full disk) is built again, in a
    fresh process as a real start would."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "LOCALLLM_KERNEL_CACHE": str(tmp_path)}
    code = "from localllm_kernels import cpu_int4; print(cpu_int4.library_path())"
    path = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()
    open(path, "wb").write(b"\x7fELF truncated")
    code = ("import torch; from localllm_kernels import cpu_int4; assert cpu_int4.load(); "
            "print(cpu_int4.int4_gemm(torch.zeros(1, 32), torch.zeros(1, 4, 64, dtype=torch.uint8), "
            "torch.zeros(1, 1, 2, 16), 32).shape)")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "torch.Size([1, 16])"


def test_top_indices_equals_topk():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 49152, generator=g)
    x[1, 64:96] += 10  # the 32 largest all in one chunk
    x[2, ::1536] += 10  # the 32 largest in 32 different chunks
    for k in (1, 8, 32):
        got = top_indices(x, k)
        want = x.topk(k, dim=-1).indices
        assert got.shape == (3, k)
        assert all(set(got[b].tolist()) == set(want[b].tolist()) for b in range(3))
    assert set(top_indices(x[:, :100], 5)[0].tolist()) == set(x[0, :100].topk(5).indices.tolist())  # narrow


def gguf_blocks(n: int, k: int, q4_1: bool, seed: int, big_d: bool = False) -> tuple[torch.Tensor, Int4Weight]:
    """Random GGUF Q4_0 / Q4_1 blocks (the file's bytes, [n, k/32, 18 | 20]) and the Int4Weight
    they mean, decoded from the format's definition: value i of a block in the low nibble of
    qs[i], value i + 16 in the high nibble; w = d * q + m (Q4_1) or d * (q - 8) (Q4_0)."""
    g = torch.Generator().manual_seed(seed)
    nb = k // 32
    d = (torch.rand(n, nb, generator=g) * (9000 if big_d else 0.02) + 1e-3).half()
    m = (torch.randn(n, nb, generator=g) * 0.05).half()
    qs = torch.randint(0, 256, (n, nb, 16), generator=g, dtype=torch.uint8)
    head = [d.view(torch.uint8).view(n, nb, 2)] + ([m.view(torch.uint8).view(n, nb, 2)] if q4_1 else [])
    raw = torch.cat(head + [qs], dim=-1).contiguous()
    q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, k)
    zeros = (m.float() + 8 * d.float()) if q4_1 else torch.zeros(n, nb)
    return raw, Int4Weight(q, d.float().t().contiguous(), zeros.t().contiguous(), 32)


@needs_kernel
@pytest.mark.parametrize("q4_1", [True, False])
def test_pack_gguf_equals_pack(q4_1):
    """The C++ shuffle from GGUF blocks (cpu_repack.q4_0_1: several parts, rows permuted, N padded)
    gives the bytes `pack` gives from the decoded weight, so the layer computes the same numbers."""
    assert cpu_int4.load() and cpu_repack.load()
    sizes, k = [40, 24, 8], 128
    parts = [gguf_blocks(n, k, q4_1, seed=i) for i, n in enumerate(sizes)]
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(9))
    rows = torch.cat([perm, torch.arange(24) + 40, torch.arange(8) + 64])
    w, sc = cpu_repack.q4_0_1([r for r, _ in parts], rows, k)
    decoded = Int4Weight.cat([parts[0][1].permute_rows(perm), parts[1][1], parts[2][1]])
    want_w, want_sc = (cpu_int4.pack(decoded.q, decoded.scales, decoded.zeros) if q4_1 else
                       cpu_int4.pack_dm(decoded.q, decoded.scales.t(), None))  # Q4_0: d alone
    assert torch.equal(w, want_w) and sc.dtype == want_sc.dtype == torch.float16 and torch.equal(sc, want_sc)
    assert sc.shape[2] == (2 if q4_1 else 1)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_repack.q4_0_1([parts[0][0]], torch.tensor([40]), k)


@needs_kernel
@pytest.mark.parametrize("big_d", [False, True])
def test_q4_0_holds_its_scales_alone(big_d):
    """Q4_0 held as the file holds it (fp16 d per 32, 0.5625 bytes a weight; its d * (q - 8) needs no
    offsets, and d up to fp16's largest, whose -8d overflowed the old fp16 offsets), giving
    the outputs of the old form (d and m = -8d in fp32) bit for bit on both paths."""
    n, k = 32, 256
    raw, decoded = gguf_blocks(n, k, False, seed=3, big_d=big_d)
    assert cpu_repack.load()
    w, sc = cpu_repack.q4_0_1([raw], torch.arange(n), k)
    assert sc.shape == (n // 16, k // 32, 1, 16) and sc.dtype == torch.float16
    assert w.numel() + 2 * sc.numel() == raw.numel()  # the file's bytes
    d = decoded.scales.t().float()
    old_w, old_sc = cpu_int4.pack_dm(decoded.q, d, -8.0 * d)
    assert torch.equal(old_w, w) and old_sc.shape[2] == 2
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(0))
    ref = x.double() @ ((decoded.q.double() - 8) * d.double().repeat_interleave(32, 1)).t()
    try:
        for avx2 in (False, True):
            torch.ops.localllm.int4_isa(avx2)
            for m in (1, 7):
                y = cpu_int4.int4_gemm(x[:m], w, sc, 32)
                assert torch.equal(y, cpu_int4.int4_gemm(x[:m], old_w, old_sc, 32))
                assert ((y.double() - ref[:m]).norm() / ref[:m].norm()).item() < 2e-4
    finally:
        torch.ops.localllm.int4_isa(False)


@needs_kernel
def test_gguf_layers_load_straight_into_the_kernel_layout(gguf_path):
    """The real model's fused qkv (q/k rows reordered for RoPE) and down projection: the direct GGUF
    path builds the same kernel buffers as decoding to Int4Weight and packing."""
    from localllm.model.gguf_weights import GGUFWeights
    from localllm.model.loader import _gguf_q4_linear

    weights = GGUFWeights(gguf_path)
    for names in (["model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                   "model.layers.3.self_attn.v_proj.weight"], ["model.layers.0.mlp.down_proj.weight"]):
        fast = _gguf_q4_linear(weights, names, None)
        slow = Int4Linear(Int4Weight.cat([weights.int4(n) for n in names]), torch.float32)
        assert fast.kind == slow.kind == "cpu_int4"
        assert torch.equal(fast.qw, slow.qw) and torch.equal(fast.qsc, slow.qsc)


def test_rtn_pack_equals_the_torch_route():
    """cpu_int4.rtn_pack (the greedy head's ranking copy in one C++ pass) gives the bytes of the
    torch route it replaced (int4.quantize_rtn, the scale and offset rounded to fp16, pack_dm) on
    rows of every magnitude, constant and zero rows, and a row count that is no multiple of 16."""
    from localllm.model.layers import _ranking_rows

    assert cpu_int4.load()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(37, 96, generator=g) * torch.logspace(-6, 3, 37)[:, None]
    x[3] = 0.0
    x[5] = 1.5
    x[7, :32] = -2.0
    x[9] = -x[9].abs()

    class Rows:
        def rows(self, idx):
            return x[idx]

    w = _ranking_rows(Rows(), 0, x.shape[0])
    want = cpu_int4.pack_dm(w.q, w.scales.t(), w.zeros.t() - 8.0 * w.scales.t())
    got = cpu_int4.rtn_pack(x)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1].float())
    assert got[0].shape == (3, 12, 64) and got[1].shape == (3, 3, 2, 16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_int4.rtn_pack(torch.zeros(4, 40))
