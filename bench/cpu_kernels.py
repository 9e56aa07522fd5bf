"""Our CPU int4 kernel against torch's int4 kernel and an fp32 GEMM, on the default model's shapes.

    .venv/bin/python bench/cpu_kernels.py [--threads 2] [--rows 1,4,16,64]

Per call of one matrix (microseconds, median of 5 timed loops) and the sum over a decoder
layer's four matrices; relative error of each int4 kernel against fp64 on the same weights.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
from localllm_kernels import cpu_int4

from localllm.model.layers import kernel_dequantize
from localllm.quant.int4 import Int4Weight

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,16,64")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_int4.load():
        raise SystemExit("our CPU int4 kernel is not available here (needs AVX-512 VNNI and a C++ compiler)")
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


if __name__ == "__main__":
    main()
