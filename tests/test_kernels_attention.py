"""store_kv, flash_attn_varlen_paged and paged_decode_attention against float64 torch references.

Runs natively on CUDA, else in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before the kernels are imported). Shapes are tiny: the interpreter costs ~0.5 ms per program.
"""

import math

import pytest
import torch

from localllm_kernels import flash_attn_varlen_paged, paged_decode_attention, store_kv

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 is broken in the interpreter (garbage tl.dot, truncating casts): only test it natively.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
RTOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def make_paged_cache(lens: list[int], num_kv_heads: int, head_dim: int, block_size: int, dtype, gen,
                     spare_blocks: int = 3):
    """Random K/V for each sequence's first lens[i] tokens, scattered over shuffled blocks.

    Every other slot of the cache holds random garbage, so a wrong gather shows up in the result.
    Returns (k_cache, v_cache, block_tables int32, per-sequence (k, v) float64 lists).
    """
    nblk = [max(1, math.ceil(n / block_size)) for n in lens]
    num_blocks = sum(nblk) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(nblk) + 1
    # Unused table entries point at valid but wrong blocks.
    block_tables = torch.randint(0, num_blocks, (len(lens), max_blocks), generator=gen, dtype=torch.int32)
    kvs = []
    used = 0
    for i, n in enumerate(lens):
        ids = perm[used:used + nblk[i]]
        used += nblk[i]
        block_tables[i, :nblk[i]] = ids.to(torch.int32)
        kk = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        vv = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        t = torch.arange(n)
        blk = ids[t // block_size]
        k_cache[blk, t % block_size] = kk
        v_cache[blk, t % block_size] = vv
        kvs.append((kk.double(), vv.double()))
    return k_cache.to(DEV), v_cache.to(DEV), block_tables.to(DEV), kvs


def ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos0: int, scale: float,
                  window: int | None = None, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [Lq, H, D] at positions q_pos0.., k/v [Lk, KVH, D] at positions 0..; causal (and a query at p
    sees keys > p - window only); scores capped at +-softcap through tanh; with sinks [H], head h's
    one more logit in its softmax (dropped after it); float64."""
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    qpos = q_pos0 + torch.arange(q.shape[0])[:, None]
    kpos = torch.arange(k.shape[0])[None, :]
    s = s.masked_fill((kpos > qpos) | (kpos <= qpos - (window or q_pos0 + q.shape[0] + 1)), float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(-1, 1, 1).expand(s.shape[0], s.shape[1], 1)
        return torch.einsum("hqk,khd->qhd", torch.softmax(torch.cat([s, sink], -1), dim=-1)[..., :-1], v.double())
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v.double())


# ---------------------------------------------------------------- store_kv

@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv(dtype, slot_dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, kvh, d = 5, 8, 3, 64
    n = 12
    # k/v as strided views of a fused qkv projection, like the engine produces.
    qkv = torch.randn(n, (2 + 2 * kvh) * d, generator=gen).to(dtype).to(DEV)
    k = qkv[:, 2 * d:(2 + kvh) * d].view(n, kvh, d)
    v = qkv[:, (2 + kvh) * d:].view(n, kvh, d)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n]
    slots[[2, 7, 11]] = -1  # padding tokens
    sentinel = -777.0
    k_cache = torch.full((num_blocks, block_size, kvh, d), sentinel, dtype=dtype, device=DEV)
    v_cache = torch.full_like(k_cache, sentinel)
    store_kv(k, v, k_cache, v_cache, slots.to(slot_dtype).to(DEV))
    exp_k = torch.full_like(k_cache, sentinel).view(-1, kvh, d)
    exp_v = exp_k.clone()
    keep = slots >= 0
    exp_k[slots[keep]] = k[keep.to(DEV)]
    exp_v[slots[keep]] = v[keep.to(DEV)]
    assert torch.equal(k_cache.view(-1, kvh, d), exp_k)
    assert torch.equal(v_cache.view(-1, kvh, d), exp_v)


# ---------------------------------------------------------------- prefill / extend

PREFILL_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, [(cached_len, new_len), ...], block_m, block_n)
    (4, 4, 64, 16, [(0, 37), (19, 5), (0, 1), (33, 18)], None, None),    # MHA, plain + extend
    (6, 2, 128, 8, [(11, 21), (0, 0), (3, 1), (0, 9)], 16, 16),           # GQA 3, empty seq, small tiles
    (8, 1, 64, 32, [(45, 7), (0, 13), (70, 2)], None, None),              # GQA 8 (4 tokens per tile)
    (8, 1, 128, 16, [(21, 11)], 16, 16),                                   # GQA 8, 2 tokens per tile
    (2, 1, 80, 16, [(17, 6), (0, 3)], None, None),                         # head_dim 80 (padded to 128)
    (2, 2, 64, 32, [(3 * i, (5 * i) % 7 + 1) for i in range(9)], 16, 16),  # 9 seqs (binary search), BLOCK_N < block
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_flash_attn_varlen_paged(case, dtype):
    h, kvh, d, bs, seqs, bm, bn = PREFILL_CASES[case]
    gen = torch.Generator().manual_seed(100 + case)
    cached = [c for c, _ in seqs]
    new = [n for _, n in seqs]
    total_lens = [c + n for c, n in seqs]
    # The cache holds every token; the kernel must read the new ones from k/v, not from the cache.
    k_cache, v_cache, block_tables, kvs = make_paged_cache(total_lens, kvh, d, bs, dtype, gen)
    k_new = torch.cat([kk[c:] for (kk, _), c in zip(kvs, cached, strict=True)]).to(dtype).to(DEV)
    v_new = torch.cat([vv[c:] for (_, vv), c in zip(kvs, cached, strict=True)]).to(dtype).to(DEV)
    total_q = sum(new)
    q = torch.randn(total_q, h, d, generator=gen).to(dtype).to(DEV)
    cu = torch.tensor([0] + list(torch.tensor(new).cumsum(0)), dtype=torch.int32, device=DEV)
    cached_t = torch.tensor(cached, dtype=torch.int32, device=DEV)
    scale = d ** -0.5
    out = torch.full_like(q, float("nan"))
    res = flash_attn_varlen_paged(q, k_new, v_new, k_cache, v_cache, cu, cached_t, block_tables, scale,
                                  out=out, block_m=bm, block_n=bn)
    assert res is out and res.dtype == dtype
    assert torch.isfinite(out).all(), "some output rows were not written"
    ref = torch.cat([
        ref_attention(q[cu[i]:cu[i + 1]].cpu(), kvs[i][0], kvs[i][1], cached[i], scale)
        for i in range(len(seqs))
    ])
    assert rel_err(out.cpu(), ref) < RTOL[dtype]


def test_flash_attn_default_out_and_strided_inputs():
    """Default allocation, q/k/v as views of one fused qkv buffer, int64 metadata (GQA 3, fp32)."""
    gen = torch.Generator().manual_seed(7)
    h, kvh, d, bs = 3, 1, 64, 8
    seqs = [(5, 12), (0, 6)]
    total_lens = [c + n for c, n in seqs]
    k_cache, v_cache, block_tables, kvs = make_paged_cache(total_lens, kvh, d, bs, torch.float32, gen)
    total_q = sum(n for _, n in seqs)
    qkv = torch.randn(total_q, (h + 2 * kvh) * d, generator=gen)
    qkv[:, h * d:(h + kvh) * d] = torch.cat([kk[c:] for (kk, _), (c, _) in zip(kvs, seqs, strict=True)]).view(total_q, -1).float()
    qkv[:, (h + kvh) * d:] = torch.cat([vv[c:] for (_, vv), (c, _) in zip(kvs, seqs, strict=True)]).view(total_q, -1).float()
    qkv = qkv.to(DEV)
    q = qkv[:, :h * d].view(total_q, h, d)
    k = qkv[:, h * d:(h + kvh) * d].view(total_q, kvh, d)
    v = qkv[:, (h + kvh) * d:].view(total_q, kvh, d)
    cu = torch.tensor([0, 12, 18], dtype=torch.int64, device=DEV)
    cached_t = torch.tensor([5, 0], dtype=torch.int64, device=DEV)
    out = flash_attn_varlen_paged(q, k, v, k_cache, v_cache, cu, cached_t, block_tables.long(), 0.125)
    ref = torch.cat([ref_attention(q[cu[i]:cu[i + 1]].cpu(), *kvs[i], seqs[i][0], 0.125) for i in range(2)])
    assert out.shape == q.shape and out.is_contiguous()
    assert rel_err(out.cpu(), ref) < 1e-3


# ---------------------------------------------------------------- decode

DECODE_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, context_lens, num_splits)
    (4, 4, 64, 16, [1, 17, 50, 0, 33], 1),       # MHA, padding row, direct write
    (6, 2, 128, 8, [9, 40, 0, 23], 3),            # GQA 3, splits + merge, empty splits
    (8, 1, 64, 32, [70, 2, 31], None),            # GQA 8, default splits
    (16, 2, 64, 8, [0, 0], 2),                    # padding-only batch -> zeros
    (3, 3, 80, 16, [5, 38], 2),                   # head_dim 80 (padded to 128)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
def test_paged_decode_attention(case, dtype):
    h, kvh, d, bs, lens, splits = DECODE_CASES[case]
    gen = torch.Generator().manual_seed(200 + case)
    k_cache, v_cache, block_tables, kvs = make_paged_cache(lens, kvh, d, bs, dtype, gen)
    q = torch.randn(len(lens), h, d, generator=gen).to(dtype).to(DEV)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    scale = d ** -0.5
    out = torch.full_like(q, float("nan"))
    res = paged_decode_attention(q, k_cache, v_cache, ctx, block_tables, scale, splits, out=out)
    assert res is out and res.dtype == dtype
    assert torch.isfinite(out).all(), "some output rows were not written"
    ref = torch.zeros(len(lens), h, d, dtype=torch.float64)
    for b, n in enumerate(lens):
        if n:
            ref[b] = ref_attention(q[b:b + 1].cpu(), kvs[b][0], kvs[b][1], n - 1, scale)[0]
    for b, n in enumerate(lens):
        if n == 0:
            assert (out[b] == 0).all(), "padding rows must be zeros"
    live = [b for b, n in enumerate(lens) if n]
    if live:
        assert rel_err(out.cpu()[live], ref[live]) < RTOL[dtype]


def test_decode_matches_prefill_last_row():
    """store_kv -> prefill of a prompt, then decode of its last token (int64 metadata): same answer."""
    gen = torch.Generator().manual_seed(11)
    h, kvh, d, bs, n = 6, 2, 64, 8, 21
    num_blocks = 6
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen).to(DEV)
    v_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen).to(DEV)
    table = torch.tensor([[4, 1, 5, 0]], dtype=torch.int32, device=DEV)
    t = torch.arange(n)
    slots = (table[0].cpu()[t // bs] * bs + t % bs).to(DEV)
    q = torch.randn(n, h, d, generator=gen).to(DEV)
    k = torch.randn(n, kvh, d, generator=gen).to(DEV)
    v = torch.randn(n, kvh, d, generator=gen).to(DEV)
    store_kv(k, v, k_cache, v_cache, slots)
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEV)
    pre = flash_attn_varlen_paged(q, k, v, k_cache, v_cache, cu, torch.zeros(1, dtype=torch.int32, device=DEV),
                                  table, d ** -0.5)
    dec = paged_decode_attention(q[-1:], k_cache, v_cache, torch.tensor([n], dtype=torch.int64, device=DEV),
                                 table.long(), d ** -0.5, 2)
    assert rel_err(dec.cpu(), pre[-1:].cpu().double()) < 1e-4


# ---------------------------------------------------------------- sliding window and soft-cap

WINDOW_PREFILL_CASES = [
    # (num_heads, num_kv_heads, head_dim, block_size, [(cached_len, new_len), ...], window, softcap)
    (4, 2, 64, 16, [(0, 37), (19, 20), (45, 6)], 7, None),   # windows from mid-tile, in and past the prefix
    (4, 2, 64, 16, [(0, 37), (19, 20), (45, 6)], 33, 5.0),    # window + cap
    (2, 1, 256, 16, [(21, 11), (0, 9)], None, 5.0),            # cap alone, head_dim 256
]


@pytest.mark.parametrize("case", range(len(WINDOW_PREFILL_CASES)))
def test_flash_attn_window_and_softcap(case):
    """The prefill/extend kernel with a sliding window and soft-capped scores (fp16, 16 x 16 tiles:
    the window starts mid-tile and, for later tiles, past whole tiles of the prefix and new tokens)."""
    h, kvh, d, bs, seqs, window, softcap = WINDOW_PREFILL_CASES[case]
    gen = torch.Generator().manual_seed(300 + case)
    cached = [c for c, _ in seqs]
    k_cache, v_cache, block_tables, kvs = make_paged_cache([c + n for c, n in seqs], kvh, d, bs, torch.float16, gen)
    k_new = torch.cat([kk[c:] for (kk, _), c in zip(kvs, cached, strict=True)]).half().to(DEV)
    v_new = torch.cat([vv[c:] for (_, vv), c in zip(kvs, cached, strict=True)]).half().to(DEV)
    q = (torch.randn(sum(n for _, n in seqs), h, d, generator=gen) * 3).half().to(DEV)  # scores past the cap
    cu = torch.tensor([0] + list(torch.tensor([n for _, n in seqs]).cumsum(0)), dtype=torch.int32, device=DEV)
    scale = d ** -0.5
    out = flash_attn_varlen_paged(q, k_new, v_new, k_cache, v_cache, cu, torch.tensor(cached, dtype=torch.int32,
                                  device=DEV), block_tables, scale, block_m=16, block_n=16, window=window,
                                  softcap=softcap)
    rows = [(q[cu[i]:cu[i + 1]].cpu(), *kvs[i], cached[i], scale) for i in range(len(seqs))]
    ref = torch.cat([ref_attention(*r, window, softcap) for r in rows])
    assert rel_err(out.cpu(), ref) < RTOL[torch.float16]
    assert rel_err(torch.cat([ref_attention(*r) for r in rows]), ref) > 0.1  # the case tests the feature


@pytest.mark.parametrize("window,softcap,splits,d", [(5, None, 2, 32), (20, 5.0, 3, 256), (None, 5.0, 1, 64)])
def test_paged_decode_window_and_softcap(window, softcap, splits, d):
    """Decode with a window (the walk starts at its first tile; splits share what is left) and caps."""
    lens = [1, 17, 50, 0, 33]
    gen = torch.Generator().manual_seed(400 + splits)
    k_cache, v_cache, block_tables, kvs = make_paged_cache(lens, 2, d, 16, torch.float16, gen)
    q = (torch.randn(len(lens), 4, d, generator=gen) * 3).half().to(DEV)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    scale = d ** -0.5
    out = paged_decode_attention(q, k_cache, v_cache, ctx, block_tables, scale, splits, block_n=16,
                                 window=window, softcap=softcap)
    live = [b for b, n in enumerate(lens) if n]
    rows = [(q[b:b + 1].cpu(), *kvs[b], lens[b] - 1, scale) for b in live]
    ref = torch.cat([ref_attention(*r, window, softcap) for r in rows])
    assert rel_err(out.cpu()[live], ref) < RTOL[torch.float16]
    assert (out[3] == 0).all()
    assert rel_err(torch.cat([ref_attention(*r) for r in rows]), ref) > 0.1


# ---------------------------------------------------------------- attention sinks (gpt-oss)

SINKS = torch.tensor([-2.0, 0.5, 3.0, 1.0])  # one per query head, both sides of the scores


@pytest.mark.parametrize("window", [None, 7])
def test_flash_attn_sinks(window):
    """The prefill/extend kernel with sinks: each head's logit joins its denominator (with and without
    a window, over a cached prefix and new tokens); the sinks change the output."""
    h, kvh, d, bs, seqs = 4, 2, 64, 16, [(0, 37), (19, 20), (45, 6)]
    gen = torch.Generator().manual_seed(500)
    cached = [c for c, _ in seqs]
    k_cache, v_cache, block_tables, kvs = make_paged_cache([c + n for c, n in seqs], kvh, d, bs, torch.float16, gen)
    k_new = torch.cat([kk[c:] for (kk, _), c in zip(kvs, cached, strict=True)]).half().to(DEV)
    v_new = torch.cat([vv[c:] for (_, vv), c in zip(kvs, cached, strict=True)]).half().to(DEV)
    q = torch.randn(sum(n for _, n in seqs), h, d, generator=gen).half().to(DEV)
    cu = torch.tensor([0] + list(torch.tensor([n for _, n in seqs]).cumsum(0)), dtype=torch.int32, device=DEV)
    scale = d ** -0.5
    out = flash_attn_varlen_paged(q, k_new, v_new, k_cache, v_cache, cu, torch.tensor(cached, dtype=torch.int32,
                                  device=DEV), block_tables, scale, block_m=16, block_n=16, window=window,
                                  sinks=SINKS.to(DEV))
    rows = [(q[cu[i]:cu[i + 1]].cpu(), *kvs[i], cached[i], scale) for i in range(len(seqs))]
    ref = torch.cat([ref_attention(*r, window, None, SINKS) for r in rows])
    assert rel_err(out.cpu(), ref) < RTOL[torch.float16]
    assert rel_err(torch.cat([ref_attention(*r, window) for r in rows]), ref) > 0.1


@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_sinks(splits):
    """Decode with sinks, in one split and merged from three (the sink added once, on the merged max);
    a padding row (context 0) stays 0."""
    lens = [1, 17, 50, 0, 33]
    gen = torch.Generator().manual_seed(600 + splits)
    k_cache, v_cache, block_tables, kvs = make_paged_cache(lens, 2, 64, 16, torch.float16, gen)
    q = torch.randn(len(lens), 4, 64, generator=gen).half().to(DEV)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = paged_decode_attention(q, k_cache, v_cache, ctx, block_tables, 0.125, splits, block_n=16,
                                 sinks=SINKS.to(DEV))
    live = [b for b, n in enumerate(lens) if n]
    rows = [(q[b:b + 1].cpu(), *kvs[b], lens[b] - 1, 0.125) for b in live]
    ref = torch.cat([ref_attention(*r, None, None, SINKS) for r in rows])
    assert rel_err(out.cpu()[live], ref) < RTOL[torch.float16]
    assert (out[3] == 0).all()
    assert rel_err(torch.cat([ref_attention(*r) for r in rows]), ref) > 0.1
