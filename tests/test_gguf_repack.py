"""The C++ repack of GGUF K-quant blocks (localllm_kernels.cpu_repack: Q2_K to Q6_K, IQ4_XS; Q5_0, Q5_1, IQ4_NL, Q8_0,
MXFP4)
against the torch path it replaces at load (gguf_blocks.decode, then cpu_int4.pack_dm /
cpu_int8.pack): the same bytes for every shape class (rows a multiple of 16 or not, one or
several super-blocks, each layout a type has), on blocks of random bytes with finite fp16 scales.
tests/test_gguf_kquants.py checks the loader takes it."""

import functools

import pytest
import torch

from localllm.model import gguf_blocks
from localllm_kernels import cpu_int4, cpu_int8, cpu_repack

SHAPES = [(16, 1), (48, 3), (40, 2), (3, 1)]  # (rows, super-blocks of 256)


def blocks(kind: str, n: int, s: int, seed: int) -> torch.Tensor:
    """Random blocks of `kind` whose fp16 fields are finite (what a quantizer writes)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, s, gguf_blocks.BLOCK_BYTES[kind]), dtype=torch.uint8, generator=g)
    f16 = (torch.randn(n, s, 2, generator=g) * 0.01).half().view(torch.uint8).view(n, s, 4)
    if kind in ("Q4_K", "Q5_K"):
        raw[..., 0:4] = f16  # d, dmin
    elif kind == "Q6_K":
        raw[..., 208:210] = f16[..., 0:2]  # d
    elif kind == "Q3_K":
        raw[..., 108:110] = f16[..., 0:2]
    elif kind == "Q2_K":
        raw[..., 80:84] = f16  # d, dmin
    elif kind == "Q5_1":
        raw[..., 0:4] = f16  # d, m
    elif kind == "MXFP4":  # E8M0 scales 2^-18 .. 2^11: fp16 holds them
        raw[..., 0] = torch.randint(110, 140, (n, s), dtype=torch.uint8, generator=g)
    elif kind in ("Q5_0", "IQ4_NL", "Q8_0"):
        raw[..., 0:2] = f16[..., 0:2]
    else:  # IQ4_XS
        raw[..., 0:2] = f16[..., 0:2]
    return raw


@pytest.mark.parametrize("n,s", SHAPES)
def test_q4_k_repack_equals_the_torch_path(n, s):
    assert cpu_repack.load()
    raw = blocks("Q4_K", n, s, n * 7 + s)
    b = gguf_blocks.decode("Q4_K", raw)
    want = cpu_int4.pack_dm(b.q, b.d, b.m, b.sub.packed())
    got = cpu_repack.q4_k(raw)
    assert all(torch.equal(a, c) for a, c in zip(got, want))
    assert cpu_repack.ZERO["Q4_K"] == b.zero


@pytest.mark.parametrize("kind,bits", [("Q5_K", 5), ("Q5_K", 8), ("Q6_K", 6), ("Q6_K", 8), ("Q3_K", 3), ("Q3_K", 8),
                                       ("Q2_K", 2), ("IQ4_XS", 4)])
@pytest.mark.parametrize("n,s", SHAPES)
def test_int8_lane_repacks_equal_the_torch_path(kind, bits, n, s):
    assert cpu_repack.load()
    raw = blocks(kind, n, s, n * 5 + s + bits)
    b = gguf_blocks.decode(kind, raw)
    want = cpu_int8.pack(b.q, b.d, b.m, b.zero, bits, b.sub.packed(), b.lut)
    got = cpu_repack.int8(raw, kind, bits)
    assert all(torch.equal(a, c) for a, c in zip(got, want))
    assert cpu_repack.ZERO[kind] == b.zero


@pytest.mark.parametrize("bits", [5, 6])
@pytest.mark.parametrize("r,k", [(0, 0), (5, 3), (7, 6), (8, 1), (13, 12), (15, 31)])
def test_five_and_six_bit_values_keep_their_high_bits_as_documented(bits, r, k):
    """int8_gemm.cpp's layouts: per 8 columns a 64-byte nibble record (nibble byte b = 4 (row % 16)
    + k % 4; low nibble (u = 0) for k % 8 < 4), then 6-bit values: 32 bytes whose byte b % 32 holds
    the 2-bit high part at bits 4 (b / 32) + 2u; 5-bit values: 16 bytes whose byte b % 16 holds
    bit 4 at bit 4 (b / 32) + 2u + (b / 16) % 2."""
    q = torch.zeros(16, 32, dtype=torch.uint8)
    q[r, k] = 0b100111 if bits == 6 else 0b10111  # high part 2 or 1, nibble 7
    w, _ = cpu_int8.pack(q, torch.ones(16, 1), None, 32, bits=bits)
    assert w.shape == (1, 4, 64 + 16 * (bits - 4))
    rec = w[0, k // 8]
    b, u = 4 * r + k % 4, int((k % 8) >= 4)
    want = torch.zeros(w.shape[2], dtype=torch.uint8)
    want[b] = 7 << (4 * u)
    if bits == 6:
        want[64 + b % 32] = 2 << (4 * (b // 32) + 2 * u)
    else:
        want[64 + b % 16] = 1 << (4 * (b // 32) + 2 * u + (b // 16) % 2)
    assert torch.equal(rec, want) and not w[0, [c for c in range(4) if c != k // 8]].any()
    unq, _, _ = cpu_int8.unpack(w, torch.ones(1, 1, 1, 16).half(), 16, 32)
    assert torch.equal(unq, q)


@pytest.mark.parametrize("kind,bits", [("Q5_0", 5), ("Q5_0", 8), ("Q5_1", 5), ("IQ4_NL", 4), ("Q8_0", 8), ("MXFP4", 4)])
@pytest.mark.parametrize("n,s", SHAPES)
def test_32_value_block_repacks_equal_the_torch_path(kind, bits, n, s):
    assert cpu_repack.load()
    raw = blocks(kind, n, 3 * s, n * 3 + s + bits)  # 3 blocks of 32 a unit of s: K need not be 256's multiple
    b = gguf_blocks.decode(kind, raw)
    want = cpu_int8.pack(b.q, b.d, b.m, b.zero, bits, None, b.lut)
    got = cpu_repack.block32(raw, kind, bits)
    assert want[1].dtype == torch.float16 and all(torch.equal(a, c) for a, c in zip(got, want))
    assert cpu_repack.ZERO[kind] == b.zero


@pytest.mark.parametrize("rows", [None, "interleaved"])
def test_mxfp4_as_gpt_oss_checkpoints_keep_it(rows):
    """gpt-oss's safetensors hold MXFP4 as 16 bytes a block, byte m holding values 2m and 2m + 1, its E8M0
    scales apart: the repack reads that layout itself (a gate/up stack's interleaved rows reordered as
    it goes) and gives the GGUF blocks' output; the torch path's GGUF copy of it is the blocks."""
    from localllm.model.hf_weights import _gguf_mxfp4

    assert cpu_repack.load()
    raw = blocks("MXFP4", 40, 6, 5)
    codes = torch.cat([raw[..., 1:] & 15, raw[..., 1:] >> 4], dim=-1)  # the 32 values' codes in order
    hf, scales = codes[..., 0::2] | (codes[..., 1::2] << 4), raw[..., 0].contiguous()
    order = None if rows is None else torch.cat([torch.arange(0, 40, 2), torch.arange(1, 40, 2)])
    want = cpu_repack.block32(raw, "MXFP4", 4, order)
    got = cpu_repack.block32(hf, "MXFP4", 4, order, scales)
    assert all(torch.equal(a, c) for a, c in zip(got, want))
    assert torch.equal(_gguf_mxfp4(hf, scales), raw)
    with pytest.raises(RuntimeError, match="scales apart are MXFP4's only"):
        torch.ops.localllm.block32_repack(hf, "IQ4_NL", 0, None, scales)


def test_mxfp4_scales_fp16_cannot_hold_come_out_nan():
    """MXFP4's E8M0 scales span 2^-128 .. 2^127: the repack writes fp16 where that is exact (2^-24
    .. 2^15, subnormals included) and NaN elsewhere, which sends the loader to the torch path and
    its fp32 scales."""
    assert cpu_repack.load()
    raw = torch.zeros(16, 256, 17, dtype=torch.uint8)
    raw[:, :, 0] = torch.arange(256, dtype=torch.uint8)
    raw[:, :, 1:] = 0x77  # value 12 in both nibbles
    _, sc = cpu_repack.block32(raw, "MXFP4", 4)
    e = torch.arange(256) - 128
    want = torch.where((e >= -24) & (e <= 15), torch.ldexp(torch.ones(256), e), torch.nan).half()
    assert sc.shape == (1, 256, 1, 16) and torch.equal(sc[0, :, 0, 0].isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(sc[0, :, 0, 0][ok], want[ok])
    b = gguf_blocks.decode("MXFP4", raw)
    assert cpu_int8.pack(b.q, b.d, b.m, b.zero, 4, lut=b.lut)[1].dtype == torch.float32  # the torch path: fp32


@pytest.mark.parametrize("kind,bits", [("Q4_K", 4), ("Q6_K", 6), ("Q5_K", 8), ("IQ4_XS", 4), ("Q5_0", 5), ("Q8_0", 8),
                                       ("MXFP4", 4)])
@pytest.mark.parametrize("order", ["reversed", "subset of 40", "repeated"])
def test_repacks_take_rows_in_the_order_given(kind, bits, order):
    """`rows` (the loader's q/k order over a fused layer's parts read side by side) gives what the
    repack of the rows gathered first gives, partial last blocks zero-padded; the outputs are
    fully written (left unzeroed where the rows fill whole blocks: reused memory must not show)."""
    raw = blocks(kind, 48, 6 if kind in cpu_repack.BLOCK32 else 2, 11)
    rows = {"reversed": torch.arange(47, -1, -1), "subset of 40": torch.randperm(48)[:40],
            "repeated": torch.tensor([3, 3, 17, 0] * 8)}[order]
    if kind == "Q4_K":
        fn = cpu_repack.q4_k
    else:
        fn = functools.partial(cpu_repack.block32 if kind in cpu_repack.BLOCK32 else cpu_repack.int8, kind=kind,
                               bits=bits)
    want = fn(raw[rows].contiguous())
    for _ in range(3):
        del want
        torch.full((1 << 16,), 255, dtype=torch.uint8).add_(1)  # leave dirty memory behind
        want = fn(raw[rows].contiguous())
        got = fn(raw, rows=rows)
        assert all(torch.equal(a, c) for a, c in zip(got, want))
    with pytest.raises(RuntimeError, match="row 48 is outside the 48 rows given"):
        fn(raw, rows=torch.tensor([0, 48]))


def test_repack_refuses_what_it_does_not_take():
    with pytest.raises(RuntimeError, match=r"uint8 \[N, K / 256, 144\]"):
        cpu_repack.q4_k(torch.zeros(16, 1, 210, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match=r"uint8 \[N, K / 256, 210\]"):
        cpu_repack.int8(torch.zeros(16, 1, 144, dtype=torch.uint8), "Q6_K", 6)
    with pytest.raises(ValueError, match="6 or 8"):
        cpu_repack.int8(torch.zeros(16, 1, 210, dtype=torch.uint8), "Q6_K", 5)
    with pytest.raises(ValueError, match="with 4 bits"):
        cpu_repack.int8(torch.zeros(16, 1, 136, dtype=torch.uint8), "IQ4_XS", 8)
    with pytest.raises(RuntimeError, match=r"uint8 \[N, K / 32, 34\]"):
        cpu_repack.block32(torch.zeros(16, 1, 36, dtype=torch.uint8), "Q8_0", 8)
    with pytest.raises(ValueError, match="IQ4_NL values pack with 4 bits"):
        cpu_repack.block32(torch.zeros(16, 1, 18, dtype=torch.uint8), "IQ4_NL", 8)
    with pytest.raises(ValueError, match="no 32-value block repack for Q4_0"):
        cpu_repack.block32(torch.zeros(16, 1, 18, dtype=torch.uint8), "Q4_0", 4)
    with pytest.raises(ValueError, match="no int8-lane repack for Q8_0"):
        cpu_repack.int8(torch.zeros(16, 1, 34, dtype=torch.uint8), "Q8_0", 8)
    with pytest.raises(RuntimeError, match="1 bit planes or in byte lanes"):
        torch.ops.localllm.k_repack(torch.zeros(16, 1, 176, dtype=torch.uint8), "Q5_K", 2)
    with pytest.raises(RuntimeError, match=r"IQ4_XS packs with 0 bit planes, got -1"):
        torch.ops.localllm.k_repack(torch.zeros(16, 1, 136, dtype=torch.uint8), "IQ4_XS", -1)
