"""The cost of --act-bits 8 on the real model: teacher-forced decode (one token per step, the
kernels' batch-1 path) with the default 16-bit activations and with 8-bit ones, against the same
weights in fp32 (the file's dequantized values, exact).

    .venv/bin/python bench/check_act_bits.py [--model FILE.gguf] [--tokens 600] [--threads 2]

Reports perplexity on the built-in evaluation text, how often the greedy token equals the fp32
path's (with the fp32 top-2 gap at each flip: near-ties flip first), and the logit error.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from check_int4 import agreement_row, teacher_forced  # noqa: E402  (bench/ is on sys.path when run as a script)

from localllm.model.loader import load_model
from localllm.quant.calib_text import EVAL
from localllm.registry import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="a GGUF file (default: the embedded model)")
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or resolve_model(None).local_path
    ref = load_model(path, "float32")
    ids = ref.tokenizer.encode("\n\n".join(EVAL))[:args.tokens]
    target = torch.tensor(ids[1:])
    ref_logits, ref_greedy = teacher_forced(ref, ids)
    del ref
    loaded = load_model(path, "auto")
    print(f"{len(ids) - 1} teacher-forced decode steps, {args.threads} threads, weights: {loaded.precision}")
    print(f"{'run':24} {'perplexity':>10} {'vs fp32':>10} {'greedy == fp32':>18} {'max |dlogit|':>13} "
          f"{'mean |dlogit|':>14}  fp32 top-2 gap at flips")
    base = math.exp(F.cross_entropy(ref_logits, target).item())
    print(f"{'fp32 weights (reference)':24} {base:10.4f}")
    for bits in (16, 8):
        loaded.model.use_act_bits(bits)
        logits, greedy = teacher_forced(loaded, ids)
        print(agreement_row(f"--act-bits {bits}", 24, logits, greedy, ref_logits, ref_greedy, target, base))

if __name__ == "__main__":
    main()
