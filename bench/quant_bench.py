"""Perplexity and CPU decode speed of the default model (SmolLM2-135M) in each precision.

    .venv/bin/python bench/quant_bench.py [--out DIR] [--threads N] [--decode-tokens 64]

Baseline: the embedded GGUF exported to a dense fp32 HF checkpoint. Perplexity is on the built-in
held-out English sample (localllm/quant/calib_text.py EVAL), deterministic. int4 checkpoints are
written by our quantizer (group 64: 576 = 9 x 64) with the built-in calibration text; "default" is
what `localllm quantize --method gptq` does (act-order, asymmetric, Hessian-weighted scale search).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.model.export import export_hf
from localllm.model.loader import load_model
from localllm.quant.calib_text import EVAL
from localllm.quant.quantize import perplexity, quantize_model
from localllm.registry import resolve_model
from localllm.sampling import SamplingParams


def decode_speed(loaded, n: int) -> float:
    eng = LLMEngine(loaded, EngineConfig(num_kv_blocks=64))
    msgs = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    first = last = None
    for _ in eng.generate(msgs, params):  # tokens after the first one: decode only
        last = time.perf_counter()
        first = first or last
    return (n - 1) / (last - first)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--decode-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(args.out or tempfile.mkdtemp(prefix="quant_bench_"))
    src = root / "fp32"
    if not (src / "config.json").is_file():
        export_hf(resolve_model(None).local_path, src)
    ids = load_model(src, "float32").tokenizer.encode("\n\n".join(EVAL))
    rows = []

    def measure(label: str, path: Path, precision: str, note: str = "") -> None:
        loaded = load_model(path, precision)
        ppl = perplexity(loaded, ids)
        tps = decode_speed(loaded, args.decode_tokens)
        rows.append((label, ppl, tps, note))
        print(f"{label:<28} ppl {ppl:7.3f}  decode {tps:6.1f} tok/s  {note}", flush=True)

    measure("fp32 (reference)", src, "float32")
    measure("bf16", src, "bfloat16")
    measure("int8 (on load)", src, "int8")
    measure("int4 RTN (on load)", src, "int4", "quantize_rtn, group 128 where K allows, else 64")
    plain = {"act_order": False, "mse": False}
    for label, method, kw in [("int4 RTN (ours, sym)", "rtn", {"sym": True}), ("int4 RTN (ours, asym)", "rtn", {}),
                              ("int4 GPTQ sym", "gptq", {**plain, "sym": True}),
                              ("int4 GPTQ act-order sym", "gptq", {"mse": False, "sym": True}),
                              ("int4 GPTQ act-order asym", "gptq", {"mse": False}),
                              ("int4 GPTQ (default)", "gptq", {}),  # act-order, asym, scale search
                              ("int4 AWQ", "awq", {})]:
        t = time.perf_counter()
        r = quantize_model(src, root / label.replace(" ", "_"), method, **kw)
        measure(label, r.path, "auto", f"group {r.group_size}, quantized in {time.perf_counter() - t:.0f} s")
    base = rows[0][1]
    print("\n| precision | perplexity | vs fp32 | decode tok/s | notes |\n|---|---|---|---|---|")
    for label, ppl, tps, note in rows:
        print(f"| {label} | {ppl:.2f} | {100 * (ppl / base - 1):+.1f}% | {tps:.1f} | {note} |")


if __name__ == "__main__":
    main()
