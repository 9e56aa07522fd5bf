"""The CPU int4 GEMM (`localllm_kernels/cpu/int4_gemm.cpp`, AVX-512 VNNI or AVX2): build, load and weight packing.

The C++ source is compiled once per machine with the system C++ compiler against torch's headers
(~7 s) into a shared library cached under ~/.cache/localllm/kernels (LOCALLLM_KERNEL_CACHE),
keyed by the source, torch and the flags (see cpu_build); it registers
``torch.ops.localllm.int4_gemm`` (and ``moe_int4``, the mixture-of-experts MLP on stacked int4
experts, ``rtn_pack_int4``, ``int4_isa``; the GGUF blocks' repacks into this layout are
cpu_repack's). The kernel runs with AVX-512 VNNI where the CPU has it,
else with AVX2 (same layouts, same results). A CPU without AVX2, FMA and F16C, or a missing
compiler, leaves ``load()`` False and callers on torch's own int4 kernel.
Imports only torch.
"""

from __future__ import annotations

import functools
import platform
import sys
from pathlib import Path

import torch

from . import cpu_build, group_scales
from .cpu_build import cache_dir  # noqa: F401  (where the libraries live)

SOURCE = Path(__file__).parent / "cpu" / "int4_gemm.cpp"
ROWS = 16  # output rows per block: the kernel's N must be a multiple
CPU_FLAGS = ("avx2", "fma", "f16c")  # the AVX2 kernel's; AVX-512 VNNI, where present, is chosen at run time
VNNI_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
CXXFLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w"]


def _cpu_has(flags: tuple[str, ...]) -> bool:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        line = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return False
    return set(flags) <= set(line.split())


def supported() -> bool:
    """This CPU can run the kernel (AVX2 with FMA and F16C at least)."""
    return _cpu_has(CPU_FLAGS)


def library_path() -> Path:
    return cpu_build.library_path(SOURCE, CXXFLAGS)


def build(out: Path) -> None:
    """Compile the library into `out` (atomically: concurrent builders each write their own file)."""
    cpu_build.build(SOURCE, out, CXXFLAGS)


def has_vnni() -> bool:
    """The CPU has AVX-512 VNNI (the kernel's faster path; AVX2 otherwise)."""
    return _cpu_has(CPU_FLAGS + VNNI_FLAGS)


def isa_name() -> str:
    """The instruction set the loaded kernel runs, as people write it ("AVX-512 VNNI" or "AVX2")."""
    return {"avx512_vnni": "AVX-512 VNNI", "avx2": "AVX2"}[torch.ops.localllm.int4_isa()]


@functools.cache
def load() -> bool:
    """Make torch.ops.localllm.int4_gemm available (building it on first use); False when this
    machine cannot have it, in which case callers use torch's int4 kernel."""
    if not supported() or not cpu_build.load_library(library_path(), build, "CPU int4 kernel", "torch's"):
        return False

    @torch.library.register_fake("localllm::int4_gemm")
    def _(x, w, scales, group_size, parts=2):  # shapes for torch.export
        return x.new_empty(x.shape[0], w.shape[0] * ROWS)

    @torch.library.register_fake("localllm::moe_int4")
    def _(x, ids, weights, w1, s1, w2, s2, group1, group2, inter):
        return x.new_empty(x.shape)

    return True


def fits(n: int, k: int, group_size: int) -> bool:
    """Shapes the kernel takes (N is padded to a multiple of 16 by pack)."""
    return k % 32 == 0 and group_size % 32 == 0 and k % group_size == 0 and n > 0


def pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights in the int4 layout of localllm.model.int4 (w = (q - 8) * scales + zeros; q uint8
    [N, K], scales/zeros [G, N]) -> the kernel's (w uint8 [N/16, K/8, 64], sc [N/16, G, 2, 16]
    with w = d * q + m). Scales are kept in fp16 when that is exact (GGUF, AWQ, GPTQ), else fp32.
    Rows past N are zero padding."""
    d = scales.t().float()
    return pack_dm(q, d, zeros.t().float() - 8.0 * d)


def pack_dm(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
            sub: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack` from the kernel's own terms: q uint8 [N, K] (0..15), d and m fp32 [N, G] with
    w = d * q + m (exact for GGUF's Q4_K, whose m = -dmin * min is not (q - 8) * d + zeros); m None:
    w = d * (q - 8) (Q4_0), scales alone in fp16 where exact. sub: (d, sc, -dmin, mn) as
    group_scales.pack takes them (Q4_K's own sub-scales, groups of 32): held as those records, the
    file's bytes, in place of d and m."""
    n, k = q.shape
    g = d.shape[1]
    pad = -n % ROWS
    nb = (n + pad) // ROWS
    qp = torch.cat([q, q.new_zeros(pad, k)]) if pad else q
    qb = qp.to(torch.uint8).view(nb, ROWS, k // 8, 2, 4)
    w = (qb[:, :, :, 0] | (qb[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(nb, k // 8, 64).contiguous()
    if sub is not None:
        return w, group_scales.pack(*sub, group=k // g)
    parts = [d] if m is None else [d, m]
    if pad:
        parts = [torch.cat([t, t.new_zeros(pad, g)]) for t in parts]
    sc = torch.stack([t.view(nb, ROWS, g) for t in parts], 1).permute(0, 3, 1, 2).contiguous()
    half = sc.half()
    exact = torch.isfinite(half).all() and torch.equal(half.float(), sc)
    if m is None and not exact:  # the symmetric form is fp16 only: d and m = -8d in fp32 (exact)
        return pack_dm(q, d, -8.0 * d)
    return w, (half if exact else sc)


def rtn_pack(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 rows x [n, K] -> (w, sc fp32 [ceil(n/16), K/32, 2, 16]): round-to-nearest int4 groups
    of 32 in this layout, scales and offsets rounded to fp16 as the greedy head's ranking copy
    keeps them (localllm.model.layers.ranking_head), the torch route's bytes in one C++ pass."""
    return torch.ops.localllm.rtn_pack_int4(x.float().contiguous())


def unpack(w: torch.Tensor, sc: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `pack_dm`: (q uint8 [n, K], d fp32 [n, G], m fp32 [n, G]; the symmetric
    form's m = -8d)."""
    nb, kc, _ = w.shape
    b = w.view(nb, kc, ROWS, 4).permute(0, 2, 1, 3)  # [nb, 16, K/8, 4]
    q = torch.stack([b & 15, b >> 4], dim=3).reshape(nb * ROWS, kc * 8)[:n]
    if sc.dtype == torch.uint8:  # K-quant records (groups of 32)
        d, m = group_scales.unpack(sc, n, 32)
        return q, d, m
    s = sc.float().permute(0, 3, 1, 2).reshape(nb * ROWS, sc.shape[1], sc.shape[2])[:n]
    return q, s[..., 0], (s[..., 1] if sc.shape[2] == 2 else -8.0 * s[..., 0])


def int4_gemm(x: torch.Tensor, w: torch.Tensor, sc: torch.Tensor, group_size: int, parts: int = 2) -> torch.Tensor:
    """fp32 x [M, K] @ W.T -> fp32 [M, N padded to 16]; parts: the activations' int8 parts (2: ~16
    bits, 1: 8 bits)."""
    return torch.ops.localllm.int4_gemm(x, w, sc, group_size, parts)
