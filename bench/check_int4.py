"""How close the CPU int4 decode paths are to fp32 on the same weights (the embedded Q4_1 GGUF).

    .venv/bin/python bench/check_int4.py [--tokens 512] [--threads 2]

Teacher-forced on the built-in evaluation text, one token per step as decode runs (so the int4
layers take their kernel, not the dense prefill path), three loads of the same file:
  fp32  dequantized weights, fp32 everywhere (equals transformers; tests/test_reference.py)
  vnni  the default CPU path with our AVX-512 VNNI kernel (localllm_kernels.cpu_int4)
  aten  the same with torch's int4 kernel (bf16 matmul inputs), the fallback on other CPUs
For each: perplexity, how often the greedy token (LMHead.greedy, the int4 head plus exact
re-scoring) equals fp32's argmax, and the logit error against fp32.
"""

from __future__ import annotations

import argparse
import math
import os

os.environ["LOCALLLM_CONVERT_CACHE"] = "0"  # the aten load must not read the vnni conversion cache

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from localllm.model import layers  # noqa: E402
from localllm.model.compiled import decode_step  # noqa: E402
from localllm.model.loader import load_model  # noqa: E402
from localllm.quant.calib_text import EVAL  # noqa: E402
from localllm.registry import resolve_model  # noqa: E402


def teacher_forced(loaded, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (exact logits [T-1, V], greedy tokens [T-1]) predicting ids[1:], one decode step each."""
    model, cfg = loaded.model, loaded.config
    n = len(ids)
    caches = [(torch.empty(n, 1, cfg.num_kv_heads, cfg.head_dim), torch.empty(n, 1, cfg.num_kv_heads, cfg.head_dim))
              for _ in range(cfg.num_layers)]
    gather = torch.arange(n).view(1, -1)
    logits, greedy = [], []
    with torch.inference_mode():
        for p in range(n - 1):
            hidden, _ = decode_step(model, torch.tensor([ids[p]]), torch.tensor([p]), gather[:, :p + 1], caches, False)
            logits.append(model.logits(hidden)[0])
            greedy.append(model.head.greedy(hidden)[0])
    return torch.stack(logits), torch.stack(greedy)


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
    rows, ours = [], layers._vnni_kernel
    for name in ("fp32", "vnni", "aten"):
        if name == "fp32":
            logits, greedy = ref_logits, ref_top
        else:
            layers._vnni_kernel = ours if name == "vnni" else (lambda *a: False)
            loaded = load_model(path, "int4")
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
