"""KV cache precision on the real model: teacher-forced decode with a 16-bit and the 8-bit q8_0 KV
cache (--kv-type) against the fp32 cache, same weights (the embedded model's default int4 path).

    .venv/bin/python bench/check_kv.py [--tokens 600] [--threads 2]

One token per step as decode runs, so every step reads the whole context back from the cache.
Reports perplexity on the built-in evaluation text, how often the greedy token equals the fp32-KV
path's, and the logit error.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from check_int4 import agreement_row, teacher_forced  # noqa: E402  (bench/ is on sys.path when run as a script)

from localllm.model.attention import kv_type_name
from localllm.model.loader import load_model
from localllm.quant.calib_text import EVAL
from localllm.registry import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(resolve_model(None).local_path, args.precision)
    ids = loaded.tokenizer.encode("\n\n".join(EVAL))[:args.tokens]
    target = torch.tensor(ids[1:])
    ref_logits, ref_greedy = teacher_forced(loaded, ids, torch.float32)
    print(f"{len(ids) - 1} teacher-forced decode steps, {args.threads} threads, weights: {loaded.precision}")
    print(f"{'KV':9} {'perplexity':>10} {'vs fp32 KV':>10} {'greedy == fp32 KV':>18} {'max |dlogit|':>13} "
          f"{'mean |dlogit|':>14}  fp32-KV top-2 gap at flips")
    base = math.exp(F.cross_entropy(ref_logits, target).item())
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.uint8):  # uint8: the q8_0 cache
        logits, greedy = (ref_logits, ref_greedy) if dtype == torch.float32 else teacher_forced(loaded, ids, dtype)
        print(agreement_row(kv_type_name(dtype), 9, logits, greedy, ref_logits, ref_greedy, target, base))

if __name__ == "__main__":
    main()
