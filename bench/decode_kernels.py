"""A decode step's kernels as the engine meets them: every layer's weights and KV cache streaming
from memory (30 copies of the default model's layer shapes, so nothing stays in L2/L3), wall time
at the given threads, medians of several passes.

    .venv/bin/python bench/decode_kernels.py [--threads 2] [--lib OLD.so ...]

- head: the exact Q8_0 head (49152 x 576: what every sampled token reads), 1 and 4 rows;
- int4: the four layer matrices per layer in our int4 layout (Q4_1-like, group 32), 1 row;
- int8-lane: the same matrices with Q8_0 values (byte lanes), 6-bit values in two bit planes and
  in byte lanes (Q6_K's two layouts), 5-bit values in one plane, 1 row;
- attention: one new token over 30 layers' fp16 and fp32 caches at 40 and 2,000 positions
  (9 query heads over 3 KV heads of 64).

--lib loads the given kernel libraries (e.g. copies of ~/.cache/localllm/kernels/*.so from another
commit) in place of this checkout's, to compare two versions in one way (run each in its own process).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

LAYER = [(3072, 576), (576, 1536), (960, 576), (576, 576)]  # gate_up, down, qkv, o
LAYERS = 30


def timed(fn, passes: int = 9) -> float:
    """Median wall ms of one pass."""
    fn()
    ts = []
    for _ in range(passes):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def report(name: str, ms: float, nbytes: int) -> None:
    print(f"| {name} | {ms:.2f} | {nbytes / 1e6:.1f} | {nbytes / ms / 1e6:.1f} |")


def head(g: torch.Generator) -> None:
    n, k = 49152, 576
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 0.001).half().view(torch.uint8)
    q = torch.randint(-127, 128, (n, k // 32, 32), dtype=torch.int8, generator=g).view(torch.uint8)
    blocks = torch.cat([d, q], 2).contiguous()
    for m in (1, 4):
        x = torch.randn(m, k, generator=g)
        report(f"Q8_0 head, {m} row(s)", timed(lambda x=x: torch.ops.localllm.q8_0_gemm(x, blocks), 30), blocks.numel())


def int4(g: torch.Generator) -> None:
    mats = []
    for _ in range(LAYERS):
        for n, k in LAYER:
            w = torch.randint(0, 256, (n // 16, k // 8, 64), dtype=torch.uint8, generator=g)
            sc = (torch.rand(n // 16, k // 32, 2, 16, generator=g) * 0.01).half()
            mats.append((w, sc, torch.randn(1, k, generator=g)))
    nbytes = sum(w.numel() + sc.numel() * 2 for w, sc, _ in mats)

    def run():
        for w, sc, x in mats:
            torch.ops.localllm.int4_gemm(x, w, sc, 32)

    report("int4 layers, 1 row", timed(run), nbytes)


def int8_lanes(g: torch.Generator) -> None:
    from localllm_kernels import cpu_int8

    # (name, value bits, layout bits, zero point, group)
    for name, bits, layout, zero, gs in (("Q8_0 byte lanes", 8, 8, 128, 32), ("6-bit, 2 planes", 6, 6, 32, 16),
                                         ("6-bit, byte lanes", 6, 8, 32, 16), ("5-bit, 1 plane", 5, 5, 16, 32)):
        mats = []
        for _ in range(LAYERS):
            for n, k in LAYER:
                q = torch.randint(0, 2 ** bits, (n, k), dtype=torch.uint8, generator=g)
                w, sc = cpu_int8.pack(q, torch.rand(n, k // gs, generator=g) * 0.01, None, zero, bits=layout)
                mats.append((w, sc, torch.randn(1, k, generator=g)))
        nbytes = sum(w.numel() + sc.numel() * sc.element_size() for w, sc, _ in mats)

        def run(mats=mats, gs=gs, zero=zero):
            for w, sc, x in mats:
                torch.ops.localllm.int8w_gemm(x, w, sc, gs, zero)

        report(f"int8-lane layers ({name}), 1 row", timed(run), nbytes)


def attention(g: torch.Generator) -> None:
    h, kvh, d, bs = 9, 3, 64, 16
    for dt in (torch.float16, torch.float32):
        for ctx in (40, 2000):
            nblk = -(-ctx // bs)
            caches = [(torch.randn(nblk + 1, bs, kvh, d, generator=g).to(dt),
                       torch.randn(nblk + 1, bs, kvh, d, generator=g).to(dt)) for _ in range(LAYERS)]
            tables, cu, lens = torch.arange(1, nblk + 1)[None], torch.tensor([0, 1]), torch.tensor([ctx])
            q = torch.randn(1, h, d, generator=g)

            def run(caches=caches, tables=tables, cu=cu, lens=lens, q=q):
                for k, v in caches:
                    torch.ops.localllm.paged_attention(q, k, v, tables, cu, lens, d ** -0.5, 0, 0.0)

            nbytes = LAYERS * 2 * ctx * kvh * d * dt.itemsize
            report(f"attention, {str(dt)[6:]} cache, {ctx} positions", timed(run, 15), nbytes)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lib", nargs="*", default=[], help="kernel libraries to load instead of this checkout's")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.lib:
        for lib in args.lib:
            torch.ops.load_library(lib)
    else:
        from localllm_kernels import cpu_attention, cpu_int4, cpu_int8, cpu_q8

        assert cpu_q8.load() and cpu_int4.load() and cpu_int8.load() and cpu_attention.load()
    ops = torch.ops.localllm
    print(f"{args.threads} thread(s); {LAYERS} layers of SmolLM2-135M's shapes, streaming from memory")
    print("| kernel | ms per pass | MB read | GB/s |")
    print("|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name, fn, op in (("head", head, "q8_0_gemm"), ("int4", int4, "int4_gemm"),
                         ("int8", int8_lanes, "int8w_gemm"), ("attention", attention, "paged_attention")):
        if hasattr(ops, op):
            fn(g)
        else:
            print(f"| {name}: no library loaded with {op} | | | |")


if __name__ == "__main__":
    main()
