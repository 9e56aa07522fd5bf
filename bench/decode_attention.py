"""Decode attention over a whole model's paged caches: our paged_attention op once per layer for
one new token, each layer with its own cache (so the caches stream from memory, as in a real decode
step, where a single layer's cache would sit in L2), at short and long context.

    python bench/decode_attention.py [--threads 1,2] [--layers 16] [--context 40,2000] \
        [--shape 1b,1.7b,135m,8b] [--dtype float16,float32] [--against OLD.so:namespace]

Wall time per token (all layers), median of 7 rounds, and the K/V bytes read per second.
--against loads a build of the op under another namespace (e.g. the previous source, its
TORCH_LIBRARY names changed) and runs both in alternation in this one process.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from localllm_kernels import cpu_attention

SHAPES = {"135m": (9, 3, 64), "1b": (32, 8, 64), "1.7b": (32, 32, 64), "8b": (32, 8, 128)}  # heads, KV heads, D


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--context", default="40,2000")
    ap.add_argument("--shape", default="1b,1.7b,135m,8b")
    ap.add_argument("--dtype", default="float16,float32")
    ap.add_argument("--against", help="LIB.so:namespace, a build of the op to time beside ours")
    args = ap.parse_args()
    assert cpu_attention.load(), "the paged-attention kernel could not be built here"
    ops = {"ours": torch.ops.localllm.paged_attention}
    if args.against:
        lib, ns = args.against.split(":")
        torch.ops.load_library(lib)
        ops[ns] = getattr(torch.ops, ns).paged_attention
    bs = 16
    print(f"paged attention ({cpu_attention.isa()}), {args.layers} layers, block size {bs}")
    print("| shape | cache | context | threads | " + " | ".join(f"{n} ms/token (K/V GB/s)" for n in ops) + " |")
    print("|---|---|---|---|" + "---|" * len(ops))
    for shape in args.shape.split(","):
        H, KVH, D = SHAPES[shape]
        for dt in (getattr(torch, d) for d in args.dtype.split(",")):
            for ctx in map(int, args.context.split(",")):
                nblk = -(-ctx // bs)
                caches = [(torch.randn(nblk + 1, bs, KVH, D).to(dt), torch.randn(nblk + 1, bs, KVH, D).to(dt))
                          for _ in range(args.layers)]
                tables, cu, lens = torch.arange(1, nblk + 1)[None], torch.tensor([0, 1]), torch.tensor([ctx])
                q = torch.randn(1, H, D)
                ref = ops["ours"](q, *caches[0], tables, cu, lens, D ** -0.5, 0, 0.0)
                for op in ops.values():  # the same op, built twice: the same numbers
                    assert torch.equal(op(q, *caches[0], tables, cu, lens, D ** -0.5, 0, 0.0), ref)
                loops = max(2, 20000 // ctx)
                for threads in map(int, args.threads.split(",")):
                    torch.set_num_threads(threads)
                    ts: dict[str, list[float]] = {n: [] for n in ops}
                    for _ in range(7):
                        for name, op in ops.items():
                            t0 = time.perf_counter()
                            for _ in range(loops):
                                for k, v in caches:
                                    op(q, k, v, tables, cu, lens, D ** -0.5, 0, 0.0)
                            ts[name].append((time.perf_counter() - t0) / loops * 1e3)
                    gb = args.layers * ctx * KVH * D * 2 * dt.itemsize / 1e9
                    cells = [f"{statistics.median(t):.2f} ({gb / statistics.median(t) * 1e3:.1f})" for t in ts.values()]
                    print(f"| {shape} | {str(dt).removeprefix('torch.')} | {ctx} | {threads} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
