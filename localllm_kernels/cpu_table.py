"""GGUF token tables and heads in the other block types read in place on CPU
(`localllm_kernels/cpu/gguf_table.cpp`): build, load.

``torch.ops.localllm.gguf_table_gemm(x, blocks, kind)``: x fp32 [M, K] times the matrix held as
the file's blocks of `kind` (uint8 [N, K / block values, block bytes]; Q4_0, Q4_1, Q5_0, Q5_1,
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS) transposed -> fp32 [M, N], each value decoded
exactly to fp32 and fp32 activations and accumulation. ``torch.ops.localllm.gguf_table_rows(blocks,
kind, idx)``: the rows idx, fp32 [n, K], bit-equal to gguf-py's dequantization. Q8_0 tables have
their own kernel (cpu_q8).

Compiled with -march=native once per machine (see cpu_build). Without a working compiler
``load()`` is False and the loader keeps an fp32 copy of the matrix instead. Imports only torch.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch

from . import cpu_build

SOURCE = Path(__file__).parent / "cpu" / "gguf_table.cpp"
CXXFLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w"]
if platform.machine() in ("x86_64", "AMD64"):
    CXXFLAGS.append("-march=native")
KINDS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
VALUES = {k: 32 if k in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL") else 256 for k in KINDS}


def library_path() -> Path:
    return cpu_build.library_path(SOURCE, CXXFLAGS, cpu_build.cpu_flags())


def build(out: Path) -> None:
    cpu_build.build(SOURCE, out, CXXFLAGS)


@functools.cache
def load() -> bool:
    """Make the ops available (building the library on first use); False when it cannot be built."""
    if not cpu_build.load_library(library_path(), build, "CPU GGUF table kernel", "an fp32 copy of the matrix"):
        return False

    @torch.library.register_fake("localllm::gguf_table_gemm")
    def _(x, blocks, kind):  # shapes for torch.export
        return x.new_empty(x.shape[0], blocks.shape[0])

    @torch.library.register_fake("localllm::gguf_table_rows")
    def _(blocks, kind, idx):
        return blocks.new_empty(idx.shape[0], blocks.shape[1] * VALUES[kind], dtype=torch.float32)

    return True
