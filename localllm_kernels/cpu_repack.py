"""GGUF Q4_K and Q6_K blocks straight into our CPU layer kernels' layouts
(`localllm_kernels/cpu/gguf_repack.cpp`): build, load, the two repacks.

``q4_k(blocks)``: the file's Q4_K blocks, uint8 [N, K / 256, 144] -> cpu_int4's (w, scale records),
what ``cpu_int4.pack_dm`` makes of ``gguf_blocks.decode``'s Q4_K, bit for bit. ``q6_k(blocks,
bits)``: Q6_K blocks [N, K / 256, 210] -> cpu_int8's (w, records) for values packed with `bits`
(6: nibbles and two bit planes; 8: byte lanes), what ``cpu_int8.pack`` makes of the decoded
Q6_K. One pass over the file's bytes instead of the torch path's several (its expanded values,
fp32 products and reorders). Compiled once per machine (see cpu_build); without a compiler
``load()`` is False and the loader keeps the torch path. Imports only torch.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from . import cpu_build

SOURCE = Path(__file__).parent / "cpu" / "gguf_repack.cpp"
CXXFLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w"]
KINDS = ("Q4_K", "Q6_K")


def library_path() -> Path:
    return cpu_build.library_path(SOURCE, CXXFLAGS)


def build(out: Path) -> None:
    cpu_build.build(SOURCE, out, CXXFLAGS)


@functools.cache
def load() -> bool:
    """Make the repack ops available (building them on first use); False when they cannot be built."""
    return cpu_build.load_library(library_path(), build, "GGUF repack kernel", "the torch repack")


def q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K blocks uint8 [N, K / 256, 144] -> (w uint8 [N/16, K/8, 64], records uint8 [N/16, K/256, 320])."""
    return torch.ops.localllm.q4_k_repack(blocks.contiguous())


def q6_k(blocks: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K blocks uint8 [N, K / 256, 210] -> (w, records [N/16, K/256, 288]): w [N/16, K/8, 96]
    (bits 6) or byte lanes [N/16, K/4, 64] (bits 8)."""
    if bits not in (6, 8):
        raise ValueError(f"Q6_K values pack with 6 or 8 bits, got {bits}")
    return torch.ops.localllm.q6_k_repack(blocks.contiguous(), 2 if bits == 6 else -1)
