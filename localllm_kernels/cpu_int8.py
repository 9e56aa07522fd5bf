"""The CPU GEMM on weights of up to 8 bits in int8 lanes (`localllm_kernels/cpu/int8_gemm.cpp`): build,
load, packing, and the unpacked values.

``torch.ops.localllm.int8w_gemm(x, w, scales, group_size, zero)``: fp32 x [M, K] times W^T ->
fp32 [M, N padded to 16], W = d * q + m per group of 16 or 32 (scales holding d and m), or
d * (q - zero) (scales holding d only); the scales flat per group or, for GGUF's K-quants, the
file's own sub-scales under fp16 super-scales (group_scales); the codebook types (IQ4) as 4-bit
indices (nibbles with zero 128), their values looked up in registers. AVX-512 VNNI, else AVX2, else a scalar path, chosen at
run time (``int8w_isa``); all three give the same outputs bit for bit. Activations are rounded
to 16 bits inside, as in cpu_int4, with one exception: on the AVX2 path, calls of 96 rows or more
on 8-bit weights (Q8_0, the IQ4 codebook), 192 on the other forms, run torch's fp32 GEMM on exactly
dequantized tiles of W (faster there, and fp32-exact; int8_gemm.cpp's dense_gemm says why). Compiled once per machine as
cpu_int4 (see cpu_build); a missing compiler leaves ``load()`` False. Imports only torch.

``torch.ops.localllm.int8w_dequantize(w, scales, group_size, zero)``: W itself, fp32 [N padded to
16, K], the values `dequantize` below gives, in one C++ pass.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from . import cpu_build, group_scales

SOURCE = Path(__file__).parent / "cpu" / "int8_gemm.cpp"
ROWS = 16  # output rows per block: N is padded to a multiple
GROUPS = (16, 32)
# the codebook 4-bit indices with zero point 128 stand for (int8_gemm.cpp's kIq4): ggml's IQ4 values + 128
CODEBOOK = (1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241)
# with zero point 16 (kMx): MXFP4's doubled E2M1 values + 16
MX_CODEBOOK = (16, 17, 18, 19, 20, 22, 24, 28, 16, 15, 14, 13, 12, 10, 8, 4)
CODEBOOKS = {128: CODEBOOK, 16: MX_CODEBOOK}  # zero point -> what nibbles with it index
CXXFLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w"]


def library_path() -> Path:
    return cpu_build.library_path(SOURCE, CXXFLAGS)


def build(out: Path) -> None:
    cpu_build.build(SOURCE, out, CXXFLAGS)


@functools.cache
def load() -> bool:
    """Make torch.ops.localllm.int8w_gemm available (building it on first use); False when it
    cannot be built (the loader then keeps an fp32 copy of such layers)."""
    if not cpu_build.load_library(library_path(), build, "CPU int8-weight kernel", "an fp32 copy of the layer"):
        return False

    @torch.library.register_fake("localllm::int8w_gemm")
    def _(x, w, scales, group_size, zero, parts=2):  # shapes for torch.export
        return x.new_empty(x.shape[0], w.shape[0] * ROWS)

    return True


def fits(n: int, k: int, group_size: int) -> bool:
    return n > 0 and k % 32 == 0 and group_size in GROUPS


def planes_for(bits: int) -> int:
    """The layout for values of `bits` bits: nibbles plus their bits - 4 high bits up to 6 bits
    (0.5-0.75 bytes a weight), byte lanes (-1) for 7 and 8."""
    return max(bits - 4, 0) if bits <= 6 else -1


def preferred_bits(bits: int) -> int:
    """The `bits` to pack values of `bits` bits with on this CPU: their own (the fewest bytes),
    but 6 in byte lanes on the plain-loop path (no AVX2), which rebuilds bytes from the high bits
    one weight at a time. With AVX2, decode streams the weights from memory and nibbles + high
    bits (0.75 bytes a weight) beat byte lanes (1.0): the 135M shapes' 120 Q6_K-like matrices at
    batch 1 on a Zen 3 AVX2 CPU, 1 thread, 8.7 ms against 14.0 with the high bits as two bit
    planes, the form before the 2-bit pairs (with AVX-512: 0.63 against 0.80 at 8192 x 2048).
    Any layout runs on every path."""
    return 8 if bits == 6 and isa() == "generic" else bits


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, zero: int, bits: int = 8,
         sub: tuple | None = None, lut: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q uint8 [N, K] (values < 2**bits), d and m fp32 [N, G] (G = K / group) with W = d * q + m,
    or m None for W = d * (q - zero) -> the kernel's (w, sc [N/16, G, 1 | 2, 16]): w uint8
    [N/16, K/4, 64] (byte lanes) or [N/16, K/8, 64 + 16P] (nibbles and the P high bits: a bit
    plane, or 2-bit pairs; see int8_gemm.cpp), sc in fp16 where that is exact. Rows past N are zero padding.
    sub: (d, sc, -dmin, mn) as group_scales.pack takes them (a K-quant's own sub-scales): sc is
    those records, the file's bytes, in place of d and m. lut: the 16 values q takes, which must
    be CODEBOOKS[zero] (IQ4's with zero 128, MXFP4's with 16): q held as their 4-bit indices."""
    n, k = q.shape
    g = d.shape[1]
    if lut is not None:
        if CODEBOOKS.get(zero) != tuple(lut.tolist()):
            raise ValueError("4-bit codebook indices are for the IQ4 codebook (+128, zero point 128) and "
                             "MXFP4's (+16, zero point 16) only")
        inverse = torch.zeros(256, dtype=torch.uint8)
        for i, v in reversed(list(enumerate(lut.tolist()))):  # a value twice (MXFP4's +-0): its first index
            inverse[v] = i
        q, bits = take_bytes(inverse, q), 4
    pad = -n % ROWS
    parts = [d.float()] if m is None else [d.float(), m.float()]
    q = q.to(torch.uint8)
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        parts = [torch.cat([p, p.new_zeros(pad, g)]) for p in parts]
    nb = (n + pad) // ROWS
    planes = planes_for(bits)
    if planes < 0:
        w = q.view(nb, ROWS, k // 4, 4).permute(0, 2, 1, 3).reshape(nb, k // 4, 64).contiguous()
    else:
        # one copy into the records' order, then uint8 ops only (int32 bit sums over a dim of 8 and
        # the strided reshapes took ~20 s of a 1B Q6_K file's 31 s first load)
        qb = q.view(nb, ROWS, k // 8, 2, 4).permute(0, 2, 3, 1, 4).contiguous()  # [nb, K/8, half, 16 rows, 4]
        recs = [((qb[:, :, 0] & 15) | ((qb[:, :, 1] & 15) << 4)).view(nb, k // 8, 64)]
        if planes == 2:  # 2-bit pairs: byte i, low bits up: lo and hi of nibble byte i, then of 32 + i
            h = (qb >> 4).view(nb, k // 8, 2, 2, 32)  # [.., lo/hi, rows 0-7 / 8-15, nibble byte % 32]
            recs.append(h[:, :, 0, 0] | (h[:, :, 1, 0] << 2) | (h[:, :, 0, 1] << 4) | (h[:, :, 1, 1] << 6))
        if planes == 1:  # byte i: bit 4 of the value at nibble byte b = 32hh + 16ll + i (u: low/high
            # nibble) as its bit 4hh + 2u + ll
            b = ((qb >> 4) & 1).view(nb, k // 8, 2, 2, 2, 16)  # [.., u, hh, ll, i]
            shift = torch.tensor([[[0, 1], [4, 5]], [[2, 3], [6, 7]]], dtype=torch.uint8).view(1, 1, 2, 2, 2, 1)
            recs.append((b << shift).sum((2, 3, 4), dtype=torch.uint8))
        w = torch.cat(recs, dim=2)
    if sub is not None:
        return w, group_scales.pack(*sub, group=k // g)
    sc = torch.stack([p.view(nb, ROWS, g) for p in parts], 1).permute(0, 3, 1, 2).contiguous()
    half = sc.half()
    exact = torch.isfinite(half).all() and torch.equal(half.float(), sc)
    return w, (half if exact else sc)


def take_bytes(table: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """table[q] for a uint8 `table` [256] and uint8 q [..., K] (K even), looked up two bytes at a
    time: one int64 index per pair (a 1B-shape IQ4_XS file's index passes took ~3 s of its first
    load one byte at a time). The pairs' table is built by arithmetic on values, so byte order
    does not matter."""
    a = torch.arange(1 << 16, dtype=torch.int32)
    t = table.to(torch.int32)
    pair = (t[a & 255] | (t[a >> 8] << 8)).to(torch.uint16).view(torch.int16)
    out = pair[q.contiguous().view(torch.uint16).long()]
    return out.view(torch.uint8).view(q.shape)


def unpack(w: torch.Tensor, sc: torch.Tensor, n: int, group: int,
           zero: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The inverse of `pack`: (q uint8 [n, K], d fp32 [n, G], m fp32 [n, G] or None); nibbles with
    zero 128 or 16 are codebook indices (q their values)."""
    nb, kc, rec = w.shape
    records = sc.dtype == torch.uint8  # K-quant sub-scales (group_scales)
    k = sc.shape[1] * (256 if records else group)
    if kc * 4 == k and rec == 64:  # byte lanes
        q = w.view(nb, kc, ROWS, 4).permute(0, 2, 1, 3).reshape(nb * ROWS, k)
    else:
        planes = (rec - 64) // 16
        b = w[..., :64].reshape(nb, kc, ROWS, 4)
        q = torch.stack([b & 15, b >> 4], dim=2)  # [nb, K/8, half, 16, 4]
        if planes == 2:
            pairs = w[..., 64:96].reshape(nb, kc, 1, 1, 32)
            h = (pairs >> torch.tensor([0, 4, 2, 6], dtype=torch.uint8).view(1, 1, 2, 2, 1)) & 3  # [.., lo/hi, rows, 32]
            q = q | (h.reshape(nb, kc, 2, ROWS, 4) << 4)
        if planes == 1:
            bits = w[..., 64:80].reshape(nb, kc, 1, 1, 1, 16)
            shift = torch.tensor([[[0, 1], [4, 5]], [[2, 3], [6, 7]]], dtype=torch.uint8).view(1, 1, 2, 2, 2, 1)
            q = q | (((bits >> shift) & 1).reshape(nb, kc, 2, ROWS, 4) << 4)
        q = q.permute(0, 3, 1, 2, 4).reshape(nb * ROWS, k)
        if planes == 0 and zero in CODEBOOKS:
            q = torch.tensor(CODEBOOKS[zero], dtype=torch.uint8)[q.long()]
    if records:
        d, m = group_scales.unpack(sc, n, group)
        return q[:n], d, m
    s = sc.float().permute(0, 3, 1, 2).reshape(nb * ROWS, sc.shape[1], sc.shape[2])[:n]
    return q[:n], s[..., 0], (s[..., 1] if sc.shape[2] == 2 else None)


def dequantize(w: torch.Tensor, sc: torch.Tensor, n: int, group: int, zero: int) -> torch.Tensor:
    """The weights the kernel multiplies by, fp32 [n, K]: d * q + m (or d * (q - zero)) rounded
    once, as GGUF's dequantizers give them."""
    q, d, m = unpack(w, sc, n, group, zero)
    qd = q.double().view(n, d.shape[1], group)
    if m is None:
        v = d.double().unsqueeze(-1) * (qd - zero)
    else:
        v = d.double().unsqueeze(-1) * qd + m.double().unsqueeze(-1)
    return v.float().reshape(n, -1)


def isa() -> str:
    """The path the kernel takes on this CPU: "avx512_vnni", "avx2" or "generic"."""
    return torch.ops.localllm.int8w_isa()


def int8w_gemm(x: torch.Tensor, w: torch.Tensor, sc: torch.Tensor, group_size: int, zero: int,
               parts: int = 2) -> torch.Tensor:
    """fp32 x [M, K] @ W.T -> fp32 [M, N padded to 16]; parts as cpu_int4.int4_gemm's."""
    return torch.ops.localllm.int8w_gemm(x, w, sc, group_size, zero, parts)
