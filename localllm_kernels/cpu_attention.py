"""Paged attention on CPU (`localllm_kernels/cpu/paged_attention.cpp`): build, load, and a torch reference.

``paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, window,
softcap, sinks)``: the queries of a flattened batch (q [T, H, D] fp32; rows cu_seqlens_q[b]:cu_seqlens_q[b+1]
belong to sequence b) against the paged KV cache ([num_blocks, block_size, KVH, D], fp32/fp16/bf16, or
q8_0 blocks: uint8 [num_blocks, block_size, KVH, D / 32 * 34], see kv_quant; the new tokens already written), read in place through block_tables [B, max_blocks]. Row i of a sequence
with n rows and context_lens ctx (new tokens included) sits at position ctx - n + i and attends to
positions 0 ..= ctx - n + i; query head h uses KV head h // (H // KVH). Returns [T, H, D] fp32,
accumulated in fp32. D must be a multiple of 16. A window w > 0 (sliding-window layers: Gemma 2/3,
Mistral) limits a query at position p to positions > p - w (the kernel skips the tiles below it);
a softcap c > 0 (Gemma 2) turns each score s = scale * q.k into c * tanh(s / c) before the softmax.
0 (or None) means off for both. sinks (gpt-oss): fp32 [H], a logit per query head that joins each
softmax's denominator as a key with no value would (None: none).

The C++ source is compiled with -march=native once per machine (see cpu_build: the cached library
is keyed by the source, torch, the flags and this CPU's feature flags) and registers
``torch.ops.localllm.paged_attention`` next to int4_gemm. Without a working compiler ``load()`` is
False and ``paged_attention`` runs ``reference`` (gather + SDPA per sequence), same semantics.
Imports only torch.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

from . import cpu_build, kv_quant

SOURCE = Path(__file__).parent / "cpu" / "paged_attention.cpp"
CXXFLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w"]
if platform.machine() in ("x86_64", "AMD64"):
    CXXFLAGS.append("-march=native")  # AVX-512 or AVX2 paths where the CPU has them


def library_path(flags: list[str] | None = None) -> Path:
    return cpu_build.library_path(SOURCE, flags or CXXFLAGS, cpu_build.cpu_flags())


def build(out: Path, flags: list[str] | None = None) -> None:
    """Compile the library into `out` (atomically); RuntimeError when the compiler fails."""
    cpu_build.build(SOURCE, out, flags or CXXFLAGS)


_fake_registered = False


@functools.cache
def load() -> bool:
    """Make torch.ops.localllm.paged_attention available (building it on first use); False when it
    cannot be built here, in which case paged_attention() runs the torch reference."""
    global _fake_registered
    if not cpu_build.load_library(library_path(), build, "CPU paged attention kernel", "gather + SDPA"):
        return False
    if not _fake_registered:
        _fake_registered = True

        @torch.library.register_fake("localllm::paged_attention")
        def _(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, window=0,
              softcap=0.0, sinks=None):  # for torch.export
            return q.new_empty(q.shape, dtype=torch.float32)

    return True


def isa() -> str | None:
    """Which code path the loaded library runs: 'avx512', 'avx2' or 'generic'; None when not loaded."""
    return torch.ops.localllm.paged_attention_isa() if load() else None


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring. Our kernel on CPU tensors when it loads, else `reference`."""
    if q.device.type == "cpu" and load():
        return torch.ops.localllm.paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                                  float(scale), int(window or 0), float(softcap or 0.0), sinks)
    return reference(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, window, softcap, sinks)


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise RuntimeError(f"paged_attention: {msg}")


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
              cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, scale: float, window: int | None = None,
              softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The same attention in plain torch: each sequence's K/V gathered through its block table,
    converted to fp32 (a q8_0 cache dequantized), and SDPA with the causal (and window) mask of its new rows; with a softcap
    or sinks an explicit masked softmax (SDPA can neither cap the scores nor take a sink)."""
    _check(q.dim() == 3 and q.dtype == torch.float32, f"q must be float32 [T, H, D], got {q.dtype} {list(q.shape)}")
    _check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
           "k_cache and v_cache must both be [num_blocks, block_size, KVH, D]")
    _check(k_cache.dtype == v_cache.dtype and k_cache.dtype in (torch.float32, torch.float16, torch.bfloat16,
                                                                 kv_quant.DTYPE),
           "k_cache and v_cache must both be float32, float16, bfloat16 or uint8 (q8_0 blocks)")
    T, H, D = q.shape
    _, bs, kvh, _ = k_cache.shape
    if kv_quant.is_q8_0(k_cache):
        _check(D % 32 == 0 and k_cache.shape[3] == kv_quant.row_bytes(D), "q8_0 cache rows must be D / 32 * 34 bytes")
        k_cache, v_cache = kv_quant.dequantize(k_cache), kv_quant.dequantize(v_cache)
    _check(k_cache.shape[3] == D, "head dim of the cache != q's")
    _check(D > 0 and D % 16 == 0, f"head dim must be a multiple of 16, got {D}")
    _check(kvh > 0 and H % kvh == 0, f"query heads ({H}) must be a multiple of KV heads ({kvh})")
    _check((window or 0) >= 0, f"window must be >= 0 (0: none), got {window}")
    _check((softcap or 0) >= 0, f"softcap must be >= 0 (0: none), got {softcap}")
    _check(all(t.dtype == torch.int64 for t in (block_tables, cu_seqlens_q, context_lens)),
           "block_tables, cu_seqlens_q and context_lens must be int64")
    B = cu_seqlens_q.shape[0] - 1
    _check(context_lens.shape == (B,) and block_tables.dim() == 2 and block_tables.shape[0] == B,
           "context_lens must be [B] and block_tables [B, max_blocks]")
    cu, ctx = cu_seqlens_q.tolist(), context_lens.tolist()
    _check(cu[0] == 0 and cu[-1] == T, f"cu_seqlens_q must run from 0 to T = {T}")
    kc, vc = k_cache.reshape(-1, kvh, D), v_cache.reshape(-1, kvh, D)
    out = torch.empty(T, H, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        start, end, L = cu[b], cu[b + 1], ctx[b]
        n = end - start
        _check(1 <= n <= L <= block_tables.shape[1] * bs, f"sequence {b}: bad query rows / context length")
        pos = torch.arange(L, device=q.device)
        slots = block_tables[b, pos // bs] * bs + pos % bs
        kk = kc[slots].float().transpose(0, 1)[None]  # [1, KVH, L, D]
        vv = vc[slots].float().transpose(0, 1)[None]
        mask = visible_mask(n, L, window, q.device)
        qq = q[start:end].transpose(0, 1)[None]  # [1, H, n, D]
        if softcap or sinks is not None:
            g = H // kvh
            s = torch.einsum("bhgnd,bhld->bhgnl", qq.unflatten(1, (kvh, g)), kk).flatten(1, 2) * scale
            if softcap:
                s = torch.tanh(s / softcap) * softcap
            s = s.masked_fill(~mask, float("-inf"))
            o = torch.einsum("bhgnl,bhld->bhgnd", softmax_with_sinks(s, sinks).unflatten(1, (kvh, g)), vv).flatten(1, 2)
        else:
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=kvh != H)
        out[start:end] = o[0].transpose(0, 1)
    return out


def softmax_with_sinks(s: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax of scores s [..., H, n, L] over L with head h's sink (sinks [H]) as one more logit in
    the denominator, dropped from the result (transformers' gpt-oss eager attention); no sinks: the
    plain softmax."""
    if sinks is None:
        return s.softmax(-1)
    sink = sinks.float().view(-1, 1, 1).expand(*s.shape[:-1], 1)
    return torch.cat([s, sink], dim=-1).softmax(-1)[..., :-1]


def visible_mask(n: int, L: int, window: int | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """[n, L] bool: which of L positions each of the last n rows (row i at position L - n + i) sees:
    the causal ones, and with a window w > 0 only those > its position - w."""
    mask = torch.ones(n, L, dtype=torch.bool, device=device).tril_(diagonal=L - n)
    if window:
        mask.triu_(diagonal=L - n - window + 1)
    return mask
