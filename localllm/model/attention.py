"""Attention over the paged KV cache.

The runner describes a flattened batch once per step (`AttnMeta`); every layer reads it.
Two backends, chosen once at load (`make_attention`), not per call: "torch" (SDPA over K/V
gathered through the block tables; the CPU path) and "triton" (our kernels in
`localllm_kernels`; the CUDA path, and on CPU under TRITON_INTERPRET=1 for tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnMeta:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (-1: skip)
    q_starts: list[int]  # per sequence: first row of its new tokens in the flat batch
    q_lens: list[int]  # per sequence: number of new tokens
    ctx_lens: list[int]  # per sequence: tokens in cache after this step (cached + new)
    decode_only: bool  # every sequence has exactly one new token
    gather: torch.Tensor | None  # [B, Lmax] int64: slots of each sequence's context (padded with 0)
    decode_mask: torch.Tensor | None  # [B, 1, 1, Lmax] bool, None when no padding
    # the Triton backend's description
    cu_seqlens_q: torch.Tensor | None = None  # [B+1] int32
    cached_lens: torch.Tensor | None = None  # [B] int32
    context_lens: torch.Tensor | None = None  # [B] int32
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32


def torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttnMeta, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D]; caches [num_blocks, block_size, KVH, D]. Returns [T, H*D]."""
    T, H, D = q.shape
    kvh = k.shape[1]
    kc, vc = k_cache.view(-1, kvh, D), v_cache.view(-1, kvh, D)
    kc.index_copy_(0, meta.slot_mapping, k.to(kc.dtype))
    vc.index_copy_(0, meta.slot_mapping, v.to(vc.dtype))
    if meta.decode_only:
        B = T
        kk = kc[meta.gather].transpose(1, 2)  # [B, KVH, L, D]
        vv = vc[meta.gather].transpose(1, 2)
        # group the query heads of one KV head as rows: no K/V repeat, and fast in bf16
        qg = q.view(B, kvh, H // kvh, D).to(kk.dtype)
        out = F.scaled_dot_product_attention(qg, kk, vv, attn_mask=meta.decode_mask, scale=scale)
        return out.reshape(B, H * D).to(q.dtype)
    outs = []
    for i, (start, n, ctx) in enumerate(zip(meta.q_starts, meta.q_lens, meta.ctx_lens)):
        qs = q[start:start + n].transpose(0, 1)  # [H, n, D]
        cached = ctx - n
        if cached == 0:
            kk, vv = k[start:start + n], v[start:start + n]
            mask, causal = None, n > 1
        else:
            idx = meta.gather[i, :ctx]
            kk, vv = kc[idx], vc[idx]
            # new token j sits at position cached + j and sees everything up to it
            mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril_(diagonal=cached)
            causal = False
        kk = kk.transpose(0, 1).to(q.dtype)
        vv = vv.transpose(0, 1).to(q.dtype)
        # 4-D inputs: with 3-D ones SDPA takes its math path on CPU (4x slower at 512 tokens)
        out = F.scaled_dot_product_attention(qs[None], kk[None], vv[None], attn_mask=mask, is_causal=causal,
                                             scale=scale, enable_gqa=kvh != H)[0]
        outs.append(out.transpose(0, 1).reshape(n, H * D))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttnMeta, scale: float) -> torch.Tensor:
    from localllm_kernels import flash_attn_varlen_paged, paged_decode_attention, store_kv

    T, H, D = q.shape
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.decode_only:
        out = paged_decode_attention(q, k_cache, v_cache, meta.context_lens, meta.block_tables, scale)
    else:
        out = flash_attn_varlen_paged(q, k, v, k_cache, v_cache, meta.cu_seqlens_q, meta.cached_lens,
                                      meta.block_tables, scale)
    return out.reshape(T, H * D)


BACKENDS = {"torch": torch_attention, "triton": triton_attention}


def default_backend(device: str) -> str:
    return "triton" if device.startswith("cuda") else "torch"


def make_attention(backend: str):
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose from {', '.join(BACKENDS)}")
    return BACKENDS[backend]
