"""Random-weight Q4_1 GGUFs of real model shapes, carrying the embedded model's tokenizer.

    python bench/make_gguf.py llama-1b  [--out DIR]      # Llama-3.2-1B shape (16 x 2048, GQA 32/8)
    python bench/make_gguf.py smollm2-1.7b [--out DIR]   # SmolLM2-1.7B shape (24 x 2048, 32 KV heads)
    python bench/make_gguf.py qwen3-1.7b [--out DIR]     # Qwen3-1.7B shape (arch qwen3: q/k norms,
                                                         # head_dim 128, a 151,936-token vocabulary)
    python bench/make_gguf.py moe-olmoe-shape [--out DIR]  # OLMoE-1B-7B's shape as arch qwen3moe:
                                                         # 16 x 2048, 64 experts of 1024, top-8 (~4 GB)
    python bench/make_gguf.py gemma3-1b [--out DIR]      # Gemma 3 1B (arch gemma3: 5 local : 1 global,
                                                         # window 512, q/k norms, 262,144-token vocab)
    python bench/make_gguf.py gemma2-2b [--out DIR]      # Gemma 2 2B (arch gemma2: every other layer
                                                         # local, window 4096, soft-caps 50 / 30)
    python bench/make_gguf.py gpt-oss-20b [--out DIR]    # gpt-oss-20b (arch gpt-oss: 24 x 2880, 32
                                                         # experts of 2880, top 4, sinks, biases, yarn)
                                                         # as the published file: MXFP4 experts (random
                                                         # blocks), Q8_0 matrices (~12 GB)
    python bench/make_gguf.py llama-1b --type Q4_K_M     # any llama.cpp file type (Q4_K_M, Q5_K_M,
                                                         # Q6_K, Q8_0, IQ4_XS, ...): an F16 file of the
                                                         # shape (kept beside it, reused), then
                                                         # llama.cpp's own quantizer, as published
                                                         # files are made (needs the bench extra)

The metadata (tokenizer, chat template, special tokens) is copied from SmolLM2-135M's GGUF, the
shape keys are replaced, and every tensor gets the type it has there (Q4_1 matrices, Q8_0
embeddings, F32 norms), so llama.cpp and localllm read the same file the way they read a real
one. Weights are N(0, 0.02) and norms 1: the numbers are meaningless, the bytes per token are not.
Qwen3 shapes keep the tokenizer but pad its vocabulary with unused tokens to Qwen3's 151,936, so
the embedding and head weigh what they do in the real model (Gemma's likewise).
The Gemma shapes carry the keys and tensor names llama.cpp's converter writes for them, and
weights meant for bench/check_llama_cpp.py rather than for timing alone: norms 1 + 0.2 N(0, 1)
(a file holds Gemma's 1 + w: reading it as w + 1 again, or a norm in the wrong place, shows),
matrices scaled as the tests' peaked shapes, an embedding giving logits of std ~4 (greedy tokens
are no near-ties; the 30 soft-cap bends without saturating), and post-norms with a gain of
sqrt(hidden) / 6, so the layers outweigh the embedding in the residual (else, tied, the logit of
the input token itself dominates every row and each engine just repeats it).
Used by bench/compare.py (--model) for the side-by-side tables at real sizes.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

SHAPES = {
    # vocab stays SmolLM2's 49152 (its tokenizer); embeddings tied as in both real models
    "llama-1b": dict(block_count=16, embedding_length=2048, feed_forward_length=8192, head_count=32,
                     head_count_kv=8, rope_freq_base=500000.0, context_length=131072),
    "smollm2-1.7b": dict(block_count=24, embedding_length=2048, feed_forward_length=8192, head_count=32,
                         head_count_kv=32, rope_freq_base=130000.0, context_length=8192),
    # Llama-3.2-3B's layers (28 x 3072, GQA 24/8); SmolLM2's vocabulary as above (the real 128,256
    # would add ~0.4 GB of head)
    "llama-3b": dict(block_count=28, embedding_length=3072, feed_forward_length=8192, head_count=24,
                     head_count_kv=8, rope_freq_base=500000.0, context_length=131072),
    "smollm2-135m": dict(block_count=30, embedding_length=576, feed_forward_length=1536, head_count=9,
                         head_count_kv=3, rope_freq_base=100000.0, context_length=8192),
    # Qwen3: arch qwen3 (per-head q/k RMSNorm), head_dim 128 != hidden / heads, Qwen3's vocabulary size
    "qwen3-0.6b": dict(block_count=28, embedding_length=1024, feed_forward_length=3072, head_count=16,
                       head_count_kv=8, rope_freq_base=1000000.0, context_length=40960,
                       arch="qwen3", head_dim=128, vocab=151936),
    "qwen3-1.7b": dict(block_count=28, embedding_length=2048, feed_forward_length=6144, head_count=16,
                       head_count_kv=8, rope_freq_base=1000000.0, context_length=40960,
                       arch="qwen3", head_dim=128, vocab=151936),
    # the tests' model (tests/conftest.py): 2 layers, weights scaled up so logits are peaked
    # (greedy ties would make token-exact comparisons flaky)
    "tiny": dict(block_count=2, embedding_length=64, feed_forward_length=128, head_count=4, head_count_kv=2,
                 rope_freq_base=10000.0, context_length=1024),
    "tiny-qwen3": dict(block_count=2, embedding_length=64, feed_forward_length=128, head_count=4, head_count_kv=2,
                       rope_freq_base=1000000.0, context_length=1024, arch="qwen3", head_dim=32, vocab=50000),
    # mixture of experts: OLMoE-1B-7B's dimensions (6.9B parameters, 1.3B active) in llama.cpp's
    # qwen3moe architecture (OLMoE's own arch has no q/k head norms but a full-width q/k norm);
    # OLMoE's 50304-token vocabulary (the tokenizer padded); experts Q4_1 like every matrix here
    "moe-olmoe-shape": dict(block_count=16, embedding_length=2048, feed_forward_length=1024, head_count=16,
                            head_count_kv=16, rope_freq_base=10000.0, context_length=4096, arch="qwen3moe",
                            head_dim=128, vocab=50304, expert_count=64, expert_used_count=8,
                            expert_feed_forward_length=1024),
    "tiny-moe": dict(block_count=2, embedding_length=64, feed_forward_length=64, head_count=4, head_count_kv=2,
                     rope_freq_base=1000000.0, context_length=1024, arch="qwen3moe", head_dim=32, vocab=50000,
                     expert_count=8, expert_used_count=2, expert_feed_forward_length=64),
    # Gemma 3 1B: llama.cpp fixes the layer pattern (5 local : 1 global) and the local RoPE base
    # (10000) by arch; the file has the window and the global base (as convert_hf_to_gguf.py's
    # Gemma3Model writes them)
    "gemma3-1b": dict(block_count=26, embedding_length=1152, feed_forward_length=6912, head_count=4,
                      head_count_kv=1, rope_freq_base=1000000.0, context_length=32768, sliding_window=512,
                      layer_norm_rms_epsilon=1e-6, arch="gemma3", head_dim=256, vocab=262144),
    # Gemma 3 4B's text model (the vision benchmark's language side: bench/vision_ttft.py)
    "gemma3-4b": dict(block_count=34, embedding_length=2560, feed_forward_length=10240, head_count=8,
                      head_count_kv=4, rope_freq_base=1000000.0, context_length=131072, sliding_window=1024,
                      layer_norm_rms_epsilon=1e-6, arch="gemma3", head_dim=256, vocab=262144),
    # Gemma 2 2B: every other layer local (fixed by arch); Gemma2Model writes no RoPE base (10000)
    "gemma2-2b": dict(block_count=26, embedding_length=2304, feed_forward_length=9216, head_count=8,
                      head_count_kv=4, context_length=8192, sliding_window=4096, attn_logit_softcapping=50.0,
                      final_logit_softcapping=30.0, layer_norm_rms_epsilon=1e-6, arch="gemma2", head_dim=256,
                      vocab=256000),
    # gpt-oss-20b: o200k's 201,088-token vocabulary (the tokenizer padded), every even layer a
    # window of 128, YaRN x32 over 4,096 positions; the experts' type is its own (see GPT_OSS_TYPES)
    "gpt-oss-20b": {**dict(block_count=24, embedding_length=2880, feed_forward_length=2880, head_count=64,
                           head_count_kv=8, rope_freq_base=150000.0, context_length=131072, sliding_window=128,
                           layer_norm_rms_epsilon=1e-5, arch="gpt-oss", head_dim=64, vocab=201088, expert_count=32,
                           expert_used_count=4, expert_feed_forward_length=2880),
                    "rope.scaling.type": "yarn", "rope.scaling.factor": 32.0,
                    "rope.scaling.original_context_length": 4096},
}
PEAKED = {"tiny", "tiny-qwen3", "tiny-moe"}
GEMMA = {"gemma3-1b", "gemma3-4b", "gemma2-2b"}  # weighted for the llama.cpp check (see above)
QK_NORM_ARCHS = ("qwen3", "qwen3moe", "gemma3")
SANDWICH_ARCHS = ("gemma2", "gemma3")  # norms on the attention and MLP outputs too
# shape key -> its GGUF key under the arch
GGUF_KEYS = {"head_count": "attention.head_count", "head_count_kv": "attention.head_count_kv",
             "rope_freq_base": "rope.freq_base", "sliding_window": "attention.sliding_window",
             "layer_norm_rms_epsilon": "attention.layer_norm_rms_epsilon"}


def source_gguf() -> str:
    from localllm.registry import resolve_model

    return str(resolve_model(None).local_path)


def tensor_shapes(s: dict, vocab: int) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy shape (rows, cols) as the writer takes it (ne reversed)."""
    h, f = s["embedding_length"], s["feed_forward_length"]
    hd = s.get("head_dim", h // s["head_count"])
    q, kv = s["head_count"] * hd, s["head_count_kv"] * hd
    out = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,)}
    for i in range(s["block_count"]):
        out.update({f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.ffn_norm.weight": (h,),
                    f"blk.{i}.attn_q.weight": (q, h), f"blk.{i}.attn_k.weight": (kv, h),
                    f"blk.{i}.attn_v.weight": (kv, h), f"blk.{i}.attn_output.weight": (h, q)})
        n, fe = s.get("expert_count"), s.get("expert_feed_forward_length")
        if n:  # the router and the experts as 3-D tensors [E, rows, cols]
            out.update({f"blk.{i}.ffn_gate_inp.weight": (n, h), f"blk.{i}.ffn_gate_exps.weight": (n, fe, h),
                        f"blk.{i}.ffn_up_exps.weight": (n, fe, h), f"blk.{i}.ffn_down_exps.weight": (n, h, fe)})
        else:
            out.update({f"blk.{i}.ffn_gate.weight": (f, h), f"blk.{i}.ffn_up.weight": (f, h),
                        f"blk.{i}.ffn_down.weight": (h, f)})
        if s.get("arch") in QK_NORM_ARCHS:
            out.update({f"blk.{i}.attn_q_norm.weight": (hd,), f"blk.{i}.attn_k_norm.weight": (hd,)})
        if s.get("arch") in SANDWICH_ARCHS:
            out.update({f"blk.{i}.post_attention_norm.weight": (h,), f"blk.{i}.post_ffw_norm.weight": (h,)})
        if s.get("arch") == "gpt-oss":  # its norm before the MLP's name, sinks, biases everywhere
            out[f"blk.{i}.post_attention_norm.weight"] = out.pop(f"blk.{i}.ffn_norm.weight")
            out.update({f"blk.{i}.attn_sinks.weight": (s["head_count"],), f"blk.{i}.attn_q.bias": (q,),
                        f"blk.{i}.attn_k.bias": (kv,), f"blk.{i}.attn_v.bias": (kv,), f"blk.{i}.attn_output.bias": (h,),
                        f"blk.{i}.ffn_gate_inp.bias": (n,), f"blk.{i}.ffn_gate_exps.bias": (n, fe),
                        f"blk.{i}.ffn_up_exps.bias": (n, fe), f"blk.{i}.ffn_down_exps.bias": (n, h)})
    if s.get("arch") == "gpt-oss":
        out["output.weight"] = (vocab, h)  # untied
    return out


def random_mxfp4(rng: np.random.Generator, shp: tuple[int, ...]) -> np.ndarray:
    """Random MXFP4 blocks of a [..., cols] matrix (cols / 32 blocks of 17 bytes a row): E8M0 scales
    2^-9 .. 2^-7 (values up to ~0.05, as N(0, 0.02) quantizes), uniform 4-bit codes. Drawn as
    blocks: quantizing 19B floats in numpy would take most of an hour."""
    blocks = rng.integers(0, 256, size=(*shp[:-1], shp[-1] // 32, 17), dtype=np.uint8)
    blocks[..., 0] = rng.integers(119, 122, size=blocks.shape[:-1], dtype=np.uint8)
    return blocks.reshape(*shp[:-1], -1)


def scale(shape: str, name: str, cols: int) -> float:
    """The std of a matrix's N(0, 1) draws."""
    if shape in GEMMA:
        if name == "token_embd.weight":  # logits = final-normed hidden (rms ~1) . rows: std ~4
            return 4 / cols ** 0.5
        # attention scores of std ~1: peaked ones (std 16, to bend Gemma 2's soft-cap of 50) made
        # 26 layers chaotic, our own fp32 and bf16 runs 2 logit stds apart
        return (1 if ".attn_q." in name or ".attn_k." in name else 2) / cols ** 0.5
    if shape in PEAKED:
        return 1.0 if name == "token_embd.weight" else 2 / cols ** 0.5
    return 0.02


def write(shape: str, out_path: str, seed: int = 0, src=None, meta=None, f16: bool = False) -> str:
    """src: a gguf.GGUFReader of the embedded model's file, when the caller has one (parsing it
    takes seconds). meta: another GGUF's reader to take the metadata (tokenizer, template) from
    instead, its own shape keys dropped: the tensor types stay the embedded model's. f16: every
    matrix F16 instead (the quantizer's input)."""
    import gguf

    src = src or gguf.GGUFReader(source_gguf())
    meta = meta or src
    meta_arch = str(meta.fields["general.architecture"].contents())
    s = dict(SHAPES[shape])
    arch, head_dim, vocab = s.pop("arch", "llama"), s.pop("head_dim", None), s.pop("vocab", None)
    types = {}
    for t in src.tensors:  # the type each role has in the real file
        role = t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name
        types[role] = t.tensor_type
    for norm in ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm", "attn_sinks"):
        types[f"{norm}.weight"] = types["attn_norm.weight"]
    for part in ("gate", "up", "down"):  # experts as the dense matrices; the router in F32 (as llama.cpp keeps it)
        types[f"ffn_{part}_exps.weight"] = types[f"ffn_{part}.weight"]
    types["ffn_gate_inp.weight"] = types["attn_norm.weight"]
    if arch == "gpt-oss":  # as the published gpt-oss-20b file: MXFP4 experts, Q8_0 matrices
        types |= {r: gguf.GGMLQuantizationType.Q8_0 for r in ("token_embd.weight", "output.weight", "attn_q.weight",
                                                               "attn_k.weight", "attn_v.weight", "attn_output.weight")}
        types |= {f"ffn_{p}_exps.weight": gguf.GGMLQuantizationType.MXFP4 for p in ("gate", "up", "down")}
    tmp = out_path + ".partial"
    w = gguf.GGUFWriter(tmp, arch)
    skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}
    shape_keys = {f"{arch}.{GGUF_KEYS.get(k, k)}": v for k, v in s.items()}
    shape_keys[f"{arch}.rope.dimension_count"] = head_dim or s["embedding_length"] // s["head_count"]
    if head_dim:
        shape_keys[f"{arch}.attention.key_length"] = shape_keys[f"{arch}.attention.value_length"] = head_dim
    tokens = meta.fields["tokenizer.ggml.tokens"].contents()
    pad = max(0, (vocab or len(tokens)) - len(tokens))
    shape_keys[f"{arch}.vocab_size"] = len(tokens) + pad
    if f"{arch}.attention.layer_norm_rms_epsilon" not in shape_keys:  # else the source's
        shape_keys[f"{arch}.attention.layer_norm_rms_epsilon"] = float(
            meta.fields[f"{meta_arch}.attention.layer_norm_rms_epsilon"].contents())
    extend = {"tokenizer.ggml.tokens": [f"<|unused_{i}|>" for i in range(pad)],
              "tokenizer.ggml.token_type": [gguf.TokenType.UNUSED] * pad,
              "tokenizer.ggml.scores": [0.0] * pad}
    overrides = {"general.name": f"random {shape}", "general.size_label": shape}
    for key, field in meta.fields.items():
        if key in skip:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        if key.startswith(meta_arch + "."):  # the source's shape keys: ours replace them, under our arch
            continue
        val = overrides.pop(key, None)
        val = field.contents() if val is None else val
        if key in extend:
            val = list(val) + extend[key]
        w.add_key_value(key, val, vtype, sub)
    for key, val in [*shape_keys.items(), *overrides.items()]:  # overrides left: keys the source lacks
        kind = gguf.GGUFValueType.STRING if isinstance(val, str) else gguf.GGUFValueType.UINT32
        w.add_key_value(key, val, gguf.GGUFValueType.FLOAT32 if isinstance(val, float) else kind)
    vocab = len(tokens) + pad
    rng = np.random.default_rng(seed)
    for name, shp in tensor_shapes(SHAPES[shape], vocab).items():
        role = name.split(".", 2)[-1] if name.startswith("blk.") else name
        if name.endswith(".bias") or role == "attn_sinks.weight":  # gpt-oss: small F32 vectors
            w.add_tensor(name, 0.1 * rng.standard_normal(shp, dtype=np.float32))
            continue
        qtype = gguf.GGMLQuantizationType.F16 if f16 and len(shp) > 1 else types[role]
        if qtype == gguf.GGMLQuantizationType.MXFP4:
            q = random_mxfp4(rng, shp)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
            continue
        if len(shp) == 1:
            if shape in GEMMA:
                gain = shp[0] ** 0.5 / 6 if "post_" in name else 1.0
                w.add_tensor(name, gain * (1 + 0.2 * rng.standard_normal(shp, dtype=np.float32)))
            else:
                w.add_tensor(name, np.ones(shp, np.float32))
            continue
        data = rng.standard_normal(shp, dtype=np.float32)
        data *= scale(shape, name, shp[-1])
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(name, data if qtype == gguf.GGMLQuantizationType.F32 else data.astype(np.float16))
            continue
        q = gguf.quants.quantize(data, qtype)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out_path)  # never a half-written file under the final name
    return out_path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "models"))
    ap.add_argument("--type", default="Q4_1", help="the file's type: Q4_1 (written here, the default) or any "
                    "llama.cpp file type (quantized by llama.cpp from an F16 file of the shape)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="the quantizer's threads")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    own = SHAPES[args.shape].get("arch") == "gpt-oss" and args.type == "Q4_1"  # its own types (named MXFP4)
    path = os.path.join(args.out, f"random-{args.shape}.{'MXFP4' if own else args.type}.gguf")
    if os.path.exists(path):
        print(path)
        return
    if args.type == "Q4_1":
        print(f"writing {path} ...", file=sys.stderr)
        print(write(args.shape, path))
        return
    from check_kquants import FTYPES, quantize

    if args.type not in FTYPES:
        ap.error(f"--type {args.type}: one of Q4_1, {', '.join(FTYPES)}")
    f16 = os.path.join(args.out, f"random-{args.shape}.F16.gguf")
    if not os.path.exists(f16):
        print(f"writing {f16} ...", file=sys.stderr)
        write(args.shape, f16, f16=True)
    print(f"quantizing to {path} ...", file=sys.stderr)
    print(quantize(f16, args.type, path, args.threads))


if __name__ == "__main__":
    main()
