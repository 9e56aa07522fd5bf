"""int4_dequantize / int4_matmul against pure-torch pack/dequantize references."""

import pytest
import torch

from localllm_kernels import int4_dequantize, int4_matmul

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q int [N, K] in 0..15 -> uint8 [N, K//2]; byte j = q[:, 2j] | q[:, 2j+1] << 4."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K//2] -> int32 [N, K]."""
    lo = (packed & 0xF).to(torch.int32)
    hi = (packed >> 4).to(torch.int32)
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)


def dequantize_ref(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """w[n, k] = (q[n, k] - 8) * scales[k // g, n] + zeros[k // g, n], computed in fp32, cast to scales' dtype."""
    s = scales.float().repeat_interleave(group_size, 0).t()
    z = zeros.float().repeat_interleave(group_size, 0).t()
    return ((q.float() - 8) * s + z).to(scales.dtype)


def make_weight(n: int, k: int, group_size: int, dtype, gen):
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scales = (torch.rand(k // group_size, n, generator=gen) * 0.02 + 0.005).to(dtype)
    zeros = (torch.randn(k // group_size, n, generator=gen) * 0.01).to(dtype)
    return q, pack_int4(q), scales, zeros


def test_pack_roundtrip():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (5, 12), generator=gen, dtype=torch.int32)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 6)
    assert int(packed[0, 0]) == int(q[0, 0]) | (int(q[0, 1]) << 4)
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_dequantize(group_size, dtype):
    gen = torch.Generator().manual_seed(group_size)
    n, k = 80, 256  # N not a multiple of the tile
    q, packed, scales, zeros = make_weight(n, k, group_size, dtype, gen)
    w = int4_dequantize(packed.to(DEV), scales.to(DEV), zeros.to(DEV), group_size)
    assert w.shape == (n, k) and w.dtype == dtype
    ref = dequantize_ref(q, scales, zeros, group_size)
    # fp32: a few ulp (the kernel uses q*s + (z - 8s)); fp16/bf16: at most one rounding step apart.
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(w.cpu(), ref, **tol)


INT4_CASES = [
    # (M, N, K, group_size, split_k)
    (1, 96, 256, 32, None),
    (5, 64, 256, 128, 1),
    (3, 100, 384, 64, 3),     # split-K with a tile count not divisible by the split
    (33, 72, 128, 32, 2),     # BLOCK_M 64
    (70, 48, 128, 64, None),  # M > 64: dequantize + dense matmul path
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(INT4_CASES)))
def test_int4_matmul(case, dtype):
    m, n, k, g, split_k = INT4_CASES[case]
    gen = torch.Generator().manual_seed(300 + case)
    q, packed, scales, zeros = make_weight(n, k, g, dtype, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    y = int4_matmul(x.to(DEV), packed.to(DEV), scales.to(DEV), zeros.to(DEV), g, split_k=split_k)
    assert y.shape == (m, n) and y.dtype == dtype
    w = dequantize_ref(q, scales, zeros, g)
    if dtype == torch.float32:
        torch.testing.assert_close(y.cpu(), x @ w.t(), rtol=1e-5, atol=1e-5)
    else:  # fp32 accumulation of the same low-precision operands
        ref = x.float() @ w.float().t()
        err = ((y.cpu().float() - ref).norm() / ref.norm()).item()
        assert err < (5e-3 if dtype == torch.float16 else 2e-2)


def test_int4_matmul_leading_dims():
    gen = torch.Generator().manual_seed(1)
    q, packed, scales, zeros = make_weight(64, 128, 32, torch.float32, gen)
    x = torch.randn(2, 3, 128, generator=gen)
    y = int4_matmul(x.to(DEV), packed.to(DEV), scales.to(DEV), zeros.to(DEV), 32)
    assert y.shape == (2, 3, 64)
    torch.testing.assert_close(y.cpu(), x @ dequantize_ref(q, scales, zeros, 32).t(), rtol=1e-5, atol=1e-5)


def test_convention_matches_torch_cpu_int4pack():
    """Same scales/zeros tensors give the same result as torch's CPU int4 kernel."""
    gen = torch.Generator().manual_seed(2)
    n, k, g = 32, 128, 32
    q, packed, scales, zeros = make_weight(n, k, g, torch.float32, gen)
    x = torch.randn(4, k, generator=gen)
    cpu_packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)  # its own tiled layout
    y_cpu = torch._weight_int4pack_mm_for_cpu(x, cpu_packed, g, torch.stack([scales, zeros], -1).contiguous())
    y = int4_matmul(x.to(DEV), packed.to(DEV), scales.to(DEV), zeros.to(DEV), g)
    torch.testing.assert_close(y.cpu(), y_cpu, rtol=1e-4, atol=1e-4)
