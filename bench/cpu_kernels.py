"""Our CPU kernels against torch's: the int4 GEMM and decode attention over the paged KV cache.

    .venv/bin/python bench/cpu_kernels.py [--threads 2] [--rows 1,4,16,64] [--only int4|attention]

int4: our kernel against torch's int4 kernel and an fp32 GEMM, on the default model's shapes. Per
call of one matrix (microseconds, median of 5 timed loops) and the sum over a decoder layer's
four matrices; relative error of each int4 kernel against fp64 on the same weights.

attention: one layer's decode attention (one new token per sequence) over a paged cache
(block size 16, shuffled blocks): our paged_attention op on an fp32 and an fp16 cache against the
previous path (index the cache with the gather table, then SDPA with the query heads of each KV
head grouped as rows, in the cache's dtype); microseconds per call, median of 5 timed loops, and
the largest difference of each against fp64 attention on the same cache.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from localllm.model.int4 import Int4Weight
from localllm.model.layers import kernel_dequantize
from localllm_kernels import cpu_attention, cpu_int4

# SmolLM2-135M: fused qkv, o, fused gate_up, down; the tied head
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def timed(fn, calls: int) -> float:
    for _ in range(max(3, calls // 10)):
        fn()
    laps = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        laps.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(laps)


def int4_rows(args) -> None:
    if not cpu_int4.load():
        print("our CPU int4 kernel is not available here (needs AVX-512 VNNI and a C++ compiler)")
        return
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    layer = {m: [0.0, 0.0, 0.0] for m in rows}
    print(f"{args.threads} threads; us per call (ours / torch int4 / fp32 GEMM), speed-up ours vs torch int4, rel. error")
    for name, (n, k) in SHAPES.items():
        group = 32
        scales = (torch.rand(k // group, n, generator=g) * 0.02 + 1e-3).half().float()
        mins = (torch.randn(k // group, n, generator=g) * 0.05).half().float()
        w = Int4Weight(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), scales, mins + 8 * scales, group)
        qw, qsc = cpu_int4.pack(w.q, w.scales, w.zeros)
        packed = torch._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 2)
        sz = torch.stack([w.scales, w.zeros], -1).to(torch.bfloat16).contiguous()
        dense = kernel_dequantize(w)
        ref_w = w.dequantize(torch.float64)
        for m in rows:
            x = torch.randn(m, k, generator=g)
            xb = x.to(torch.bfloat16)
            calls = max(5, int(2e5 / (n * k / 1e3 * max(m, 4) ** 0.5)))
            ours_fn = functools.partial(cpu_int4.int4_gemm, x, qw, qsc, group)
            theirs_fn = functools.partial(torch._weight_int4pack_mm_for_cpu, xb, packed, group, sz)
            ours, theirs = timed(ours_fn, calls), timed(theirs_fn, calls)
            fp32 = timed(functools.partial(torch.nn.functional.linear, x, dense), calls)
            ref = x.double() @ ref_w.t()
            e1, e2 = rel_err(ours_fn()[:, :n], ref), rel_err(theirs_fn().float(), ref)
            print(f"{name:8} {n:5}x{k:<5} rows {m:3}: {ours:8.1f} / {theirs:8.1f} / {fp32:8.1f}  "
                  f"{theirs / ours:5.2f}x  err {e1:.1e} / {e2:.1e}")
            if name != "head":
                for i, t in enumerate((ours, theirs, fp32)):
                    layer[m][i] += t
    for m in rows:
        a, b, c = layer[m]
        print(f"decoder layer, rows {m:3}: {a:8.1f} / {b:8.1f} / {c:8.1f} us  ours {b / a:.2f}x torch int4, "
              f"{c / a:.2f}x fp32")


# (query heads, KV heads, head dim): SmolLM2-135M, an 8B-style GQA model, a model without GQA
ATTN_SHAPES = [(9, 3, 64), (32, 8, 64), (32, 32, 64)]
ATTN_CASES = [(1, 32), (1, 512), (1, 2000), (1, 4000), (8, 512)]  # (batch, context)


def paged_cache(batch: int, ctx: int, kvh: int, d: int, g: torch.Generator, bs: int = 16):
    """An fp32 cache holding `batch` sequences of `ctx` tokens in shuffled blocks, their block
    tables, and the gather table of the previous path (cache slot of every position)."""
    per = -(-ctx // bs)
    nb = batch * per + 8
    k = torch.randn(nb, bs, kvh, d, generator=g)
    v = torch.randn(nb, bs, kvh, d, generator=g)
    tables = torch.randperm(nb, generator=g)[:batch * per].view(batch, per)
    pos = torch.arange(ctx)
    gather = tables[:, pos // bs] * bs + pos % bs  # [B, L]
    return k, v, tables, gather


def torch_decode(q, k_cache, v_cache, gather, scale):
    """The decode branch of the previous torch_attention: K/V indexed out of the cache, SDPA with
    each KV head's query heads as rows, in the cache's dtype."""
    B, H, D = q.shape
    kvh = k_cache.shape[2]
    kc, vc = k_cache.view(-1, kvh, D), v_cache.view(-1, kvh, D)
    kk = kc[gather].transpose(1, 2)  # [B, KVH, L, D]
    vv = vc[gather].transpose(1, 2)
    qg = q.view(B, kvh, H // kvh, D).to(kk.dtype)
    return F.scaled_dot_product_attention(qg, kk, vv, scale=scale).reshape(B, H, D).float()


def fp64_decode(q, k_cache, v_cache, gather, scale):
    B, H, D = q.shape
    kvh = k_cache.shape[2]
    kk = k_cache.double().view(-1, kvh, D)[gather]  # [B, L, KVH, D]
    vv = v_cache.double().view(-1, kvh, D)[gather]
    qg = q.double().view(B, kvh, H // kvh, D)
    p = torch.einsum("bkgd,blkd->bkgl", qg, kk).mul(scale).softmax(-1)
    return torch.einsum("bkgl,blkd->bkgd", p, vv).reshape(B, H, D)


def attention_rows(args) -> None:
    native = cpu_attention.load()
    print(f"\ndecode attention per layer, {args.threads} threads, our op "
          f"({cpu_attention.isa() if native else 'not built: torch reference'}); us per call and max |error| "
          "against fp64 on the same cache values")
    print(f"{'H/KVH/D':>9} {'B':>2} {'ctx':>5} | {'ours f32':>8} {'ours f16':>8} | {'torch f32':>9} {'torch f16':>9}"
          f" | {'f32 x':>5} {'f16 x':>5} | err ours f32 / f16, torch f32 / f16")
    op = torch.ops.localllm.paged_attention if native else cpu_attention.paged_attention
    g = torch.Generator().manual_seed(0)
    for H, kvh, D in ATTN_SHAPES:
        for B, ctx in ATTN_CASES:
            k, v, tables, gather = paged_cache(B, ctx, kvh, D, g)
            kh, vh = k.half(), v.half()
            q = torch.randn(B, H, D, generator=g)
            cu = torch.arange(B + 1)
            lens = torch.full((B,), ctx)
            scale = D ** -0.5
            calls = max(5, int(4e6 / (B * ctx * H * D / 8 + 2e4)))
            fns = [functools.partial(op, q, k, v, tables, cu, lens, scale),
                   functools.partial(op, q, kh, vh, tables, cu, lens, scale),
                   functools.partial(torch_decode, q, k, v, gather, scale),
                   functools.partial(torch_decode, q, kh, vh, gather, scale)]
            us = [timed(fn, calls) for fn in fns]
            refs = (fp64_decode(q, k, v, gather, scale), fp64_decode(q, kh, vh, gather, scale))
            errs = [(fn() - refs[i % 2]).abs().max().item() for i, fn in enumerate(fns)]
            print(f"{H:>3}/{kvh:>2}/{D:<3} {B:>2} {ctx:>5} | {us[0]:8.1f} {us[1]:8.1f} | {us[2]:9.1f} {us[3]:9.1f} | "
                  f"{us[2] / us[0]:5.2f} {us[3] / us[1]:5.2f} | " + " / ".join(f"{e:.0e}" for e in errs))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--only", choices=("int4", "attention"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.only != "attention":
        int4_rows(args)
    if args.only != "int4":
        attention_rows(args)


if __name__ == "__main__":
    main()
