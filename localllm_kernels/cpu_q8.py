"""GGUF Q8_0 matrices read in place on CPU (`localllm_kernels/cpu/q8_0.cpp`): build, load, torch reference.

``torch.ops.localllm.q8_0_gemm(x, blocks)``: x fp32 [M, K] times the matrix held as Q8_0 blocks
(uint8 [N, K/32, 34]: an fp16 scale d, then 32 int8 q; value d * q, exact in fp32) transposed ->
fp32 [M, N]. ``torch.ops.localllm.q8_0_rows(blocks, idx)``: the rows idx of the matrix, fp32 [n, K].

Compiled with -march=native once per machine, as cpu_attention (see cpu_build). Without a working
compiler ``load()`` is False and the loader keeps an fp32 copy of the matrix instead;
``dequantize`` is the torch reference. Imports only torch.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch

from . import cpu_build

SOURCE = Path(__file__).parent / "cpu" / "q8_0.cpp"
CXXFLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w"]
if platform.machine() in ("x86_64", "AMD64"):
    CXXFLAGS.append("-march=native")


def library_path() -> Path:
    return cpu_build.library_path(SOURCE, CXXFLAGS, cpu_build.cpu_flags())


def build(out: Path, flags: list[str] | None = None) -> None:
    """Compile the library into `out` (atomically); RuntimeError when the compiler fails."""
    cpu_build.build(SOURCE, out, flags or CXXFLAGS)


@functools.cache
def load() -> bool:
    """Make the ops available (building the library on first use); False when it cannot be built."""
    if not cpu_build.load_library(library_path(), build, "CPU Q8_0 kernel", "an fp32 copy of the matrix"):
        return False

    @torch.library.register_fake("localllm::q8_0_gemm")
    def _(x, blocks):  # shapes for torch.export
        return x.new_empty(x.shape[0], blocks.shape[0])

    @torch.library.register_fake("localllm::q8_0_rows")
    def _(blocks, idx):
        return blocks.new_empty(idx.shape[0], blocks.shape[1] * 32, dtype=torch.float32)

    return True


def dequantize(blocks: torch.Tensor) -> torch.Tensor:
    """The whole matrix in fp32 [N, K] (torch ops)."""
    n, nb, _ = blocks.shape
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [N, nb, 1]
    q = blocks[..., 2:].contiguous().view(torch.int8).float()  # [N, nb, 32]
    return (d * q).reshape(n, nb * 32)

