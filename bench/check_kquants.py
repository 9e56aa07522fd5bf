"""The embedded model in the GGUF types people download, made by llama.cpp's own quantizer, run by
us against transformers' fp32 on the same file's values, and timed.

    python bench/check_kquants.py [--types Q4_K_M,Q5_K_M,Q6_K,Q8_0,IQ4_XS] [--out DIR] [--tokens 64]
                                  [--threads 2] [--runs 3] [--json]

Needs llama-cpp-python (the bench extra: `llama_cpp.llama_model_quantize`); not part of CI.
  1. an F32 GGUF of the embedded model's weights (its Q4_1 / Q8_0 values dequantized, every
     metadata key copied), then llama_model_quantize into each type, as published files are made
     (the _M mixes keep some tensors in Q6_K; rows whose length is not a multiple of 256, the
     135M model's 576, fall back to Q5_0 / Q5_1 / Q8_0 / IQ4_NL as llama.cpp does it);
  2. per file: its tensor types, what our loader built (layer classes, bytes of the layers vs the
     file's), greedy tokens of the three chat prompts against transformers' fp32 on the same file
     (tests/test_reference.py's setup; a flip's top-2 gap in transformers' logits shows a near-tie);
  3. decode tok/s at batch 1 after a 32-token prompt (medians of --runs interleaved rounds): ours
     on the file's blocks, ours on fp32 copies of them (--quant float32: the path K-quants took
     before), llama.cpp on the same file. Our engines run eagerly here (no compiled step): for
     the default settings' figures run bench/compare.py --model on a file this script wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from localllm.config import EngineConfig  # noqa: E402
from localllm.engine.engine import LLMEngine  # noqa: E402
from localllm.model.loader import load_model  # noqa: E402
from localllm.model.weights import open_weights  # noqa: E402
from localllm.registry import resolve_model  # noqa: E402
from localllm.sampling import SamplingParams  # noqa: E402

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers and explain why they are prime."]
# llama.cpp's llama_ftype values (llama.h)
FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_M": 12, "Q4_K_S": 14,
          "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30,
          "MXFP4_MOE": 38}  # (MXFP4_MOE: an MoE's experts MXFP4, the other matrices Q8_0)


def write_f32(src: Path, out: Path) -> Path:
    """The GGUF `src` with every tensor dequantized to F32 (same names, order, metadata)."""
    import gguf

    from localllm.model.gguf import dequantize, read_gguf

    reader = gguf.GGUFReader(str(src))
    ours = read_gguf(src)
    w = gguf.GGUFWriter(str(out) + ".partial", reader.fields["general.architecture"].contents())
    skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", "general.file_type"}
    for key, fld in reader.fields.items():
        if key in skip:
            continue
        vtype = fld.types[0]
        w.add_key_value(key, fld.contents(), vtype, fld.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for name, t in ours.tensors.items():
        w.add_tensor(name, np.ascontiguousarray(dequantize(t), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(str(out) + ".partial", out)
    return out


def quantize(f32: Path, kind: str, out: Path, threads: int) -> Path:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode() + b".partial", params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize to {kind} failed ({rc})")
    os.replace(str(out) + ".partial", out)
    return out


def tensor_types(path: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in open_weights(path).file.tensors.values():
        if len(t.shape) > 1:
            counts[t.qtype.name] = counts.get(t.qtype.name, 0) + 1
    return counts


def layer_summary(loaded) -> tuple[dict[str, int], int]:
    """(layer class -> count over the decoder's linears, bytes of the decoder layers' tensors)."""
    from localllm.model.layers import ConcatLinear, DenseLinear, Int4Linear, Int8wLinear

    kinds: dict[str, int] = {}
    for layer in loaded.model.layers:
        for f in ("qkv", "o", "gate_up", "down"):
            m = getattr(layer, f)
            for p in (m.parts if isinstance(m, ConcatLinear) else [m]):
                if isinstance(p, (Int4Linear, Int8wLinear, DenseLinear)):
                    kinds[type(p).__name__] = kinds.get(type(p).__name__, 0) + 1
    nbytes = sum(t.numel() * t.element_size() for layer in loaded.model.layers
                 for t in (*layer.parameters(), *layer.buffers()))
    return kinds, nbytes


def exact_layers(loaded, path: Path) -> str:
    """How many of the decoder's fused linears hold exactly gguf-py's dequantized values of their
    tensors (the file's blocks, as llama.cpp's quantizer wrote them)."""
    from test_gguf_kquants import layer_values

    weights, mods = open_weights(path), loaded.config.checkpoint_linears()
    equal = total = 0
    for i, layer in enumerate(loaded.model.layers):
        for f in ("qkv", "o", "gate_up", "down"):
            ref = torch.cat([weights.dense(f"model.layers.{i}.{m}.weight") for m in mods[f]])
            equal += torch.equal(layer_values(getattr(layer, f)), ref)
            total += 1
    return f"{equal}/{total}"


def engine(loaded, threads: int) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(max_model_len=2048, enable_prefix_caching=False, parallel=1,
                                          num_threads=threads, compile=False))


def greedy(eng: LLMEngine, prompt: str, n: int) -> tuple[list[int], list[int]]:
    msgs = [{"role": "user", "content": prompt}]
    ids = eng.encode_prompt(msgs)
    *_, last = eng.generate(msgs, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return ids, last.token_ids


def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and each step's top-2 logit gap."""
    out, gaps, past, x = [], [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            r = model(x, past_key_values=past, use_cache=True)
            past = r.past_key_values
            top = r.logits[0, -1].float().topk(2)
            out.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            x = torch.tensor([[out[-1]]])
    return out, gaps


def decode_rate(eng: LLMEngine, ids: list[int], n: int) -> float:
    stamps = []
    for _ in eng.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)):
        stamps.append(time.perf_counter())
    return (n - 1) / (stamps[-1] - stamps[0])


def llama_cpp_rate(llm, ids: list[int], n: int) -> float:
    llm.reset()
    llm.eval(ids)
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t0 = time.perf_counter()
    for _ in range(n - 1):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    return (n - 1) / (time.perf_counter() - t0)


def check(path: Path, args) -> dict:
    import transformers

    res: dict = {"file": str(path), "file_bytes": path.stat().st_size, "tensor_types": tensor_types(path)}
    t0 = time.perf_counter()
    ours = load_model(path, "auto")
    res["load_s"] = time.perf_counter() - t0
    res["precision"] = ours.precision
    res["layers"], res["layer_bytes"] = layer_summary(ours)
    res["layers_equal_to_gguf_dequantize"] = exact_layers(ours, path)
    eng = engine(ours, args.threads)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    res["greedy"] = []
    for p in PROMPTS:
        ids, toks = greedy(eng, p, args.tokens)
        ref, gaps = hf_greedy(hf, ids, args.tokens)
        first = next((i for i, (a, b) in enumerate(zip(toks, ref)) if a != b), None)
        res["greedy"].append({"equal": toks == ref, "first_flip": first,
                              "top2_gap_at_flip": None if first is None else round(gaps[first], 4)})
    del hf
    dense = load_model(path, "float32")
    res["dense_layer_bytes"] = layer_summary(dense)[1]
    engines = {"ours": eng, "ours_fp32_dense": engine(dense, args.threads)}
    llm = None
    try:
        from llama_cpp import Llama

        llm = Llama(str(path), n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads, verbose=False,
                    logits_all=True)
    except ImportError:
        pass
    ids = ours.tokenizer.encode("The history of computing is a story of people turning ideas into machines. " * 3)[:32]
    rates: dict[str, list[float]] = {k: [] for k in (*engines, *(["llama.cpp"] if llm else []))}
    for _ in range(args.runs):  # interleaved: a busy machine slows every engine alike
        for k, e in engines.items():
            rates[k].append(decode_rate(e, ids, args.decode))
        if llm:
            rates["llama.cpp"].append(llama_cpp_rate(llm, ids, args.decode))
    res["decode_tok_s"] = {k: round(statistics.median(v), 1) for k, v in rates.items()}
    if llm:
        llm.close()
    return res


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="Q4_K_M,Q5_K_M,Q6_K,Q8_0,IQ4_XS")
    ap.add_argument("--out", default=str(Path(__file__).parent / "models"))
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--decode", type=int, default=64, help="tokens per timed decode")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src = resolve_model("smollm2-135m").local_path
    f32 = out / "smollm2-135m.F32.gguf"
    if not f32.is_file():
        write_f32(src, f32)
    results = []
    for kind in args.types.split(","):
        path = out / f"smollm2-135m.{kind}.gguf"
        if not path.is_file():
            quantize(f32, kind, path, args.threads)
        r = check(path, args)
        results.append(r)
        print(json.dumps(r) if args.json else f"{kind}: {json.dumps(r, indent=1)}", flush=True)
    return results


if __name__ == "__main__":
    main()
