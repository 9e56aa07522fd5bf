"""Attention over the paged KV cache.

The runner describes a flattened batch once per step (`AttnMeta`); every layer reads it.
Two backends, chosen once at load (`make_attention`), not per call: "torch" (the CPU path: our
C++ paged-attention op, `localllm_kernels.cpu_attention`, reads K/V in place through the block
tables; long fresh prompts use torch's SDPA on their own K/V) and "triton" (our kernels in
`localllm_kernels`; the CUDA path, and on CPU under TRITON_INTERPRET=1 for tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from localllm_kernels import kv_quant
from localllm_kernels.cpu_attention import softmax_with_sinks

# a fresh prompt (no cached prefix) of this many tokens or more attends with torch's SDPA (its
# flash kernel) over its own K/V instead of reading them back through the cache
SDPA_MIN_TOKENS = 64


@dataclass
class AttnMeta:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (-1: skip, Triton only)
    block_tables: torch.Tensor  # [B, W]: cache blocks of each sequence (int64 on CPU, int32 Triton)
    cu_seqlens_q: torch.Tensor  # [B+1]: rows of sequence b are cu[b]:cu[b+1]
    context_lens: torch.Tensor  # [B]: tokens in cache after this step (cached + new)
    decode_only: bool = False  # every sequence has exactly one new token
    # host copies, None inside a captured step (whose shapes must not depend on them)
    q_lens: list[int] | None = None
    ctx_lens: list[int] | None = None
    cached_lens: torch.Tensor | None = None  # [B] int32, the Triton prefill kernel's
    # sequence b -> position ranges [start, end) whose tokens see each other (Gemma 3's images);
    # None: causal everywhere
    spans: dict[int, list[tuple[int, int]]] | None = None

    @classmethod
    def captured(cls, slots: torch.Tensor, block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 context_lens: torch.Tensor) -> AttnMeta:
        """The description a compiled step is traced with: tensors only."""
        return cls(slots, block_tables, cu_seqlens_q, context_lens)

    @property
    def all_cached(self) -> bool:
        """Every sequence has a cached prefix (decode, speculative verify, prefix-hit extend)."""
        return self.q_lens is not None and all(c > n for n, c in zip(self.q_lens, self.ctx_lens))


def describe_batch(block_tables: torch.Tensor, q_lens: list[int], ctx_lens: list[int], block_size: int,
                   backend: str = "torch", device: str | torch.device = "cpu") -> tuple[torch.Tensor, AttnMeta]:
    """(positions of the new tokens, their AttnMeta) for a flattened batch: sequence b has its
    last q_lens[b] of ctx_lens[b] tokens (cached + new) new, its cache blocks in row b of
    `block_tables` (int64 [B, W] on CPU, padded with the null block 0). The runner, the compiled
    step's export, the engine's memory probe and the quantizer all describe batches with this, so
    a slot means the same everywhere. The Triton kernels take int32 descriptions on the device."""
    positions = torch.tensor([p for n, c in zip(q_lens, ctx_lens) for p in range(c - n, c)], dtype=torch.int64)
    # (from a list: repeat_interleave over a tensor of counts took 27 us a decode step here, this 22)
    row = torch.tensor([b for b, n in enumerate(q_lens) for _ in range(n)], dtype=torch.int64)
    slots = block_tables[row, positions // block_size] * block_size + positions % block_size
    cu = torch.tensor([0, *q_lens], dtype=torch.int64).cumsum(0)
    ctx = torch.tensor(ctx_lens, dtype=torch.int64)
    decode_only = all(n == 1 for n in q_lens)
    if backend == "triton":
        meta = AttnMeta(slots.to(device), block_tables.to(device, torch.int32), cu.to(device, torch.int32),
                        ctx.to(device, torch.int32), decode_only, list(q_lens), list(ctx_lens),
                        cached_lens=(ctx - torch.tensor(q_lens)).to(device, torch.int32))
    else:
        meta = AttnMeta(slots, block_tables, cu, ctx, decode_only, list(q_lens), list(ctx_lens))
    return positions.to(device), meta


# --kv-type: the cache's element type by llama.cpp's names (its -ctk/-ctv); q8_0 is held as uint8
# blocks (localllm_kernels.kv_quant). "auto": the loader's choice for the weights (ModelHandle.kv_dtype).
KV_TYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "q8_0": kv_quant.DTYPE}


def kv_cache_dtype(kv_type: str, default: torch.dtype) -> torch.dtype:
    """The cache dtype a --kv-type names ("auto": `default`)."""
    if kv_type == "auto":
        return default
    if kv_type not in KV_TYPES:
        raise ValueError(f"unknown KV cache type {kv_type!r}; choose from auto, {', '.join(KV_TYPES)}")
    return KV_TYPES[kv_type]


def kv_type_name(dtype: torch.dtype) -> str:
    return next(k for k, v in KV_TYPES.items() if v == dtype)


def kv_value_bytes(dtype: torch.dtype) -> float:
    """Bytes one cached value takes (q8_0: 34 per 32)."""
    return kv_quant.BLOCK_BYTES / kv_quant.QK if kv_quant.is_q8_0(dtype) else dtype.itemsize


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., D] as a cache of `cache_dtype` holds them (q8_0: quantized blocks): the one
    conversion every torch-side writer uses."""
    return kv_quant.quantize(x) if kv_quant.is_q8_0(cache_dtype) else x.to(cache_dtype)


def from_cache(rows: torch.Tensor) -> torch.Tensor:
    """Cached rows (q8_0 blocks or floats) -> fp32 [..., D]: the one read every torch-side reader uses."""
    return kv_quant.dequantize(rows) if kv_quant.is_q8_0(rows.dtype) else rows.float()


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """x rounded as the cache holds it, back in `dtype`: what a later read through the cache sees."""
    if kv_quant.is_q8_0(cache_dtype):
        return kv_quant.dequantize(kv_quant.quantize(x)).to(dtype)
    return x.to(cache_dtype).to(dtype)


def torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttnMeta, scale: float, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D]; caches [num_blocks, block_size, KVH, D] (q8_0: uint8 rows of
    D / 32 * 34 bytes). Returns [T, H*D].
    window: a query at position p sees positions > p - window only; softcap: scores become
    softcap * tanh(scores / softcap) before the softmax (Gemma 2); sinks [H] fp32: a logit per query
    head in each softmax's denominator (gpt-oss)."""
    from localllm_kernels.cpu_attention import paged_attention

    T, H, D = q.shape
    kvh = k.shape[1]
    kc, vc = k_cache.view(-1, kvh, k_cache.shape[-1]), v_cache.view(-1, kvh, v_cache.shape[-1])
    kc.index_copy_(0, meta.slot_mapping, to_cache(k, kc.dtype))
    vc.index_copy_(0, meta.slot_mapping, to_cache(v, vc.dtype))
    # With a window or a cap fresh prompts stay on our kernel. Measured at 512 tokens, 8 heads (4 KV
    # heads), D 64/128/256, fp16 cache: the kernel skips the tiles below the window, where SDPA takes
    # a dense band mask: window 128, 1.5-2.3x the kernel's CPU time at 1 thread (3.5-7x its wall
    # time at 2 threads); window >= the prompt, 1.0-1.6x. SDPA cannot cap: an explicit masked
    # softmax costs 1.5-3x the kernel's time at 1 thread (4-17x at 2). SDPA takes no sinks either.
    fresh = [] if meta.q_lens is None or window or softcap or sinks is not None else [
        i for i, (n, c) in enumerate(zip(meta.q_lens, meta.ctx_lens)) if n == c and n >= SDPA_MIN_TOKENS]
    if not fresh:  # the kernel takes fp32 queries (and fp32/fp16/bf16 caches) and returns fp32
        out = paged_attention(q.float(), k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                              scale, window, softcap, sinks)
        return out.reshape(T, H * D).to(q.dtype)
    out = q.new_empty(T, H, D)
    start = 0
    for i, n in enumerate(meta.q_lens):
        rows = slice(start, start + n)
        if i in fresh:
            # K/V rounded as the cache holds them: the same numbers as a read through the cache (a
            # prefix hit or a later chunk). 4-D inputs: with 3-D ones SDPA takes its math path on
            # CPU (4x slower at 512 tokens)
            kk, vv = (as_cached(t[rows], kc.dtype, q.dtype).transpose(0, 1)[None] for t in (k, v))
            o = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], kk, vv, is_causal=True, scale=scale,
                                               enable_gqa=kvh != H)[0]
            out[rows] = o.transpose(0, 1)
        else:
            out[rows] = paged_attention(q[rows].float(), k_cache, v_cache, meta.block_tables[i:i + 1],
                                        meta.cu_seqlens_q.new_tensor([0, n]), meta.context_lens[i:i + 1], scale,
                                        window, softcap)
        start += n
    return out.reshape(T, H * D)


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttnMeta, scale: float, window: int | None = None,
                     softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """As torch_attention, with our Triton kernels (a q8_0 cache: quantized by store_kv, read as
    d * q; the prefill kernel takes the new tokens rounded as the cache holds them)."""
    from localllm_kernels import flash_attn_varlen_paged, paged_decode_attention, store_kv

    T, H, D = q.shape
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if kv_quant.is_q8_0(k_cache) and not meta.decode_only:
        k, v = as_cached(k, k_cache.dtype, q.dtype), as_cached(v, v_cache.dtype, q.dtype)
    if meta.decode_only:
        out = paged_decode_attention(q, k_cache, v_cache, meta.context_lens, meta.block_tables, scale,
                                     window=window, softcap=softcap, sinks=sinks)
    else:
        out = flash_attn_varlen_paged(q, k, v, k_cache, v_cache, meta.cu_seqlens_q, meta.cached_lens,
                                      meta.block_tables, scale, window=window, softcap=softcap, sinks=sinks)
    return out.reshape(T, H * D)


BACKENDS = {"torch": torch_attention, "triton": triton_attention}


def default_backend(device: str) -> str:
    return "triton" if device.startswith("cuda") else "torch"


def make_attention(backend: str):
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose from {', '.join(BACKENDS)}")
    return with_spans(BACKENDS[backend])


def with_spans(attention):
    """A backend that also serves bidirectional spans (`AttnMeta.spans`): the backend stores K/V
    and attends causally; a sequence with spans is then attended again, densely with the mask
    (causal, or both in one span; the window still applies), from the cache. Only prefill chunks
    holding images take this path, so the kernels stay causal-only."""
    def attend(q, k, v, k_cache, v_cache, meta: AttnMeta, scale: float, window: int | None = None,
               softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        out = attention(q, k, v, k_cache, v_cache, meta, scale, window, softcap, sinks)
        if not meta.spans:
            return out
        T, H, D = q.shape
        out = out.view(T, H, D).clone()
        cu = meta.cu_seqlens_q.tolist()
        for b, spans in meta.spans.items():
            rows = slice(cu[b], cu[b + 1])
            out[rows] = span_attention(q[rows], k_cache, v_cache, meta.block_tables[b], meta.ctx_lens[b], spans,
                                       scale, window, softcap, sinks).to(out.dtype)
        return out.view(T, H * D)
    return attend


def span_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, ctx: int,
                   spans: list[tuple[int, int]], scale: float, window: int | None, softcap: float | None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's last q.shape[0] of ctx positions attending over its cached K/V, where a
    query sees a key when the key is not after it or both lie in one span; with a window, only
    keys less than `window` positions before it. -> [n, H, D] float32."""
    n, H, D = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    pos = torch.arange(ctx, device=q.device)
    slots = table.to(q.device).long()[pos // bs] * bs + pos % bs
    row = k_cache.shape[-1]  # D, or a q8_0 row's bytes
    k = from_cache(k_cache.view(-1, kvh, row)[slots]).repeat_interleave(H // kvh, dim=1)  # [ctx, H, D]
    v = from_cache(v_cache.view(-1, kvh, row)[slots]).repeat_interleave(H // kvh, dim=1)
    qp = pos[ctx - n:, None]
    group = torch.full((ctx,), -1, dtype=torch.long, device=q.device)
    for i, (a, e) in enumerate(spans):
        group[a:e] = i
    allowed = (pos[None] <= qp) | ((group[ctx - n:, None] == group[None]) & (group[None] >= 0))
    if window:
        allowed &= qp - pos[None] < window
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", softmax_with_sinks(s, sinks), v)
