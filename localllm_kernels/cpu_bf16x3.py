"""Encoder linears on the CPU's bf16 dot products (`localllm_kernels/cpu/bf16x3_gemm.cpp`): build,
load, packing.

``torch.ops.localllm.bf16x3_gemm(x, w, bias, n, act)``: fp32 x [M, K] times W^T (+ bias, then
"none" or the erf "gelu") -> fp32 [M, n]. On the AMX-BF16 tile unit (``available()``): weights
and activations each split into two bf16 parts (16 significant bits), three exact products per
pair accumulated in fp32, ~1e-5 relative to an fp32 GEMM (or the weights in one part, rounded to
bf16). With AVX512-BF16 alone (``dot_available()``): the weights in one part and the activations
rounded to bf16 too, one VDPBF16PS product, fp32 accumulation. Elsewhere the caller keeps torch's
fp32 linear. Compiled once per machine (see cpu_build). Imports only torch.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from . import cpu_build

SOURCE = Path(__file__).parent / "cpu" / "bf16x3_gemm.cpp"
CXXFLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w"]
ACTS = ("none", "gelu")


def library_path() -> Path:
    return cpu_build.library_path(SOURCE, CXXFLAGS)


def build(out: Path) -> None:
    cpu_build.build(SOURCE, out, CXXFLAGS)


@functools.cache
def load() -> bool:
    """Make the ops available (building them on first use); False when they cannot be built."""
    if not cpu_build.load_library(library_path(), build, "CPU bf16x3 kernel", "torch's fp32 linear"):
        return False

    @torch.library.register_fake("localllm::bf16x3_gemm")
    def _(x, w, bias, n, act):  # shapes for torch.export
        return x.new_empty(x.shape[0], n)

    return True


@functools.cache
def available() -> bool:
    """The kernel loads and this CPU has AMX-BF16 granted to the process."""
    return load() and torch.ops.localllm.bf16x3_available()


@functools.cache
def dot_available() -> bool:
    """The kernel loads and this CPU has AVX512-BF16 (VDPBF16PS): the one-part mode without AMX."""
    return load() and torch.ops.localllm.bf16dot_available()


def split(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 w -> (hi, lo) bf16 with hi = bf16(w), lo = bf16(w - hi) (round to nearest even)."""
    w = w.float()
    hi = w.to(torch.bfloat16)
    return hi, (w - hi.float()).to(torch.bfloat16)


def pack(w: torch.Tensor, parts: int = 2) -> torch.Tensor:
    """fp32 W [N, K] -> [Nt, nkb, parts, 16, 16, 2] bf16: column tiles of 16 outputs (Nt even),
    k-blocks of 32, the (hi, lo) parts (parts=2: fp32-level results) or the weights rounded to
    bf16 (parts=1: two products instead of three, ~3 significant digits of each weight), each
    tile in TDPBF16PS's B layout (k pairs adjacent)."""
    if parts not in (1, 2):
        raise ValueError(f"parts must be 1 or 2, got {parts}")
    n, k = w.shape
    w = torch.nn.functional.pad(w.float(), (0, -k % 32, 0, -n % 32))
    nt, nkb = w.shape[0] // 16, w.shape[1] // 32
    tiles = [p.view(nt, 16, nkb, 16, 2).permute(0, 2, 3, 1, 4) for p in split(w)[:parts]]
    return torch.stack(tiles, dim=2).contiguous()


def pad_bias(bias: torch.Tensor | None, w: torch.Tensor) -> torch.Tensor | None:
    """fp32 bias [N] -> [16 Nt] (zeros past N), as the kernel takes it."""
    if bias is None:
        return None
    b = bias.float().reshape(-1)
    return torch.cat([b, b.new_zeros(w.shape[0] * 16 - b.shape[0])]).contiguous()


def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, n: int, act: str = "none") -> torch.Tensor:
    """fp32 x [M, K] @ W.T (+ bias), then act -> fp32 [M, n] (x split into two bf16 parts; W as
    `pack` holds it)."""
    return torch.ops.localllm.bf16x3_gemm(x, w, bias, n, act)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """The epilogue's erf GELU on its own (tests)."""
    return torch.ops.localllm.bf16x3_gelu(x)
