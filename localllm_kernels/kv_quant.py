"""The 8-bit KV cache format (llama.cpp's Q8_0, its `-ctk/-ctv q8_0`): quantize and dequantize in torch.

A q8_0 cache is a uint8 tensor [num_blocks, block_size, KVH, D / 32 * 34]: each head's row of D
values is D / 32 blocks of 34 bytes, an fp16 scale d (little-endian) and 32 int8 q; the value is
d * q (exact in fp32). The dtype says it: a uint8 cache is q8_0 (`is_q8_0`).

Quantization is llama.cpp's reference (quantize_row_q8_0_ref, and gguf-py's): d = max|x| / 127 in
fp32, q = roundf(x * (1 / d)) (halves away from zero), d stored rounded to fp16. Every writer of
the cache (torch_attention, the fused C++ rope_store, the Triton store) produces these bytes
exactly; every reader (the C++ and Triton attention kernels, the SDPA path of fresh prompts)
sees d * q. Imports only torch.
"""

from __future__ import annotations

import torch

QK = 32  # values per block
BLOCK_BYTES = 34  # fp16 scale + 32 int8
DTYPE = torch.uint8  # a cache of this dtype holds q8_0 blocks


def is_q8_0(cache: torch.Tensor | torch.dtype) -> bool:
    return (cache if isinstance(cache, torch.dtype) else cache.dtype) == DTYPE


def row_bytes(head_dim: int) -> int:
    """Bytes of one head's row of `head_dim` values."""
    if head_dim % QK:
        raise ValueError(f"a q8_0 KV cache needs a head dim that is a multiple of {QK}, got {head_dim}")
    return head_dim // QK * BLOCK_BYTES


def head_dim_of(row: int) -> int:
    return row // BLOCK_BYTES * QK


def roundf(y: torch.Tensor) -> torch.Tensor:
    """C's roundf: to the nearest integer, halves away from zero (torch.round rounds them to even).
    y - trunc(y) is exact in fp32, so a half is recognised exactly."""
    t = y.trunc()
    return torch.where((y - t).abs() == 0.5, t + y.sign(), y.round())


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype, taken as fp32) -> uint8 [..., D / 32 * 34]."""
    *lead, D = x.shape
    nb = row_bytes(D) // BLOCK_BYTES
    xb = x.float().reshape(*lead, nb, QK)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = roundf(xb * inv).to(torch.int8)
    out = torch.cat([d.half().view(torch.uint8), q.view(torch.uint8)], dim=-1)  # [..., nb, 34]
    return out.reshape(*lead, nb * BLOCK_BYTES)


def dequantize(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D / 32 * 34] -> fp32 [..., D]: d * q."""
    *lead, R = b.shape
    nb = R // BLOCK_BYTES
    blocks = b.reshape(*lead, nb, BLOCK_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [..., nb, 1]
    q = blocks[..., 2:].contiguous().view(torch.int8).float()
    return (d * q).reshape(*lead, nb * QK)


def cache_shape(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple:
    """The shape of one layer's K (or V) cache of `dtype` (DTYPE: q8_0 rows)."""
    return (num_blocks, block_size, kv_heads, row_bytes(head_dim) if dtype == DTYPE else head_dim)
