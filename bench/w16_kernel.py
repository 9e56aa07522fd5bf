"""Our 16-bit-weight GEMM (localllm_kernels.cpu_bf16) against torch's fp32 GEMM on the upcast
weights (`F.linear`, what an fp32 copy of a bf16 checkpoint runs), per call of one matrix.

    python bench/w16_kernel.py [--threads 1] [--rows 1,4,16,64,128,512] [--reps 15]

Shapes: SmolLM2-135M's fused gate_up (3072 x 576) and down (576 x 1536), and a 1B shape's
gate_up half (8192 x 2048). Milliseconds, median of `reps` calls timed with process CPU time
(with --threads 1 that is the call's own time, less sensitive to other work on a busy machine),
each kernel path (AVX-512, AVX2) separately.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from localllm_kernels import cpu_bf16

SHAPES = [(3072, 576), (576, 1536), (8192, 2048)]


def timed(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        ts.append(time.process_time() - t0)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,4,16,64,128,512")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert cpu_bf16.load()
    best = cpu_bf16.isa()
    paths = [p for p in ("avx512", "avx2") if p == best or (best == "avx512" and p == "avx2")]
    print(f"{'shape':>11} {'rows':>5} {'torch fp32':>11} " + " ".join(f"{'ours ' + p:>12}" for p in paths))
    for n, k in SHAPES:
        w16 = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
        w32, packed = w16.float(), cpu_bf16.pack(w16)
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k)
            reps = args.reps if n * k * m < 2e9 else max(3, args.reps // 3)
            ref = timed(lambda x=x, w=w32: F.linear(x, w), reps)
            ours = []
            for p in paths:
                cpu_bf16.isa(p)
                ours.append(timed(lambda x=x, w=packed: cpu_bf16.w16_gemm(x, w), reps))
            cpu_bf16.isa("auto")
            print(f"{n:>5}x{k:<5} {m:>5} {ref:>9.3f}ms " + " ".join(f"{o:>9.3f}ms" for o in ours), flush=True)


if __name__ == "__main__":
    main()
