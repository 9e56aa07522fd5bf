"""Write new tokens' K/V into the paged cache (one program per token); a q8_0 cache (uint8) gets
them quantized exactly as kv_quant.quantize does (llama.cpp's reference rounding)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    # slot -1 marks a padding token (CUDA-graph batches): write nothing.
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        offs_h = tl.arange(0, H_PAD)
        offs_d = tl.arange(0, D_PAD)
        mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        kc = kc_ptr + blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
        vc = vc_ptr + blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
        tl.store(kc, k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(vc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows(x, base, row, offs_b, offs_j, mask):
    # x [H, NB, 32] fp32 -> q8_0 blocks at the byte offsets row [H] from base: d = max|x| / 127,
    # q = roundf(x * (1 / d)), halves away from zero (IEEE divisions: div_rn, as the C++ and torch do)
    amax = tl.max(tl.abs(x), axis=2)
    d = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
    inv = tl.where(d == 0.0, 0.0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), tl.where(d == 0.0, 1.0, d)))
    y = x * inv[:, :, None]
    a = tl.abs(y)
    f = tl.floor(a)
    r = f + tl.where(a - f >= 0.5, 1.0, 0.0)
    r = tl.where(y < 0.0, -r, r)
    qp = (base + row[:, None, None] + (offs_b * 34 + 2)[None, :, None] + offs_j[None, None, :]).to(
        tl.pointer_type(tl.int8))
    tl.store(qp, r.to(tl.int8), mask=mask)
    dp = (base + row[:, None] + (offs_b * 34)[None, :]).to(tl.pointer_type(tl.float16))  # [H, NB]
    tl.store(dp, d.to(tl.float16), mask=tl.max(mask.to(tl.int32), axis=2) > 0)


@triton.jit
def _store_kv_q8_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, NUM_QBLOCKS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, H_PAD: tl.constexpr, B_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        offs_h = tl.arange(0, H_PAD)
        offs_b = tl.arange(0, B_PAD)
        offs_j = tl.arange(0, 32)
        cols = (offs_b[:, None] * 32 + offs_j[None, :])[None, :, :]
        mask = (offs_h[:, None, None] < NUM_KV_HEADS) & (offs_b[None, :, None] < NUM_QBLOCKS) & (offs_j[None, None, :] < 32)
        h3 = offs_h[:, None, None]
        k = tl.load(k_ptr + tok * stride_kt + h3 * stride_kh + cols, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + tok * stride_vt + h3 * stride_vh + cols, mask=mask, other=0.0).to(tl.float32)
        _quantize_rows(k, kc_ptr, blk * stride_kcb + off * stride_kcs + offs_h * stride_kch, offs_b, offs_j, mask)
        _quantize_rows(v, vc_ptr, blk * stride_vcb + off * stride_vcs + offs_h * stride_vch, offs_b, offs_j, mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v [num_tokens, num_kv_heads, head_dim] -> caches [num_blocks, block_size, num_kv_heads, head_dim].

    Token i goes to slot slot_mapping[i] (= block_id * block_size + offset); slot -1 is skipped.
    k/v may be strided views (e.g. slices of a fused qkv projection) as long as head_dim is contiguous.
    uint8 caches [num_blocks, block_size, num_kv_heads, head_dim / 32 * 34] take q8_0 blocks.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim must be contiguous"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    block_size = k_cache.shape[1]
    if k_cache.dtype == torch.uint8:
        assert head_dim % 32 == 0 and k_cache.shape[-1] == head_dim // 32 * 34
        _store_kv_q8_kernel[(num_tokens,)](
            k, v, k_cache, v_cache, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            NUM_KV_HEADS=num_kv_heads, NUM_QBLOCKS=head_dim // 32, BLOCK_SIZE=block_size,
            H_PAD=triton.next_power_of_2(num_kv_heads), B_PAD=triton.next_power_of_2(head_dim // 32),
            num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
        )
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        H_PAD=triton.next_power_of_2(num_kv_heads), D_PAD=triton.next_power_of_2(head_dim),
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
