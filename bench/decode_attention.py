"""Decode attention over a whole model's paged caches: our paged_attention op once per layer for
one new token, each layer with its own cache (so the caches stream from memory, as in a real decode
step, where a single layer's cache would sit in L2), at short and long context, fp16 and fp32 caches.

    OMP_NUM_THREADS=1 python bench/decode_attention.py [--threads 1] [--layers 30] [--context 40,2000]

Thread CPU time per token (all layers), median of 5 loops, and the K/V bytes read per second.
Shape: SmolLM2-135M's (9 query heads of 64 over 3 KV heads, block size 16).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from localllm_kernels import cpu_attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--context", default="40,2000")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert cpu_attention.load(), "the paged-attention kernel could not be built here"
    H, KVH, D, bs = 9, 3, 64, 16
    op = torch.ops.localllm.paged_attention
    print(f"paged attention ({cpu_attention.isa()}), {args.layers} layers, {args.threads} thread(s)")
    print("| cache | context | ms per token (thread CPU) | K/V GB/s |")
    print("|---|---|---|---|")
    for dt in (torch.float16, torch.float32):
        for ctx in map(int, args.context.split(",")):
            nblk = -(-ctx // bs)
            caches = [(torch.randn(nblk + 1, bs, KVH, D).to(dt), torch.randn(nblk + 1, bs, KVH, D).to(dt))
                      for _ in range(args.layers)]
            tables, cu, lens = torch.arange(1, nblk + 1)[None], torch.tensor([0, 1]), torch.tensor([ctx])
            q = torch.randn(1, H, D)
            loops = max(5, 20000 // ctx)
            ts = []
            for _ in range(5):
                c0 = time.thread_time()
                for _ in range(loops):
                    for k, v in caches:
                        op(q, k, v, tables, cu, lens, D ** -0.5, 0, 0.0)
                ts.append((time.thread_time() - c0) / loops * 1e3)
            ms = statistics.median(ts)
            gb = args.layers * ctx * KVH * D * 2 * dt.itemsize / 1e9
            print(f"| {str(dt).removeprefix('torch.')} | {ctx} | {ms:.3f} | {gb / ms * 1e3:.1f} |")


if __name__ == "__main__":
    main()
