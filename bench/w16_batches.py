"""An HF bf16 checkpoint on CPU: its 16-bit weights on our kernel (the default) against the fp32
copy (`--quant fp32`, what the default was before), aggregate decode tok/s at 1 and 16 streams.

    python bench/w16_batches.py [--dir DIR] [--threads 2] [--rounds 3] [--tokens 32]

DIR: a bf16 safetensors checkpoint (default: the embedded model's weights written in bf16 by
transformers into ~/.cache/localllm/bench/smollm2-135m-bf16, made on first use). Both engines
run eagerly (a first contact: no compiled step), in one process, interleaved round by round
(each round measures every precision once at each batch size, via localllm.bench's
bench_batches); medians over rounds. Prints a table and the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def bf16_checkpoint(out: Path) -> Path:
    """The embedded model's weights in bf16, written by transformers (as hub checkpoints are)."""
    if (out / "config.json").is_file():
        return out
    import shutil
    import tempfile

    import torch
    import transformers

    from localllm.model.export import export_hf
    from localllm.registry import resolve_model

    with tempfile.TemporaryDirectory() as tmp:
        fp32 = export_hf(resolve_model("smollm2-135m").local_path, Path(tmp) / "fp32")
        model = transformers.AutoModelForCausalLM.from_pretrained(str(fp32), dtype=torch.bfloat16)
        model.save_pretrained(out, safe_serialization=True)
        for f in fp32.iterdir():
            if f.suffix != ".safetensors" and not (out / f.name).exists():
                shutil.copy(f, out / f.name)
    return out


def main() -> None:
    from localllm.paths import cache_home

    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    import torch

    from localllm.bench import bench_batches
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine
    from localllm.model.loader import load_model

    torch.set_num_threads(args.threads)
    path = bf16_checkpoint(args.dir or cache_home() / "bench" / "smollm2-135m-bf16")
    engines, loads = {}, {}
    for precision in ("auto", "float32"):
        t0 = time.perf_counter()
        loaded = load_model(path, precision)
        loads[precision] = {"precision": loaded.precision, "load_s": time.perf_counter() - t0,
                            "weights_mb": sum(t.numel() * t.element_size() for t in
                                              list(loaded.model.parameters()) + list(loaded.model.buffers())) / 2**20}
        print(f"{precision}: {loads[precision]}", flush=True)
        engines[precision] = LLMEngine(loaded, EngineConfig(max_model_len=512, num_threads=args.threads,
                                                            max_num_seqs=16, num_kv_blocks=16 * 8 + 40,
                                                            enable_prefix_caching=False, compile=False))
    rates: dict[str, dict[str, list[float]]] = {p: {"1": [], "16": []} for p in engines}
    for _ in range(args.rounds):
        for p, eng in engines.items():
            r = bench_batches(eng, (1, 16), args.tokens, 1)
            for b in ("1", "16"):
                rates[p][b].append(r[b]["aggregate_tok_per_s"])
            print(f"round: {p} {r['1']['aggregate_tok_per_s']:.2f} tok/s at 1 stream, "
                  f"{r['16']['aggregate_tok_per_s']:.2f} at 16", flush=True)
    result = {p: {**loads[p], **{f"aggregate_{b}": statistics.median(v) for b, v in rates[p].items()},
                  "runs": rates[p]} for p in engines}
    print(f"{'--quant':8} {'weights as held':62} {'MB':>6} {'1 stream':>9} {'16 streams':>11}")
    for p, r in result.items():
        print(f"{p:8} {r['precision']:62} {r['weights_mb']:6.0f} {r['aggregate_1']:9.1f} {r['aggregate_16']:11.1f}")
    print(json.dumps({"threads": args.threads, "tokens": args.tokens, "rounds": args.rounds, **result}))


if __name__ == "__main__":
    main()
