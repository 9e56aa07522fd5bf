"""Varlen prefill / chunked-prefill / prefix-extend attention over a paged KV cache.

FlashAttention-2 structure: one program owns a tile of query rows and streams K/V tiles through
an online softmax kept in fp32 (exp2 domain, scale folded with log2(e)); the score matrix is
never materialised. Per sequence the keys come from two places:
  1. the cached prefix (``cached_lens[i]`` tokens), gathered through the block table, no mask;
  2. the new tokens (contiguous ``k``/``v``), causal, offset by the cached length.
GQA: the query heads sharing one KV head are packed into the M dimension of the tile
(row = token * G_PAD + head-in-group), so each K/V tile is loaded once per group.
The grid is sized from host-known shapes only (no device sync, CUDA-graph friendly): program
``pid`` finds its sequence by binary search over ``cu_seqlens_q // BLOCK_Q + i``.
Sliding window (``window``: a query at position p sees keys > p - window) and score soft-capping
(``softcap``: s -> softcap * tanh(s / softcap)) are constexpr-gated, so kernels without them
compile as before; with a window a tile starts at the first K/V tile any of its rows sees.
A q8_0 cache (uint8 rows of 32-value blocks, an fp16 scale then 32 int8: kv_quant) is read as
d * q (`_load_q8_tile`, constexpr Q8); the new tokens are then passed rounded as it holds them.
"""


import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _load_tile(ptrs, row_mask, d_mask, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    # Only emit the masks that are needed: unmasked loads along head_dim vectorise best.
    if MASK_ROWS:
        if EVEN_D:
            x = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=d_mask[None, :], other=0.0)
    return x


@triton.jit
def _load_q8_tile(rows, row_mask, offs_d, d_mask, MASK_ROWS: tl.constexpr, dtype: tl.constexpr):
    # rows [N]: uint8 pointers to q8_0 rows -> [N, D_PAD] of d * q (exact in fp32), cast to dtype.
    # Column c is byte 2 + c % 32 of block c // 32 (34 bytes: the fp16 scale first)
    blk = (offs_d // 32) * 34
    qp = (rows[:, None] + (blk + 2 + offs_d % 32)[None, :]).to(tl.pointer_type(tl.int8))
    dp = (rows[:, None] + blk[None, :]).to(tl.pointer_type(tl.float16))
    if MASK_ROWS:
        mask = row_mask[:, None] & d_mask[None, :]
    else:
        mask = d_mask[None, :]
    q = tl.load(qp, mask=mask, other=0)
    d = tl.load(dp, mask=mask, other=0.0)
    return (q.to(tl.float32) * d.to(tl.float32)).to(dtype)


@triton.jit
def _load_kv(ptrs_or_rows, row_mask, offs_d, d_mask, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr,
             Q8: tl.constexpr, dtype: tl.constexpr):
    # A K or V tile of the cache: rows [N] of q8_0 blocks (Q8), else element pointers [N, D_PAD]
    if Q8:
        x = _load_q8_tile(ptrs_or_rows, row_mask, offs_d, d_mask, MASK_ROWS, dtype)
    else:
        x = _load_tile(ptrs_or_rows, row_mask, d_mask, MASK_ROWS, EVEN_D)
    return x


@triton.jit
def _cache_tile(head, rows, offs_d, Q8: tl.constexpr):
    # what _load_kv takes for the cache rows at element offsets `rows` [N] from `head`
    if Q8:
        p = head + rows
    else:
        p = head + rows[:, None] + offs_d[None, :]
    return p


@triton.jit
def _window_mask(mask, kpos, qpos, window, WINDOW: tl.constexpr):
    # mask, and (with a window) keys at positions kpos [N] that queries at qpos ([M, 1] or a scalar) see
    if WINDOW:
        mask = mask & (kpos[None, :] > qpos - window)
    return mask


@triton.jit
def _tanh(x):
    # through exp2 (no tanh in every Triton backend); exp2 -> inf / 0 gives +-1 exactly
    return 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _softmax_step(acc, m_i, l_i, q, k, v, mask, qk_scale, softcap, USE_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
                  DOT_PREC: tl.constexpr):
    # One online-softmax step. m_i starts at a finite -1e30, so a row whose keys are all masked
    # keeps alpha = 1 and p = exp2(-inf) = 0: no inf - inf, no NaN. With SOFTCAP, qk_scale is
    # scale / cap and softcap is cap * log2(e) (see _score_args).
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if SOFTCAP:
        qk = _tanh(qk) * softcap
    if USE_MASK:
        qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, o_ptr,
    cu_q_ptr, cached_ptr, bt_ptr, sinks_ptr,
    qk_scale, softcap, window, num_seqs,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_bt,
    GQA: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, Q8: tl.constexpr, SINKS: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // G_PAD  # query tokens per tile
    EVEN_D: tl.constexpr = HEAD_DIM == D_PAD
    pid = tl.program_id(0)
    kvh = tl.program_id(1)

    # Sequence i owns programs [cu_q[i] // BLOCK_Q + i, cu_q[i+1] // BLOCK_Q + i + 1): find the
    # largest i whose first program is <= pid.
    lo = 0
    hi = num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        right = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid <= pid  # one test drives both bounds
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    seq = lo
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    q0 = (pid - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if q0 >= q_len:  # spare program of the upper-bound grid
        return
    cached_len = tl.load(cached_ptr + seq)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    tok = q0 + offs_m // G_PAD  # token index inside the sequence's new tokens
    head = kvh * GQA + offs_m % G_PAD
    row_mask = (tok < q_len) & (offs_m % G_PAD < GQA)
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :], other=0.0,
    )

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)

    # 1) cached prefix through the block table: every new token sees all of it (with a window: from
    #    the tile of the first position the tile's first row sees, masked).
    bt_row = bt_ptr + seq * stride_bt
    kc_head = kc_ptr + kvh * stride_kch
    vc_head = vc_ptr + kvh * stride_vch
    qpos = (cached_len + tok)[:, None]
    full_end = (cached_len // BLOCK_N) * BLOCK_N
    first = 0
    if WINDOW:
        first = (tl.maximum(cached_len + q0 - window + 1, 0) // BLOCK_N) * BLOCK_N
    dt = q_ptr.dtype.element_ty
    for start in range(first, full_end, BLOCK_N):
        j = start + offs_n
        blk = tl.load(bt_row + j // BLOCK_SIZE).to(tl.int64)
        kk = _load_kv(_cache_tile(kc_head, blk * stride_kcb + (j % BLOCK_SIZE) * stride_kcs, offs_d, Q8),
                      j, offs_d, d_mask, False, EVEN_D, Q8, dt)
        vv = _load_kv(_cache_tile(vc_head, blk * stride_vcb + (j % BLOCK_SIZE) * stride_vcs, offs_d, Q8),
                      j, offs_d, d_mask, False, EVEN_D, Q8, dt)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, kk, vv, _window_mask(j[None, :] >= 0, j, qpos, window, WINDOW),
                                      qk_scale, softcap, WINDOW, SOFTCAP, DOT_PREC)
    if full_end < cached_len:  # ragged last tile of the prefix
        j = full_end + offs_n
        j_mask = j < cached_len
        blk = tl.load(bt_row + j // BLOCK_SIZE, mask=j_mask, other=0).to(tl.int64)
        kk = _load_kv(_cache_tile(kc_head, blk * stride_kcb + (j % BLOCK_SIZE) * stride_kcs, offs_d, Q8),
                      j_mask, offs_d, d_mask, True, EVEN_D, Q8, dt)
        vv = _load_kv(_cache_tile(vc_head, blk * stride_vcb + (j % BLOCK_SIZE) * stride_vcs, offs_d, Q8),
                      j_mask, offs_d, d_mask, True, EVEN_D, Q8, dt)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, kk, vv, _window_mask(j_mask[None, :], j, qpos, window, WINDOW),
                                      qk_scale, softcap, True, SOFTCAP, DOT_PREC)

    # 2) new tokens, contiguous in k/v. Tiles left of q0 are below the diagonal for every row
    #    (no mask but the window's); the band [diag, min(q0 + BLOCK_Q, q_len)) is masked; tiles past
    #    it are skipped. Positions here count from the first new token.
    k_head = k_ptr + kvh * stride_kh
    v_head = v_ptr + kvh * stride_vh
    diag = (q0 // BLOCK_N) * BLOCK_N
    first = 0
    if WINDOW:
        first = (tl.maximum(q0 - window + 1, 0) // BLOCK_N) * BLOCK_N
    for start in range(first, diag, BLOCK_N):
        j = start + offs_n
        rows = (q_start + j).to(tl.int64)
        kk = _load_tile(k_head + rows[:, None] * stride_kt + offs_d[None, :], rows, d_mask, False, EVEN_D)
        vv = _load_tile(v_head + rows[:, None] * stride_vt + offs_d[None, :], rows, d_mask, False, EVEN_D)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, kk, vv,
                                      _window_mask(j[None, :] >= 0, j, tok[:, None], window, WINDOW),
                                      qk_scale, softcap, WINDOW, SOFTCAP, DOT_PREC)
    band_end = tl.minimum(q0 + BLOCK_Q, q_len)
    for start in range(diag, band_end, BLOCK_N):
        j = start + offs_n
        j_mask = j < q_len
        rows = (q_start + j).to(tl.int64)
        kk = _load_tile(k_head + rows[:, None] * stride_kt + offs_d[None, :], j_mask, d_mask, True, EVEN_D)
        vv = _load_tile(v_head + rows[:, None] * stride_vt + offs_d[None, :], j_mask, d_mask, True, EVEN_D)
        causal = _window_mask((j[None, :] <= tok[:, None]) & j_mask[None, :], j, tok[:, None], window, WINDOW)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, kk, vv, causal, qk_scale, softcap, True, SOFTCAP, DOT_PREC)

    # the head's sink logit (log2 domain) joins the denominator: no value, no max update (capped at
    # 2^126: a row with no key left, where m_i is still -1e30, stays 0 without an inf)
    if SINKS:
        l_i += tl.math.exp2(tl.minimum(tl.load(sinks_ptr + head, mask=row_mask, other=0.0) - m_i, 126.0))
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :],
    )


def _prefill_config(head_dim_pad: int, g_pad: int, elem_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) from shapes alone: the same tiles on a GPU and in
    Triton's interpreter (CPU tests), so the tests run the tiles a GPU runs."""
    # fp32 (GPU tests only; tf32x3 dots) takes the smaller tile: it spills registers less.
    block_m = 128 if head_dim_pad <= 128 and elem_size <= 2 else 64
    block_n = 64 if elem_size <= 2 and head_dim_pad <= 128 else 32
    block_m = max(block_m, g_pad)
    # 4 warps at 128 rows, or at head_dim 256, sit at the 255-register limit (spill at 256)
    num_warps = 8 if block_m >= 128 or head_dim_pad > 128 else 4
    return block_m, block_n, num_warps, 2


def _sink_args(sinks: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(sinks in the kernels' exp2 domain, fp32 [H], or a dummy pointer; whether there are any)."""
    if sinks is None:
        return like, False
    return (sinks.to(like.device, torch.float32) * LOG2E).contiguous(), True


def _score_args(scale: float, softcap: float | None) -> tuple[float, float]:
    """(qk_scale, softcap) for _softmax_step: scores in the exp2 domain, the cap folded in."""
    if softcap:
        return scale / softcap, softcap * LOG2E
    return scale * LOG2E, 0.0


def flash_attn_varlen_paged(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cached_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over (cached prefix + themselves).

    q [total_q, H, D]; k, v [total_q, KVH, D] (new tokens); k_cache, v_cache
    [num_blocks, block_size, KVH, D]; cu_seqlens_q int32 [num_seqs + 1]; cached_lens int32
    [num_seqs] (tokens already in the cache before the new ones); block_tables int32
    [num_seqs, max_blocks]. New token j of sequence i sits at position cached_lens[i] + j.
    Returns [total_q, H, D] in q's dtype. block_m / block_n override the tile sizes (tests).
    A q8_0 cache (uint8 [num_blocks, block_size, KVH, D / 32 * 34]) is read as d * q; k and v
    should then be the new tokens as it holds them (kv_quant), so every read sees one value.
    window > 0: a token at position p sees positions > p - window only; softcap > 0: scores s
    become softcap * tanh(s / softcap) before the softmax. None or 0: off. sinks [H] (gpt-oss): a
    logit per query head in each softmax's denominator.
    """
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert num_heads % num_kv_heads == 0
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    gqa = num_heads // num_kv_heads
    g_pad = triton.next_power_of_2(gqa)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    bm, bn, num_warps, num_stages = _prefill_config(d_pad, g_pad, q.element_size())
    bm = block_m or bm
    bn = block_n or bn
    assert bm >= g_pad, "BLOCK_M must hold a whole GQA group"
    if out is None:
        out = torch.empty_like(q)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or num_seqs == 0:
        return out
    # Upper bound on the number of query tiles; spare programs exit at once.
    grid = (total_q // (bm // g_pad) + num_seqs, num_kv_heads)
    sink_t, has_sinks = _sink_args(sinks, cached_lens)
    _prefill_kernel[grid](
        q, k, v, k_cache, v_cache, out,
        cu_seqlens_q, cached_lens, block_tables, sink_t,
        *_score_args(scale, softcap), window or 0, num_seqs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GQA=gqa, G_PAD=g_pad, HEAD_DIM=head_dim, D_PAD=d_pad, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=bm, BLOCK_N=bn, DOT_PREC="tf32x3" if q.dtype == torch.float32 else "tf32",
        WINDOW=bool(window), SOFTCAP=bool(softcap), Q8=k_cache.dtype == torch.uint8, SINKS=has_sinks,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
