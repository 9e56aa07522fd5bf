"""Rotary position embedding (transformers' rotate_half form) for q and k in one launch."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_heads(x_ptr, o_ptr, t, stride_xt, stride_xh, stride_ot, stride_oh, c1, c2, s1, s2,
                NUM_HEADS: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HALF)
    x = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
    # out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1)
    o = o_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o, (x1 * c1 - x2 * s1).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(o + HALF, (x2 * c2 + x1 * s2).to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh, stride_c,
    NUM_Q: tl.constexpr, NUM_K: tl.constexpr, HQ_PAD: tl.constexpr, HK_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    dm = offs_d < HALF
    # Both halves of the table: no assumption that cos[:half] == cos[half:].
    c1 = tl.load(cos_ptr + pos * stride_c + offs_d, mask=dm, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + pos * stride_c + HALF + offs_d, mask=dm, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + pos * stride_c + offs_d, mask=dm, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + pos * stride_c + HALF + offs_d, mask=dm, other=0.0).to(tl.float32)[None, :]
    _rope_heads(q_ptr, qo_ptr, t, stride_qt, stride_qh, stride_qot, stride_qoh, c1, c2, s1, s2,
                NUM_Q, HQ_PAD, HALF, HALF_PAD)
    _rope_heads(k_ptr, ko_ptr, t, stride_kt, stride_kh, stride_kot, stride_koh, c1, c2, s1, s2,
                NUM_K, HK_PAD, HALF, HALF_PAD)


def apply_rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    *, inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, KVH, D] (strided views allowed), positions int [T], cos/sin tables
    [max_pos, D] (the cat(freqs, freqs) form). Returns rotated (q, k): new tensors, or q and k
    themselves when inplace=True."""
    t, h, d = q.shape
    kvh = k.shape[1]
    assert d % 2 == 0 and q.stride(-1) == 1 and k.stride(-1) == 1
    assert cos.stride(-1) == 1 and sin.stride() == cos.stride()
    qo = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t:
        half = d // 2
        _rope_kernel[(t,)](
            q, k, qo, ko, positions, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), qo.stride(0), qo.stride(1),
            ko.stride(0), ko.stride(1), cos.stride(0),
            NUM_Q=h, NUM_K=kvh, HQ_PAD=triton.next_power_of_2(h), HK_PAD=triton.next_power_of_2(kvh),
            HALF=half, HALF_PAD=triton.next_power_of_2(half), num_warps=4,
        )
    return qo, ko
