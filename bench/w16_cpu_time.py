"""An HF bf16 checkpoint on CPU, 16-bit weights on our kernel (the default) against the fp32 copy
(`--quant fp32`), decode measured in process CPU time: tokens per CPU-second at 1 and 16
streams, one thread, eager, interleaved rounds (medians). On a machine loaded by other work,
CPU time is what a step costs; wall time mostly measures the wait for a core.

    python bench/w16_cpu_time.py [--rounds 3] [--tokens 16]

Uses bench/w16_batches.py's checkpoint (the embedded model written in bf16 by transformers).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from w16_batches import bf16_checkpoint

    from localllm.bench import _drain, _tokens
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine
    from localllm.model.loader import load_model
    from localllm.paths import cache_home
    from localllm.sampling import SamplingParams

    path = bf16_checkpoint(cache_home() / "bench" / "smollm2-135m-bf16")
    engines = {p: LLMEngine(load_model(path, p), EngineConfig(max_model_len=512, num_threads=1, max_num_seqs=16,
                                                             num_kv_blocks=200, enable_prefix_caching=False,
                                                             compile=False))
               for p in ("auto", "float32")}
    res = {p: {1: [], 16: []} for p in engines}
    T = args.tokens
    for r in range(args.rounds):
        for p, e in engines.items():
            for b in (1, 16):
                for i in range(b):  # a warm-up of this batch shape, outside the timing
                    e.add_request(_tokens(e, 32, 5000 * (r + 1) + 100 * b + i), SamplingParams(temperature=0, max_tokens=2))
                _drain(e)
                for i in range(b):
                    e.add_request(_tokens(e, 32, 7000 * (r + 1) + 100 * b + i),
                                  SamplingParams(temperature=0, max_tokens=T, ignore_eos=True))
                e.step()  # the prefill step (and each sequence's first token)
                t0 = time.process_time()
                _drain(e)
                res[p][b].append(b * (T - 1) / (time.process_time() - t0))
            print(r, p, {b: round(v[-1], 1) for b, v in res[p].items()}, flush=True)
    for p in res:
        print(p, engines[p].loaded.precision, {b: round(statistics.median(v), 1) for b, v in res[p].items()})


if __name__ == "__main__":
    main()
