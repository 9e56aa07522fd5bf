"""GGUF K-quant and 32-value blocks straight into our CPU layer kernels' layouts
(`localllm_kernels/cpu/gguf_repack.cpp`): build, load, the repacks.

``q4_0_1(parts, rows, k)``: Q4_0 / Q4_1 parts of a fused layer into cpu_int4's layout.
``q4_k(blocks, rows)``: the file's Q4_K blocks, uint8 [N, K / 256, 144] -> cpu_int4's (w, scale records),
what ``cpu_int4.pack_dm`` makes of ``gguf_blocks.decode``'s Q4_K, bit for bit. ``int8(blocks, kind,
bits)``: Q5_K, Q6_K, Q3_K, Q2_K or IQ4_XS blocks -> cpu_int8's (w, records) for values packed with `bits` (the
type's own: nibbles and bit planes, IQ4_XS its 4-bit codebook indices; 8: byte lanes), what
``cpu_int8.pack`` makes of the decoded blocks; ``block32(blocks, kind, bits)`` the same for
Q5_0, Q5_1, IQ4_NL, Q8_0 and MXFP4. One pass over the file's bytes instead of the
torch path's several (its expanded values, fp32 products and reorders), built for this CPU. `rows` (int64, optional):
the source row of each output row (the parts of a fused layer read into one buffer, q/k reordered
on the way). Compiled once per machine
(see cpu_build); without a compiler ``load()`` is False and the loader keeps the torch path.
Imports only torch.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch

from . import cpu_build

SOURCE = Path(__file__).parent / "cpu" / "gguf_repack.cpp"
CXXFLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w"]
if platform.machine() in ("x86_64", "AMD64"):
    # the compiler vectorizes the byte shuffles for this CPU (integer work only: the same bytes
    # everywhere); 1B Q5_K / Q6_K matrices, 2 threads: 1.2-1.33x faster than the portable build
    CXXFLAGS.append("-march=native")
INT8_KINDS = ("Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_XS")  # K-quants on the int8-lane kernel; Q4_K on the int4 one
BLOCK32 = ("Q5_0", "Q5_1", "IQ4_NL", "Q8_0", "MXFP4")  # blocks of 32 values, int8-lane too
KINDS = ("Q4_K", *INT8_KINDS, *BLOCK32)
# the bits of each type's values (IQ4: its codebook indices)
BITS = {"Q5_K": 5, "Q6_K": 6, "Q3_K": 3, "Q2_K": 2, "IQ4_XS": 4, "Q5_0": 5, "Q5_1": 5, "IQ4_NL": 4, "Q8_0": 8,
        "MXFP4": 4}  # (MXFP4: its codebook indices, as IQ4's)
# the zero point gguf_blocks.decode gives each type (what the layer is built with on the torch path)
ZERO = {"Q4_K": 8, "Q5_K": 16, "Q6_K": 32, "Q3_K": 4, "Q2_K": 2, "IQ4_XS": 128, "Q5_0": 16, "Q5_1": 16, "IQ4_NL": 128,
        "Q8_0": 128, "MXFP4": 16}


def library_path() -> Path:
    return cpu_build.library_path(SOURCE, CXXFLAGS, cpu_build.cpu_flags())


def build(out: Path) -> None:
    cpu_build.build(SOURCE, out, CXXFLAGS)


@functools.cache
def load() -> bool:
    """Make the repack ops available (building them on first use); False when they cannot be built."""
    return cpu_build.load_library(library_path(), build, "GGUF repack kernel", "the torch repack")


def q4_0_1(raws: list[torch.Tensor], rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q4_0 / Q4_1 blocks (per part uint8 [n_i, K/32, 18 | 20], the file's bytes) straight
    into cpu_int4's (w, sc) as its `pack_dm` lays them out, sc in fp16 (Q4_0: d alone, the
    symmetric form). rows [N]: the source row (over the parts stacked) of each output row;
    padded here to a multiple of 16."""
    pad = -rows.shape[0] % 16
    if pad:
        rows = torch.cat([rows, rows.new_full((pad,), -1)])
    return torch.ops.localllm.pack_gguf_q4([r.contiguous() for r in raws], rows.to(torch.int64), k)


def q4_k(blocks: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K blocks uint8 [N, K / 256, 144] -> (w uint8 [N/16, K/8, 64], records uint8 [N/16, K/256, 320])."""
    return torch.ops.localllm.q4_k_repack(blocks.contiguous(), rows)


def _planes(kind: str, bits: int) -> int:
    """The layout's bit planes for `kind` packed with `bits` (-1: byte lanes); ValueError for a
    width the type cannot take."""
    allowed = (4,) if kind.startswith("IQ4") or kind == "MXFP4" else tuple(dict.fromkeys((BITS[kind], 8)))  # indices: no bytes
    if bits not in allowed:
        raise ValueError(f"{kind} values pack with {' or '.join(map(str, allowed))} bits, got {bits}")
    return -1 if bits == 8 else max(bits - 4, 0)  # values of 4 bits or fewer: nibbles alone


def int8(blocks: torch.Tensor, kind: str, bits: int, rows: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_K / Q6_K / Q3_K / Q2_K / IQ4_XS blocks uint8 [N, K / 256, block bytes] -> (w, records
    [N/16, K/256, ...]): w [N/16, K/8, 64 + 16 max(bits - 4, 0)] for the type's own `bits` (BITS),
    byte lanes [N/16, K/4, 64] for 8 (not IQ4_XS: its values are codebook indices)."""
    if kind not in INT8_KINDS:
        raise ValueError(f"no int8-lane repack for {kind} (only {', '.join(INT8_KINDS)})")
    return torch.ops.localllm.k_repack(blocks.contiguous(), kind, _planes(kind, bits), rows)


def block32(blocks: torch.Tensor, kind: str, bits: int, rows: torch.Tensor | None = None,
            scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5_0 / Q5_1 / IQ4_NL / Q8_0 / MXFP4 blocks uint8 [N, K / 32, block bytes] -> (w as `int8` lays it
    out, the blocks' fp16 d (and m) [N/16, K/32, 1 | 2, 16]): what cpu_int8.pack makes of the decoded
    blocks where every scale is finite in fp16 (it keeps fp32 scales otherwise; an MXFP4 scale
    fp16 cannot hold comes out NaN here). scales: MXFP4 as gpt-oss's checkpoints hold it, blocks
    [N, K / 32, 16] (byte m: values 2m, 2m + 1) and their E8M0 bytes [N, K / 32] apart."""
    if kind not in BLOCK32:
        raise ValueError(f"no 32-value block repack for {kind} (only {', '.join(BLOCK32)})")
    return torch.ops.localllm.block32_repack(blocks.contiguous(), kind, _planes(kind, bits), rows,
                                             None if scales is None else scales.contiguous())
