"""Flash-decoding over a paged KV cache: one query token per sequence.

Stage 1, grid (batch, kv_head, split): each program takes the GQA group of query heads that
share one KV head (packed into the M dim of tl.dot, padded to 16 rows), walks its slice of the
context through the block table with an fp32 online softmax, and writes a partial output plus
its log-sum-exp (log2 domain). Stage 2, grid (batch, head), merges the splits by LSE rescaling.
With one split stage 1 writes the final output directly and stage 2 is skipped.
The grid depends only on host shapes (batch, heads, num_splits), never on context lengths, so a
launch can be captured in a CUDA graph; splits past a sequence's end exit after writing -inf.
With a sliding window the splits share out the context from the first BLOCK_N tile in the window.
"""

import functools

import torch
import triton
import triton.language as tl

from .flash_attention import _cache_tile, _load_kv, _score_args, _sink_args, _softmax_step, _window_mask


@triton.jit
def _decode_split_kernel(
    q_ptr, kc_ptr, vc_ptr, ctx_ptr, bt_ptr, o_ptr, mid_o_ptr, mid_lse_ptr, sinks_ptr,
    qk_scale, softcap, window,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_bt,
    NUM_HEADS: tl.constexpr, GQA: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PREC: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, Q8: tl.constexpr, SINKS: tl.constexpr,
):
    EVEN_D: tl.constexpr = HEAD_DIM == D_PAD
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    # The query sits at ctx - 1; with a window it sees positions >= ctx - window only.
    first = 0
    if WINDOW:
        first = (tl.maximum(ctx - window, 0) // BLOCK_N) * BLOCK_N
    # Split length rounded up to BLOCK_N so only the very last tile of a sequence is ragged.
    chunk = tl.cdiv(tl.cdiv(ctx - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = first + split * chunk
    end = tl.maximum(tl.minimum(start + chunk, ctx), start)

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    h_mask = offs_h < GQA
    head = kvh * GQA + offs_h
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_PAD], tl.float32)

    bt_row = bt_ptr + b * stride_bt
    kc_head = kc_ptr + kvh * stride_kch
    vc_head = vc_ptr + kvh * stride_vch
    full_end = start + ((end - start) // BLOCK_N) * BLOCK_N
    dt = q_ptr.dtype.element_ty
    for s in range(start, full_end, BLOCK_N):
        j = s + offs_n
        blk = tl.load(bt_row + j // BLOCK_SIZE).to(tl.int64)
        kk = _load_kv(_cache_tile(kc_head, blk * stride_kcb + (j % BLOCK_SIZE) * stride_kcs, offs_d, Q8),
                      j, offs_d, d_mask, False, EVEN_D, Q8, dt)
        vv = _load_kv(_cache_tile(vc_head, blk * stride_vcb + (j % BLOCK_SIZE) * stride_vcs, offs_d, Q8),
                      j, offs_d, d_mask, False, EVEN_D, Q8, dt)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, kk, vv, _window_mask(j[None, :] >= 0, j, ctx - 1, window, WINDOW),
                                      qk_scale, softcap, WINDOW, SOFTCAP, DOT_PREC)
    if full_end < end:
        j = full_end + offs_n
        j_mask = j < end
        blk = tl.load(bt_row + j // BLOCK_SIZE, mask=j_mask, other=0).to(tl.int64)
        kk = _load_kv(_cache_tile(kc_head, blk * stride_kcb + (j % BLOCK_SIZE) * stride_kcs, offs_d, Q8),
                      j_mask, offs_d, d_mask, True, EVEN_D, Q8, dt)
        vv = _load_kv(_cache_tile(vc_head, blk * stride_vcb + (j % BLOCK_SIZE) * stride_vcs, offs_d, Q8),
                      j_mask, offs_d, d_mask, True, EVEN_D, Q8, dt)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, kk, vv, _window_mask(j_mask[None, :], j, ctx - 1, window, WINDOW),
                                      qk_scale, softcap, True, SOFTCAP, DOT_PREC)

    has = l_i > 0.0  # False for empty splits and for context_len 0 (padding rows)
    den = l_i
    if SINKS and NUM_SPLITS == 1:  # (split: the merge adds the sink once)
        den += tl.math.exp2(tl.minimum(tl.load(sinks_ptr + head, mask=h_mask, other=0.0) - m_i, 126.0))
    out = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(o_ptr + b * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    else:
        # mid_o [batch, H, NUM_SPLITS, D_PAD] fp32, mid_lse [batch, H, NUM_SPLITS] fp32, contiguous
        row = (b * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(mid_o_ptr + row[:, None] * D_PAD + offs_d[None, :], out, mask=h_mask[:, None])
        lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + row, lse, mask=h_mask)


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr, mid_lse_ptr, o_ptr, sinks_ptr, stride_ob, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < NUM_SPLITS
    row = (b * NUM_HEADS + h) * NUM_SPLITS + offs_s
    lse = tl.load(mid_lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty (context_len 0) -> zeros
    w = tl.math.exp2(lse - m)
    parts = tl.load(mid_o_ptr + row[:, None] * D_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    den = tl.sum(w, 0)
    if SINKS:  # the head's sink (log2 domain) in the denominator, on the same max
        den += tl.math.exp2(tl.minimum(tl.load(sinks_ptr + h) - m, 126.0))
    out = tl.sum(parts * w[:, None], 0) / tl.where(den > 0.0, den, 1.0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def _num_sms(device: torch.device) -> int:
    # Only used to size split counts; off-GPU (interpreter, meta tensors) any small number works.
    return _cuda_sms(device.index or 0) if device.type == "cuda" else 4


@functools.lru_cache(maxsize=8)
def _cuda_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(batch: int, num_kv_heads: int, device: torch.device,
                       max_context_len: int | None = None) -> int:
    """Enough (batch, kv_head, split) programs for ~2 waves, at most 16 splits, and (when the
    longest context is known) at least ~256 tokens per split."""
    sms = _num_sms(device)
    splits = max(1, min(16, triton.cdiv(2 * sms, max(1, batch * num_kv_heads))))
    if max_context_len is not None:
        splits = max(1, min(splits, triton.cdiv(max_context_len, 256)))
    return splits


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    out: torch.Tensor | None = None,
    max_context_len: int | None = None,
    block_n: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [batch, H, D] (one token per sequence) over context_lens[b] cached tokens.

    k_cache, v_cache [num_blocks, block_size, KVH, D] (or q8_0 blocks: uint8 [.., KVH, D / 32 * 34],
    read as d * q); context_lens int32 [batch] (0 = padding
    row, output zeros); block_tables int32 [batch, max_blocks]. Returns [batch, H, D] in q's
    dtype. num_splits None picks from shapes (and max_context_len if given); fixed per shape,
    so it is safe under CUDA-graph capture. window > 0: the query (at position context_lens[b] - 1)
    sees the last `window` positions only; softcap > 0: scores s become softcap * tanh(s / softcap).
    None or 0: off. sinks [H] (gpt-oss): a logit per query head in each softmax's denominator.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    gqa = num_heads // num_kv_heads
    d_pad = max(16, triton.next_power_of_2(head_dim))
    if num_splits is None:
        if window and max_context_len is not None:  # the keys a query sees
            max_context_len = min(max_context_len, window + 64)
        num_splits = default_num_splits(batch, num_kv_heads, q.device, max_context_len)
    if block_n is None:
        block_n = 32 if q.element_size() > 2 or d_pad > 128 else 64
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits > 1:
        mid_o = torch.empty(batch, num_heads, num_splits, d_pad, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_lse = out  # unused
    sink_t, has_sinks = _sink_args(sinks, context_lens)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, context_lens, block_tables, out, mid_o, mid_lse, sink_t,
        *_score_args(scale, softcap), window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, GQA=gqa, BLOCK_H=max(16, triton.next_power_of_2(gqa)),
        HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n,
        NUM_SPLITS=num_splits, DOT_PREC="tf32x3" if q.dtype == torch.float32 else "tf32",
        WINDOW=bool(window), SOFTCAP=bool(softcap), Q8=k_cache.dtype == torch.uint8, SINKS=has_sinks,
        num_warps=8 if q.element_size() > 2 else 4, num_stages=2,
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            mid_o, mid_lse, out, sink_t, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, D_PAD=d_pad,
            NUM_SPLITS=num_splits, S_PAD=triton.next_power_of_2(num_splits), SINKS=has_sinks,
            num_warps=4 if d_pad >= 128 else 1,
        )
    return out
