"""localllm against llama.cpp on the same GGUF: logits at every position, and greedy tokens.

    python bench/check_llama_cpp.py [--model PATH.gguf] [--tokens 700] [--decode 32] [--threads 2]

llama.cpp (llama-cpp-python, `make bench-setup`) reads the file with its own code, so a convention
our loader misreads (Gemma's norm weights, attention scale, which layers slide, soft-caps, the
local RoPE base, the embedding scale) shows as a logit difference that the two engines' arithmetic
does not explain. That arithmetic differs (llama.cpp's Q4_1 matmuls round activations to 8 bits,
f16 K/V), so agreement is close, not exact: run the same check on a llama-family file for the
numbers a correct model gives. Not part of CI (llama-cpp-python is a bench extra).

One prompt of --tokens ids (the evaluation text, repeated), then --decode greedy tokens each
engine picks itself. Logits compared at each position, split at the smallest sliding window
(positions past it attend over a clipped window in local layers):
  prefill  ours from Engine.score (chunked prefill) on prompt + llama.cpp's continuation
  decode   ours one token a step (the decode kernels), same ids
against llama.cpp's (the prompt in 512-token batches, the continuation a token a step). Per row:
max |diff| / std of llama.cpp's logits, top-1 equal, KL(llama.cpp || ours); at top-1 flips,
llama.cpp's own top-2 gap (a near-tie flips on rounding alone).
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
import torch.nn.functional as F
from check_int4 import teacher_forced

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.model.loader import load_model
from localllm.model.weights import open_weights
from localllm.quant.calib_text import EVAL
from localllm.registry import resolve_model
from localllm.sampling import SamplingParams


def prompt(path: str, n: int) -> list[int]:
    ids = open_weights(path).tokenizer().encode("\n\n".join(EVAL))
    return (ids * (n // len(ids) + 1))[:n]


def llama_cpp_run(path: str, ids: list[int], decode: int, threads: int) -> tuple[torch.Tensor, list[int]]:
    """-> (logits [len(ids) + decode - 1, V] at every position but the last token's, greedy tokens)."""
    from llama_cpp import Llama

    llm = Llama(path, n_ctx=len(ids) + decode + 16, n_batch=512, n_threads=threads, n_threads_batch=threads,
                logits_all=True, verbose=False)
    llm.eval(ids)
    toks = [int(np.argmax(llm.scores[len(ids) - 1]))]
    for _ in range(decode - 1):
        llm.eval([toks[-1]])
        toks.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
    logits = torch.from_numpy(np.array(llm.scores[:len(ids) + decode - 1], dtype=np.float32))
    llm.close()
    return logits, toks


def agreement(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    """Per-row comparison of two [T, V] logit matrices, summarised over the rows."""
    rel = ((ours - ref).abs().amax(-1) / ref.std(-1)).tolist()
    kl = F.kl_div(F.log_softmax(ours, -1), F.log_softmax(ref, -1), log_target=True, reduction="none").sum(-1).tolist()
    flips = (ours.argmax(-1) != ref.argmax(-1)).nonzero().flatten()
    top2 = ref.topk(2, dim=-1).values
    return {"rows": len(rel), "rel_max_median": statistics.median(rel), "rel_max_max": max(rel),
            "top1": 1 - len(flips) / len(rel), "kl_median": statistics.median(kl), "kl_max": max(kl),
            "flip_gaps": [round((top2[i, 0] - top2[i, 1]).item(), 3) for i in flips]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="GGUF file (default: the embedded model)")
    ap.add_argument("--tokens", type=int, default=700, help="prompt length (past the sliding window)")
    ap.add_argument("--decode", type=int, default=32, help="greedy tokens after the prompt")
    ap.add_argument("--precision", default="auto", help="localllm's (auto: the file's int4 as `run` loads it)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = args.model or str(resolve_model(None).local_path)
    ids = prompt(path, args.tokens)
    ref, ref_toks = llama_cpp_run(path, ids, args.decode, args.threads)

    loaded = load_model(path, args.precision)
    cfg = loaded.config
    windows = [cfg.window(i) for i in range(cfg.num_layers)]
    split = min((w for w in windows if w), default=None)
    engine = LLMEngine(loaded, EngineConfig(max_model_len=len(ids) + args.decode + 16, enable_prefix_caching=False,
                                            parallel=1, num_threads=args.threads, compile=False))
    params = SamplingParams(temperature=0, max_tokens=args.decode, ignore_eos=True)
    out = None
    for out in engine.generate(ids, params):  # noqa: B007
        pass
    toks = list(out.token_ids)
    seq = ids + ref_toks[:-1]  # llama.cpp's continuation, so both score the same ids
    paths = {"prefill": engine.score(seq)[:len(seq)], "decode": teacher_forced(loaded, seq + [0])[0]}

    same = next((i for i, (a, b) in enumerate(zip(toks, ref_toks)) if a != b), len(toks))
    res = {"model": path, "precision": args.precision, "layer_kinds": "".join("L" if w else "G" for w in windows),
           "tokens": len(ids), "decode": args.decode, "greedy_same_prefix": same, "ours": toks, "llama.cpp": ref_toks}
    kinds = f" ({res['layer_kinds']}: L = window {split})" if split else ""
    print(f"{path}: {cfg.architecture}, {cfg.num_layers} layers{kinds}, "
          f"localllm {args.precision} vs llama.cpp, {len(ids)} prompt tokens + {args.decode} greedy")
    print(f"greedy tokens: {same}/{args.decode} equal before the first difference")
    print(f"{'path':8} {'positions':>11} {'rows':>5} {'max|d|/std med':>15} {'max':>7} {'top-1':>7} "
          f"{'KL med':>9} {'KL max':>9}  top-2 gap at flips")
    edges = [0, split, len(seq)] if split and split < len(seq) else [0, len(seq)]
    for name, ours in paths.items():
        for a, b in zip(edges, edges[1:]):
            r = agreement(ours[a:b].float(), ref[a:b])
            res[f"{name}_{a}_{b}"] = r
            print(f"{name:8} {f'{a}-{b - 1}':>11} {r['rows']:5d} {r['rel_max_median']:15.4f} {r['rel_max_max']:7.3f} "
                  f"{r['top1']:7.1%} {r['kl_median']:9.2e} {r['kl_max']:9.2e}  {r['flip_gaps'][:8]}")
    res["ref_std"] = ref.std(-1).mean().item()
    print(f"llama.cpp's logits: std {res['ref_std']:.2f} per row (mean)")
    return res


if __name__ == "__main__":
    main()
