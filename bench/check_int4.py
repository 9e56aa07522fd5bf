"""How close the CPU int4 decode paths are to fp32 on the same weights (the embedded Q4_1 GGUF).

    .venv/bin/python bench/check_int4.py [--tokens 512] [--threads 2]

Teacher-forced on the built-in evaluation text, one token per step as decode runs (so the int4
layers take their kernel, not the dense prefill path), three loads of the same file:
  fp32  dequantized weights, fp32 everywhere (equals transformers; tests/test_reference.py)
  cpu_int4  the default CPU path with our int4 kernel (localllm_kernels.cpu_int4: AVX-512 VNNI or AVX2)
  aten  the same with torch's int4 kernel (bf16 matmul inputs), the fallback on other CPUs
For each: perplexity, how often the greedy token (LMHead.greedy, the int4 head plus exact
re-scoring) equals fp32's argmax, and the logit error against fp32.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from localllm.model.attention import AttnMeta
from localllm.model.loader import load_model
from localllm.quant.calib_text import EVAL
from localllm.registry import resolve_model


def teacher_forced(loaded, ids: list[int], kv_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (exact logits [T-1, V], greedy tokens [T-1]) predicting ids[1:], one decode step each
    (the KV cache in `kv_dtype`, default the model's own)."""
    model = loaded.model
    n, bs = len(ids), 16
    caches = model.new_kv_cache(n // bs + 2, bs, kv_dtype or loaded.kv_dtype)
    table = torch.arange(1, n // bs + 2).view(1, -1)
    logits, greedy = [], []
    with torch.inference_mode():
        for p in range(n - 1):
            meta = AttnMeta.captured(table[0, p // bs:p // bs + 1] * bs + p % bs, table, torch.tensor([0, 1]),
                                     torch.tensor([p + 1]))
            hidden = model(torch.tensor([ids[p]]), torch.tensor([p]), meta, caches)
            logits.append(model.logits(hidden)[0])
            greedy.append(model.head.greedy(hidden)[0])
    return torch.stack(logits), torch.stack(greedy)


def agreement_row(label: str, width: int, logits: torch.Tensor, greedy: torch.Tensor, ref_logits: torch.Tensor,
                  ref_greedy: torch.Tensor, target: torch.Tensor, base_ppl: float) -> str:
    """One row of the check scripts' tables: perplexity against the reference's, greedy tokens equal
    to the reference's, the logit error, and the reference's top-2 gap at each flip."""
    top2 = ref_logits.topk(2, dim=-1).values
    gap = top2[:, 0] - top2[:, 1]
    ppl = math.exp(F.cross_entropy(logits, target).item())
    err = (logits - ref_logits).abs()
    flips = (greedy != ref_greedy).nonzero().flatten()
    n = len(target)
    return (f"{label:{width}} {ppl:10.4f} {ppl / base_ppl - 1:+10.4%} {n - len(flips):12d}/{n:<5d} "
            f"{err.max().item():13.2e} {err.mean().item():14.2e}  {[round(gap[i].item(), 3) for i in flips]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(None).local_path
    ref_model = load_model(path, "float32")
    ids = ref_model.tokenizer.encode("\n\n".join(EVAL))[:args.tokens]
    target = torch.tensor(ids[1:])
    ref_logits, _ = teacher_forced(ref_model, ids)
    ref_top = ref_logits.argmax(-1)
    top2 = ref_logits.topk(2, dim=-1).values
    gap = top2[:, 0] - top2[:, 1]
    rows = []
    for name in ("fp32", "cpu_int4", "aten"):
        if name == "fp32":
            logits, greedy = ref_logits, ref_top
        else:
            loaded = load_model(path, "int4", cpu_kernels=name == "cpu_int4")
            kind = loaded.model.layers[0].qkv.kind
            if kind != name:
                print(f"{name}: not available here (got {kind}), skipped")
                continue
            logits, greedy = teacher_forced(loaded, ids)
        ppl = math.exp(F.cross_entropy(logits, target).item())
        err = (logits - ref_logits).abs()
        flips = (greedy != ref_top).nonzero().flatten()
        rows.append((name, ppl, len(ids) - 1 - len(flips), err.max().item(), err.mean().item(),
                     [round(gap[i].item(), 3) for i in flips]))
    print(f"{len(ids) - 1} teacher-forced decode steps, {args.threads} threads")
    print(f"{'path':6} {'perplexity':>10} {'greedy == fp32':>15} {'max |dlogit|':>13} {'mean |dlogit|':>14}  fp32 top-2 gap at flips")
    for name, ppl, same, mx, mean, gaps in rows:
        print(f"{name:6} {ppl:10.4f} {same:9d}/{len(ids) - 1:<5d} {mx:13.2e} {mean:14.2e}  {gaps}")


if __name__ == "__main__":
    main()
