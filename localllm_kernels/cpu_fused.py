"""The fused elementwise ops of a decoder layer on CPU (`localllm_kernels/cpu/fused_ops.cpp`): build and load.

Registers ``torch.ops.localllm.rms_norm``, ``add_rms_norm``, ``rope_store`` (qkv split, per-head
q/k norm, RoPE and the paged-cache write of k and v in one call), ``silu_mul``, ``gelu_tanh_mul``
and ``fused_isa``: fp32 activations, AVX-512, AVX2 or generic loops chosen at run time (the
source checks the CPU itself, so the library is not keyed by the CPU's flags). Without a working
compiler ``load()`` is False and callers keep the torch ops. Imports only torch.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from . import cpu_build

SOURCE = Path(__file__).parent / "cpu" / "fused_ops.cpp"
# -ffp-contract=off: no multiply-add fused where torch rounds twice (RoPE stays bit-exact)
CXXFLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-w"]


def library_path() -> Path:
    return cpu_build.library_path(SOURCE, CXXFLAGS)


def build(out: Path) -> None:
    """Compile the library into `out` (atomically); RuntimeError when the compiler fails."""
    cpu_build.build(SOURCE, out, CXXFLAGS)


@functools.cache
def load() -> bool:
    """Make the ops available (building them on first use); False when they cannot be built here."""
    return cpu_build.load_library(library_path(), build, "CPU fused layer ops", "torch's ops")


def isa(force: str | None = None) -> str:
    """The path the ops take ("avx512", "avx2", "generic"); `force` pins one ("auto": the CPU's best)."""
    if not load():
        raise RuntimeError("the CPU fused layer ops could not be built on this machine")
    return torch.ops.localllm.fused_isa(force)
