"""The CPU GEMM on 16-bit weights (`localllm_kernels/cpu/bf16_gemm.cpp`): build, load, packing.

``torch.ops.localllm.w16_gemm(x, w, bias)``: fp32 x [M, K] times W^T -> fp32 [M, N padded to 32],
W held as bf16 or fp16 (the checkpoint's own values, converted exactly to fp32 in registers),
fp32 activations, fp32 accumulation: the numbers of an fp32 GEMM on the upcast weights up to
summation order, from half the bytes. AVX-512, else AVX2 (F16C), else a scalar path, chosen at
run time (``isa``); the three give the same outputs bit for bit (each output is one FMA chain
over k in order, see the source). Compiled once per machine (see cpu_build); a missing compiler
leaves ``load()`` False. Imports only torch.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from . import cpu_build

SOURCE = Path(__file__).parent / "cpu" / "bf16_gemm.cpp"
ROWS = 32  # output rows per panel: N is padded to a multiple
DTYPES = (torch.bfloat16, torch.float16)
CXXFLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w"]


def library_path() -> Path:
    return cpu_build.library_path(SOURCE, CXXFLAGS)


def build(out: Path) -> None:
    cpu_build.build(SOURCE, out, CXXFLAGS)


@functools.cache
def load() -> bool:
    """Make torch.ops.localllm.w16_gemm available (building it on first use); False when it cannot
    be built (the loader then keeps an fp32 copy of such layers)."""
    if not cpu_build.load_library(library_path(), build, "CPU 16-bit-weight kernel", "an fp32 copy of the layer"):
        return False

    @torch.library.register_fake("localllm::w16_gemm")
    def _(x, w, bias=None):  # shapes for torch.export
        return x.new_empty(x.shape[0], w.shape[0] * ROWS)

    return True


def pack(w: torch.Tensor) -> torch.Tensor:
    """bf16 or fp16 W [N, K] -> the kernel's panels [ceil(N / 32), K, 32] of the same dtype (the
    same values; rows past N are zeros)."""
    if w.dtype not in DTYPES:
        raise TypeError(f"16-bit weights must be bfloat16 or float16, got {w.dtype}")
    n, k = w.shape
    pad = -n % ROWS
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    return w.view(-1, ROWS, k).transpose(1, 2).contiguous()


def unpack(w: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `pack`: W [n, K] in w's dtype."""
    return w.transpose(1, 2).reshape(-1, w.shape[1])[:n]


def pad_bias(bias: torch.Tensor | None, panels: int) -> torch.Tensor | None:
    """fp32 bias [N] -> [32 * panels] (zeros past N), as the kernel takes it."""
    if bias is None:
        return None
    b = bias.float().reshape(-1)
    return torch.cat([b, b.new_zeros(panels * ROWS - b.shape[0])]).contiguous()


def isa(force: str | None = None) -> str:
    """The path the kernel takes on this CPU: "amx" (bf16 weights from 8 rows; else as "avx512"), "avx512", "avx2" or "generic"; `force` one of them
    (tests) or "auto"."""
    return torch.ops.localllm.w16_isa(force)


def w16_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 x [M, K] @ W.T (+ bias) -> fp32 [M, N padded to 32]."""
    return torch.ops.localllm.w16_gemm(x, w, bias)
