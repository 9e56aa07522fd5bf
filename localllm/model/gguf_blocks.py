"""GGUF quantized blocks -> integer weights and per-group fp32 scales, exactly.

Every type here has values W = d * q + m per group of 16 or 32 (or d * (q - zero)), with q an
unsigned integer of at most 8 bits and d, m fp32 numbers that hold the file's products exactly
(an fp16 scale times a 6-bit sub-scale fits fp32's mantissa): rounding d * q + m once gives
gguf-py's `gguf.quants.dequantize` bit for bit (tests/test_gguf_kquants.py). Codebook types map
their 4-bit indices to the codebook's value plus the zero point (`lut` says so: the kernels keep
the indices): IQ4_NL and IQ4_XS their int8 values + 128, MXFP4 (OCP microscaling: E2M1 values,
a power-of-two scale per 32) its doubled values + 16. The K-quants also give their scales as the file keeps them
(`SubScales`: integer sub-scales under fp16 super-scales), which the kernels hold instead of the
fp32 products. The CPU kernels take these as they are (cpu_int4 for 4-bit affine groups of 32,
cpu_int8 for the rest).
Layouts as ggml-quants.c / gguf-py's quants.py define them. Imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localllm_kernels.cpu_int8 import take_bytes

# bytes per block and values per block of each type decoded here
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q2_K": 84, "Q3_K": 110,
               "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ4_NL": 18, "IQ4_XS": 136, "MXFP4": 17}
BLOCK_VALUES = {t: 32 if t in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4") else 256
                for t in BLOCK_BYTES}
# values per scale: the K-quants with 16 sub-blocks of 16 have groups of 16
GROUP = {t: 16 if t in ("Q6_K", "Q3_K", "Q2_K") else 32 for t in BLOCK_BYTES}
# ggml's kvalues_iq4nl: the 16 values of the IQ4 codebook
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# ggml's kvalues_mxfp4: MXFP4's 16 E2M1 values, doubled (its scale is halved to match)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


@dataclass
class SubScales:
    """A K-quant's scales as its blocks hold them: per 256 values a super-scale d (and dmin), per
    group an integer sub-scale sc (and min mn), so that the group's scale is d * sc and its
    offset -dmin * mn (exact in fp32). d and nm (= -dmin) fp32 [N, K / 256] holding fp16 values,
    sc and mn int8 [N, K / group]; nm and mn None for the symmetric types."""

    d: torch.Tensor
    sc: torch.Tensor
    nm: torch.Tensor | None = None
    mn: torch.Tensor | None = None

    @staticmethod
    def cat(parts: list[SubScales]) -> SubScales:
        """Parts of one type, their rows stacked."""
        def cat(ts):
            return None if ts[0] is None else torch.cat(ts)
        return SubScales(*(cat([getattr(p, f) for p in parts]) for f in ("d", "sc", "nm", "mn")))

    def packed(self) -> tuple:
        """(d, sc, nm, mn): what the kernels' packers (group_scales.pack) take."""
        return self.d, self.sc, self.nm, self.mn

    def rows(self, idx: torch.Tensor) -> SubScales:
        return SubScales(self.d[idx], self.sc[idx], *(None if t is None else t[idx] for t in (self.nm, self.mn)))


@dataclass
class Blocks:
    """W [N, K] = d * q + m per group (m None: d * (q - zero)); q uint8 [N, K] below 2**bits,
    d and m fp32 [N, K / group]. sub: the K-quants' own form of d and m; lut: uint8 [16], set
    where every q is one of these 16 values (a codebook's entries + 128: 4-bit indices hold them)."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    group: int
    bits: int
    zero: int
    sub: SubScales | None = None
    lut: torch.Tensor | None = None

    def values(self) -> torch.Tensor:
        """fp32 [N, K], rounded once from the exact d * q + m."""
        n, k = self.q.shape
        q = self.q.double().view(n, -1, self.group)
        d = self.d.double().unsqueeze(-1)
        v = d * (q - self.zero) if self.m is None else d * q + self.m.double().unsqueeze(-1)
        return v.float().reshape(n, k)

    def rows(self, idx: torch.Tensor) -> Blocks:
        return Blocks(self.q[idx], self.d[idx], None if self.m is None else self.m[idx], self.group, self.bits,
                      self.zero, None if self.sub is None else self.sub.rows(idx), self.lut)


# the zero point of the types whose values are d * (q - zero); the others carry offsets m
ZERO = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128, "IQ4_NL": 128, "IQ4_XS": 128, "Q6_K": 32, "Q3_K": 4, "MXFP4": 16}


# types whose scales the kernels hold in the file's own form (SubScales) and the codebook types
SUB_SCALES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
CODEBOOK = ("IQ4_NL", "IQ4_XS", "MXFP4")


def stack_key(kind: str) -> tuple[int | str, ...]:
    """Types with the same key stack into one int8-lane matrix at their own bytes per weight (one
    group size, one zero point or offsets for all); stacking others would widen some of them
    (32-groups split into 16s, offsets -zero * d stored for a part that has none, fp32 products
    for the K-quants' sub-scales, bytes for a codebook's indices): those stack with their own type."""
    if kind in SUB_SCALES or kind in CODEBOOK:
        return (kind,)
    return GROUP[kind], ZERO.get(kind, "offsets")


def supported(kind: str) -> bool:
    return kind in BLOCK_BYTES


def _f16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian fp16 -> fp32 [...]."""
    return b.contiguous().view(torch.float16).float().squeeze(-1)


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> [..., 2n]: the low nibbles, then the high ones."""
    return torch.cat([b & 15, b >> 4], dim=-1)


def _bits(b: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """uint8 [..., n] -> [..., len(shifts), n]: (b >> s) & mask for each shift."""
    return torch.stack([(b >> s) & mask for s in shifts], dim=-2)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of packed 6-bit scales and mins -> (sc, mn) uint8 [..., 8]."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def decode(kind: str, raw: torch.Tensor) -> Blocks:
    """One matrix's blocks, uint8 [N, K / block values, block bytes] (the file's bytes) -> Blocks."""
    if kind not in BLOCK_BYTES:
        raise ValueError(f"GGUF type {kind} has no exact integer decoding here")
    n, nb, size = raw.shape
    if size != BLOCK_BYTES[kind]:
        raise ValueError(f"{kind} blocks have {BLOCK_BYTES[kind]} bytes, got {size}")
    k = nb * BLOCK_VALUES[kind]
    b = raw
    if kind == "MXFP4":
        # doubled E2M1 values (-12..12) + 16, the kernels keeping the 4-bit indices (`lut`). d: the
        # E8M0 byte e as 2^(e - 128) (ggml's e8m0_to_fp32_half, subnormal for e < 2), exact in fp32
        # whatever e is.
        e = b[..., 0].to(torch.int32)
        d = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e), (e - 1) << 23)
        lut = mxfp4_lut()
        q = take_bytes(_codebook(lut), _nibbles(b[..., 1:]))
        return Blocks(q.reshape(n, k), d.view(torch.float32), None, 32, 5, 16, lut=lut)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"):
        d = _f16(b[..., 0:2])  # [N, nb]
        if kind == "Q8_0":
            q = b[..., 2:] ^ 0x80  # int8 + 128
            return Blocks(q.reshape(n, k), d, None, 32, 8, 128)
        if kind == "IQ4_NL":
            lut = iq4_lut()
            q = take_bytes(_codebook(lut), _nibbles(b[..., 2:]))
            return Blocks(q.reshape(n, k), d, None, 32, 8, 128, lut=lut)
        if kind in ("Q4_0", "Q4_1"):
            q = _nibbles(b[..., size - 16:]).reshape(n, k)
            if kind == "Q4_0":
                return Blocks(q, d, None, 32, 4, 8)
            return Blocks(q, d, _f16(b[..., 2:4]), 32, 4, 8)
        # Q5_0 / Q5_1: the fifth bit of value i is bit i of the 32-bit qh
        off = 2 if kind == "Q5_0" else 4
        qh = b[..., off:off + 4]
        high = _bits(qh, list(range(8)), 1).transpose(-1, -2).reshape(n, nb, 32)  # bit j of byte i -> 8i + j
        q = (_nibbles(b[..., off + 4:]) | (high << 4)).reshape(n, k)
        if kind == "Q5_0":
            return Blocks(q, d, None, 32, 5, 16)
        return Blocks(q, d, _f16(b[..., 2:4]), 32, 5, 16)
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2]).unsqueeze(-1), _f16(b[..., 2:4]).unsqueeze(-1)
        sc, mn = _k_scales(b[..., 4:16])
        D, M = (d * sc.float()).reshape(n, -1), (-(dmin * mn.float())).reshape(n, -1)
        sub = SubScales(d.reshape(n, nb), sc.reshape(n, -1).view(torch.int8), -dmin.reshape(n, nb),
                        mn.reshape(n, -1).view(torch.int8))
        qs = b[..., size - 128:].reshape(n, nb, 4, 32)  # 64 values per 32 bytes: low nibbles, then high
        q = torch.stack([qs & 15, qs >> 4], dim=3).reshape(n, nb, 8, 32)
        if kind == "Q4_K":
            return Blocks(q.reshape(n, k), D, M, 32, 4, 8, sub)
        qh = b[..., 16:48]  # bit j of byte i: the fifth bit of value i of sub-block j
        q = q | (_bits(qh, list(range(8)), 1) << 4)
        return Blocks(q.reshape(n, k), D, M, 32, 5, 16, sub)
    if kind == "Q6_K":
        ql, qh = b[..., 0:128].reshape(n, nb, 2, 64), b[..., 128:192].reshape(n, nb, 2, 32)
        lo = torch.stack([ql & 15, ql >> 4], dim=3).reshape(n, nb, 2, 4, 32)
        hi = _bits(qh, [0, 2, 4, 6], 3)  # [n, nb, 2, 4, 32]
        q = (lo | (hi << 4)).reshape(n, k)
        sc = b[..., 192:208].contiguous().view(torch.int8)  # [n, nb, 16]
        d = _f16(b[..., 208:210])
        D = (d.unsqueeze(-1) * sc.float()).reshape(n, -1)
        return Blocks(q, D, None, 16, 6, 32, SubScales(d.reshape(n, nb), sc.reshape(n, -1)))
    if kind == "Q3_K":
        hmask, qs, s = b[..., 0:32], b[..., 32:96].reshape(n, nb, 2, 32), b[..., 96:108]
        lsc = _bits(s[..., 0:8], [0, 4], 15).reshape(n, nb, 16)
        hsc = _bits(s[..., 8:12], [0, 2, 4, 6], 3).reshape(n, nb, 16)
        sc = (lsc | (hsc << 4)).to(torch.int16) - 32
        d = _f16(b[..., 108:110])
        D = (d.unsqueeze(-1) * sc.float()).reshape(n, -1)
        sub = SubScales(d.reshape(n, nb), sc.to(torch.int8).reshape(n, -1))
        lo = _bits(qs, [0, 2, 4, 6], 3).reshape(n, nb, 8, 32)
        hi = _bits(hmask, list(range(8)), 1)  # [n, nb, 8, 32]; a set bit: no -4
        q = lo + (hi << 2)  # (lo - 4 * (1 - hi)) + 4
        return Blocks(q.reshape(n, k), D, None, 16, 3, 4, sub)
    if kind == "Q2_K":
        s, qs = b[..., 0:16], b[..., 16:80].reshape(n, nb, 2, 32)
        d, dmin = _f16(b[..., 80:82]).unsqueeze(-1), _f16(b[..., 82:84]).unsqueeze(-1)
        D, M = (d * (s & 15).float()).reshape(n, -1), (-(dmin * (s >> 4).float())).reshape(n, -1)
        q = _bits(qs, [0, 2, 4, 6], 3).reshape(n, k)
        sub = SubScales(d.reshape(n, nb), (s & 15).reshape(n, -1).view(torch.int8), -dmin.reshape(n, nb),
                        (s >> 4).reshape(n, -1).view(torch.int8))
        return Blocks(q, D, M, 16, 2, 2, sub)
    # IQ4_XS: 8 sub-blocks of 32 with 6-bit signed scales, values from the IQ4 codebook
    d = _f16(b[..., 0:2]).unsqueeze(-1)
    sh = b[..., 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # [n, nb, 1]
    hsc = torch.stack([(sh >> (2 * i)) & 3 for i in range(8)], dim=-1).reshape(n, nb, 8)
    lsc = _bits(b[..., 4:8], [0, 4], 15).transpose(-1, -2).reshape(n, nb, 8)  # byte i: 2i (low), 2i+1
    sc = (lsc.to(torch.int32) | (hsc << 4)) - 32
    D = (d * sc.float()).reshape(n, -1)
    lut = iq4_lut()
    qs = b[..., 8:136].reshape(n, nb, 8, 16)
    q = take_bytes(_codebook(lut), _nibbles(qs))
    sub = SubScales(d.reshape(n, nb), sc.to(torch.int8).reshape(n, -1))
    return Blocks(q.reshape(n, k), D, None, 32, 8, 128, sub, lut)


def _codebook(lut: torch.Tensor) -> torch.Tensor:
    """`lut` as a 256-entry byte table (4-bit indices in, values out) for take_bytes."""
    return torch.cat([lut, lut.new_zeros(256 - len(lut))])


def iq4_lut() -> torch.Tensor:
    """The IQ4 codebook's values + 128, uint8 [16] (what q holds for IQ4_NL / IQ4_XS)."""
    return (torch.tensor(IQ4_VALUES, dtype=torch.int16) + 128).to(torch.uint8)


def mxfp4_lut() -> torch.Tensor:
    """MXFP4's doubled values + 16, uint8 [16] (the 5-bit q its 4-bit indices stand for)."""
    return (torch.tensor(MXFP4_VALUES, dtype=torch.int16) + 16).to(torch.uint8)


def cpu_bytes_per_value(kind: str) -> float:
    """Bytes per weight of a matrix of this type as the CPU loader holds it: the int4 layout
    (Q4_0 / Q4_1 / Q4_K) or the int8-lane kernel's (nibbles plus a plane per bit above 4, 4-bit
    indices for the codebook types, bytes for 8-bit values; on CPUs without AVX2 Q6_K takes
    bytes, 0.25 more than counted here: cpu_int8.preferred_bits), plus the scales: the file's fp16 d (and m) per group, or for
    the K-quants their records of fp16 super-scales and int8 sub-scales (localllm_kernels/group_scales.py:
    (32 + 16 * 256 / group) bytes per 16 rows and 256 values, twice that with offsets). Other
    types: fp32 values."""
    if kind in ("F16", "BF16"):  # kept as stored on cpu_bf16's kernel (N padded to 32 rows)
        return 2.0
    if kind not in BLOCK_BYTES:
        return 4.0
    bits = {"Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q3_K": 3, "Q2_K": 2, "Q8_0": 8}.get(kind, 4)
    values = 1.0 if bits > 6 else 0.5 + max(bits - 4, 0) / 8
    offsets = kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q2_K")
    if kind in SUB_SCALES:
        return values + (32 + 16 * 256 // GROUP[kind]) * (1 + offsets) / (16 * 256)
    return values + 2 * (1 + offsets) / GROUP[kind]
