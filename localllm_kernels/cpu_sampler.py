"""The sampler's pass over a row of logits on CPU (`localllm_kernels/cpu/sampler.cpp`): build, load.

``torch.ops.localllm.softmax_top(x, inv_t, span)`` -> (idx, stats): for a fp32 row x, stats =
(max, sum exp((x - max) * inv_t)) and idx the tokens with x >= max - span / inv_t, in index order.
Compiled with -march=native once per machine (see cpu_build); without a working compiler
``load()`` is False and the sampler uses torch ops. Imports only torch.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

from . import cpu_build

SOURCE = Path(__file__).parent / "cpu" / "sampler.cpp"
CXXFLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-w"]
if platform.machine() in ("x86_64", "AMD64"):
    CXXFLAGS.append("-march=native")


def library_path() -> Path:
    return cpu_build.library_path(SOURCE, CXXFLAGS, cpu_build.cpu_flags())


def build(out: Path) -> None:
    cpu_build.build(SOURCE, out, CXXFLAGS)


@functools.cache
def load() -> bool:
    """Make the op available (building the library on first use); False when it cannot be built."""
    return cpu_build.load_library(library_path(), build, "CPU sampler kernel", "torch ops")
