"""Model families beyond Llama against transformers (fp32) on the same random weights: a tiny
checkpoint of each family written by transformers itself, loaded from the HF directory and from a
GGUF holding the same tensors under llama.cpp's names."""

import copy
import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_engine

from localllm.model.loader import load_model
from localllm.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

# the real tokenizer's vocabulary (49152), 2 layers; head_dim 32 != hidden / heads (16) as in
# Qwen3 (q/o are 128-wide from a 64-wide residual)
TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6)


def peaked(model: torch.nn.Module, seed: int) -> None:
    """Random weights scaled so logits are peaked (greedy near-ties would make token-exact
    comparisons flaky), and norm weights away from 1 so a misplaced norm shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 2 / p.shape[1] ** 0.5)


def write_hf(model, out: Path, tokenizer_from) -> Path:
    model.save_pretrained(out, safe_serialization=True)
    tokenizer_from.save_hf(out)
    return out


# HF tensor name -> llama.cpp's, for the families written here (Phi-3's fused qkv_proj and
# gate_up_proj stay fused there: attn_qkv, and ffn_up holding gate then up)
GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


def rope_params(cfg) -> dict:
    return getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}


def gguf_tensors(model, state: dict | None = None, arch: str = "llama"):
    """(llama.cpp name, fp32 array) of each tensor of a dense family's model, or of `state` (some
    of its tensors by name); q/k rows in HF's order (llama.cpp's converter permutes them for arch
    'llama' only: llama_tensors).
    Gemma's layer tensors are named by gguf-py's own table (the converter's), not one of ours: a
    name we got wrong on both sides would load here and nowhere else (post_attention_norm did)."""
    import gguf

    cfg = model.config
    gemma = arch.startswith("gemma")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers) if gemma else None
    for name, t in (model.state_dict() if state is None else state).items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = (names.get_name(f"model.layers.{i}.{module}") if gemma else f"blk.{i}.{GGUF_NAMES[module]}") + f".{kind}"
        data = t.float().numpy().astype(np.float32)
        if gemma and name.endswith("norm.weight"):  # the converter stores Gemma's (1 + w)
            data = data + 1
        yield gname, data


def llama_qk_perm(w, heads: int):
    """convert_hf_to_gguf's permute of q/k rows for arch llama (our loader undoes it), of a numpy
    array or a torch tensor."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_tensors(model, state: dict | None = None):
    """gguf_tensors of an arch-llama model (or of `state`) with q/k permuted as the converter
    stores them."""
    cfg = model.config
    for name, a in gguf_tensors(model, state):
        if ".attn_q." in name or ".attn_k." in name:
            a = llama_qk_perm(a, cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads)
        yield name, a


@functools.cache
def gguf_reader(path: Path):
    """A gguf.GGUFReader of `path`, parsed once (the 49152-token arrays take seconds)."""
    import gguf

    return gguf.GGUFReader(str(path))


@functools.cache
def tokenizer_fields(path: Path) -> list[tuple]:
    """(key, value, type, array item type) of a GGUF's tokenizer metadata."""
    import gguf

    src = gguf_reader(path)
    return [(key, fld.contents(), fld.types[0], fld.types[-1] if fld.types[0] == gguf.GGUFValueType.ARRAY else None)
            for key, fld in src.fields.items() if key.startswith("tokenizer.") or key == "general.name"]


def write_gguf(model, arch: str, out: Path, tokenizer_gguf: Path, quantized: bool = False, tensors=None,
               extra_kv: dict | None = None, qtype_of: Callable | None = None) -> Path:
    """The model's tensors under llama.cpp's names (`tensors`: (name, array) pairs instead of
    gguf_tensors(model)), with the embedded model's tokenizer metadata and `extra_kv` (key ->
    int, float or bool). F32, or with `quantized` the way the default model is stored: Q4_1
    matrices (MoE experts too; routers stay F32 as llama.cpp keeps them), a Q8_0 embedding (read
    in place), F32 norms. qtype_of(name, array) -> a GGMLQuantizationType or None (F32): each
    tensor's type instead."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(out), arch)
    fields = tokenizer_fields(tokenizer_gguf) if isinstance(tokenizer_gguf, Path) else tokenizer_gguf
    for key, val, vtype, sub in fields:
        w.add_key_value(key, val, vtype, sub)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if getattr(cfg, "head_dim", None):  # llama.cpp's phi3 converter writes none (hidden / heads)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    rope = rope_params(cfg)
    gemma = arch.startswith("gemma")
    if gemma:  # as convert_hf_to_gguf.py's Gemma2Model / Gemma3Model write them
        rope = rope.get("full_attention", rope)
        w.add_sliding_window(cfg.sliding_window)
        if arch == "gemma2":
            w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "llama3":  # Llama 3.1+: no keys, a factor per frequency
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg, rope))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "phi3":  # as convert_hf_to_gguf.py's Phi3MiniModel writes them
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads)
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        w.add_sliding_window(cfg.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings)))
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
        assert head_dim % 2 == 0
    kv_types = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.UINT32, float: gguf.GGUFValueType.FLOAT32,
                str: gguf.GGUFValueType.STRING}
    for key, val in (extra_kv or {}).items():
        if isinstance(val, list):  # of ints (Qwen-VL's rope.dimension_sections)
            w.add_array(key, val)
        else:
            w.add_key_value(key, val, kv_types[type(val)])
    if tensors is None:
        tensors = llama_tensors(model) if arch == "llama" else gguf_tensors(model, arch=arch)
    for gname, data in tensors:
        qtype = None
        if qtype_of is not None:
            qtype = qtype_of(gname, data)
        elif quantized and data.ndim >= 2 and "ffn_gate_inp" not in gname:
            qtype = gguf.GGMLQuantizationType.Q8_0 if gname == "token_embd.weight" else gguf.GGMLQuantizationType.Q4_1
        if qtype is not None:
            q = gguf.quants.quantize(data, qtype)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


# Phi: head_dim = hidden / heads (no head_dim key in Phi-3 configs)
PHI = {k: v for k, v in TINY.items() if k != "head_dim"}
# Phi-4-mini-like LongRoPE: trained at 128 positions (original_max_position_embeddings), scaled to
# 1024, factor sets of rotary_dim / 2 = 12 (head_dim 32, partial_rotary_factor 0.75)
PHI4_ORIG = 128
PHI4_ROPE = {"rope_type": "longrope", "rope_theta": 250000.0, "partial_rotary_factor": 0.75,
             "short_factor": [1.0 + 0.05 * i for i in range(12)], "long_factor": [1.0 + 1.5 * i for i in range(12)]}


@dataclass
class Family:
    make: Callable  # () -> the transformers model
    arch: str  # GGUF general.architecture
    tied: bool
    # what the shared tests pass to load_model: Phi-4-mini runs within its original length, where
    # transformers uses the short factors (ours pick by the context, see RotaryEmbedding)
    load: dict = field(default_factory=dict)


FAMILIES = {
    **{f"qwen3-{'tied' if tied else 'untied'}": Family(
        lambda tied=tied: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **TINY, rope_theta=1e6, tie_word_embeddings=tied, attention_bias=False)), "qwen3", tied)
       for tied in (True, False)},
    # Phi-3-mini-4k-like: MHA, no rope scaling, untied, a sliding window below the context (2047 of 4096)
    "phi3-mini": Family(lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **PHI, rope_theta=10000.0, tie_word_embeddings=False, sliding_window=512, pad_token_id=0)), "phi3", False),
    # Phi-4-mini-like: GQA, partial rotary 0.75, LongRoPE, tied embeddings
    "phi4-mini": Family(lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(
        **(PHI | dict(num_attention_heads=2, num_key_value_heads=1)), rope_parameters=copy.deepcopy(PHI4_ROPE),
        original_max_position_embeddings=PHI4_ORIG, tie_word_embeddings=True, pad_token_id=0)), "phi3", True,
        {"max_model_len": PHI4_ORIG}),
}


# Llama 3.2-like: its llama3 RoPE scaling (x32, the published low/high frequency factors) from an
# original context of 256, so every band is crossed: high frequencies kept, low ones scaled, two
# smoothed between; the GGUF carries it as llama.cpp's converter writes it (rope_freqs.weight)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
FAMILIES["llama3.2"] = Family(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
    **TINY, rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=True, pad_token_id=0)), "llama", True)


def llama3_rope_factors(cfg, rope: dict) -> np.ndarray:
    """rope_freqs.weight as convert_hf_to_gguf.py's LlamaModel writes it for a llama3 rope_scaling:
    the factor that divides each frequency."""
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


# Gemma: windows of 12 positions (the 16-token prompt and 32 generated tokens cross them), a
# soft-cap small enough to bite on these scores, Gemma 3 with its published layout of five
# sliding layers to one global and the 4B+ RoPE (global base 1e6 scaled x8, local base 1e4)
GEMMA = TINY | dict(sliding_window=12, query_pre_attn_scalar=32, hidden_activation="gelu_pytorch_tanh",
                    pad_token_id=0)
FAMILIES |= {
    "gemma2": Family(lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **GEMMA, attn_logit_softcapping=5.0, final_logit_softcapping=30.0, rope_theta=10000.0)), "gemma2", True),
    "gemma3": Family(lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **(GEMMA | dict(num_hidden_layers=6)), rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})), "gemma3", True),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, fp32_model, gguf_path):
    """(transformers model, HF directory, F32 GGUF, Q4_1 GGUF, Family) of one tiny family checkpoint."""
    return build_family(request.param, FAMILIES, peaked, write_gguf, tmp_path_factory, fp32_model.tokenizer,
                        gguf_path)


def build_family(name: str, families: dict, peak: Callable, writer: Callable, tmp_path_factory, tokenizer,
                 gguf_path: Path) -> tuple:
    """A family's tiny transformers model with peaked random weights, written as an HF directory, an
    F32 GGUF and a Q4_1 GGUF (`writer`: the GGUF writer for its tensor layout)."""
    fam = families[name]
    torch.manual_seed(0)
    model = fam.make().eval()
    peak(model, seed=1)
    if fam.tied:
        model.tie_weights()
    out = tmp_path_factory.mktemp(name)
    hf_dir = write_hf(model, out / "hf", tokenizer)
    gguf_file = writer(model, fam.arch, out / f"{name}.gguf", gguf_path)
    q4_file = writer(model, fam.arch, out / f"{name}.Q4_1.gguf", gguf_path, quantized=True)
    return model, hf_dir, gguf_file, q4_file, fam


PROMPT = [1, 504, 3458, 282, 5248, 314, 17, 2, 9, 8822, 1137, 30, 42, 99, 1000, 20000]


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_logits_match_transformers(family, source):
    ref_model, hf_dir, gguf_file, _, fam = family
    loaded = load_model(hf_dir if source == "hf" else gguf_file, "float32", **fam.load)
    eng = make_engine(loaded)
    ours = eng.score(PROMPT)
    with torch.no_grad():
        ref = ref_model(torch.tensor([PROMPT])).logits[0].float()
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_greedy_decode_equals_transformers(family):
    """Prefill then token-by-token decode over the paged cache, against transformers' generate."""
    ref_model, hf_dir, _, _, fam = family
    eng = make_engine(load_model(hf_dir, "float32", **fam.load))
    *_, last = eng.generate(list(PROMPT), SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert last.token_ids == hf_greedy(ref_model, PROMPT, 32)


def test_batched_with_prefix_hits_and_chunked_prefill(family):
    """Three requests in one batch: two share a 32-token prefix (the second one's prefix comes from
    the cache once the first is in), prompts prefilled in 8-token chunks across KV blocks."""
    ref_model, hf_dir, _, _, fam = family
    eng = make_engine(load_model(hf_dir, "float32", **fam.load), max_num_batched_tokens=8, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    first, replies = batch_with_prefix_hits(eng, params)
    assert eng.cache_stats()["cached_tokens"] >= 2 * 32
    assert first == replies[0][1]
    for prompt, tokens in replies:
        assert tokens == hf_greedy(ref_model, prompt, 32)


def batch_with_prefix_hits(eng, params: SamplingParams) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    """Three prompts, two sharing a 32-token prefix, run alone first (the first one fills the prefix
    cache) and then in one batch: (the first one's tokens alone, [(prompt, its tokens in the batch)])."""
    shared = PROMPT * 2
    prompts = [shared + [7, 8, 9], shared + [400, 500], list(reversed(PROMPT))]
    *_, first = eng.generate(prompts[0], params)
    ids = [eng.add_request(p, params) for p in prompts]
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return first.token_ids, [(p, done[rid].token_ids) for rid, p in zip(ids, prompts)]


def test_int4_gguf_follows_its_fp32_weights(family):
    """A Q4_1 GGUF run in int4 (the file's blocks repacked for our kernel, the Q8_0 embedding and
    head read in place, 16-bit matmul inputs) against the same file's weights in fp32."""
    q4_file, fam = family[3], family[4]
    int4 = load_model(q4_file, "auto", **fam.load)
    assert int4.precision.startswith("int4")
    ref = make_engine(load_model(q4_file, "float32", **fam.load)).score(PROMPT)
    got = make_engine(int4).score(PROMPT)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    *_, a = make_engine(int4).generate(list(PROMPT), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    *_, b = make_engine(load_model(q4_file, "float32", **fam.load)).generate(
        list(PROMPT), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert sum(x == y for x, y in zip(a.token_ids, b.token_ids)) >= 14


# one method per family (both methods run on every layout kind: separate and fused linears, q/k
# norms, Gemma's norms; tests/test_quant.py runs both on the default model)
QUANT_METHODS = {"qwen3-tied": "awq", "qwen3-untied": "gptq", "phi3-mini": "gptq", "phi4-mini": "awq",
                 "gemma2": "gptq", "gemma3": "awq", "llama3.2": "gptq"}


def test_quantizer_writes_a_checkpoint_of_the_family(family, request, tmp_path):
    """`localllm quantize` on the family: a standard checkpoint whose int4 weights load back
    exactly, with the family's extra tensors (q/k norms) and config (rope) carried over, and its
    linears named as the family's checkpoints name them (Phi-3: fused qkv_proj / gate_up_proj,
    as AutoAWQ and GPTQModel write them)."""
    method = QUANT_METHODS[request.node.callspec.params["family"]]  # (a parametrized method rebuilt the fixture)
    from safetensors import safe_open

    from localllm.model.weights import open_weights
    from localllm.quant.quantize import quantize_model

    ref_model, hf_dir, _, _, fam = family
    r = quantize_model(hf_dir, tmp_path / method, method, num_samples=2, seq_len=64, keep_dequantized=True)
    w = open_weights(r.path)
    src = open_weights(hf_dir).config
    assert w.config == src
    with safe_open(str(r.path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    fused = isinstance(ref_model, transformers.Phi3ForCausalLM)
    assert src.fused_checkpoint == fused
    want_q = ["self_attn.qkv_proj", "mlp.gate_up_proj"] if fused else ["self_attn.q_proj", "mlp.gate_proj"]
    absent = ["self_attn.q_proj", "mlp.gate_proj"] if fused else ["self_attn.qkv_proj", "mlp.gate_up_proj"]
    assert all(f"model.layers.0.{m}.qweight" in names for m in want_q)
    assert not any(f"model.layers.0.{m}" in n for m in absent for n in names)
    for name, want in r.dequantized.items():
        assert torch.equal(w.int4(name).dequantize_logical(), want), name
    assert load_model(r.path, "auto", **fam.load).precision.startswith("int4")
    # transformers on the checkpoint's weights (dequantized, q/k norms and AWQ-folded input norms
    # as written) == our fp32 run of the checkpoint
    state = {n: w.dense(n).float() for n in ref_model.state_dict() if w.has(n) or n in r.dequantized}
    ref_model = copy.deepcopy(ref_model)
    missing, _ = ref_model.load_state_dict(state, strict=False)
    assert missing in ([], ["lm_head.weight"])  # tied: the embedding
    with torch.no_grad():
        ref = ref_model(torch.tensor([PROMPT])).logits[0].float()
    ours = make_engine(load_model(r.path, "float32", **fam.load)).score(PROMPT)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen3-untied"], indirect=True)
def test_unknown_architecture_is_one_clear_line(tmp_path, family):
    from localllm.model.errors import ModelLoadError

    _, hf_dir, gguf_file, _, fam = family
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes())
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'FooForCausalLM' \(supported: .*Qwen3"):
        load_model(bad)
    raw = bytearray(gguf_file.read_bytes())
    arch = fam.arch.encode()
    at = raw.find(arch, 0, 4096)  # general.architecture's value (lengths stay: 'llama' would be read)
    bad_arch = b"foobar"[:len(arch)]
    raw[at:at + len(arch)] = bad_arch
    (tmp_path / "bad.gguf").write_bytes(raw)
    with pytest.raises(ModelLoadError, match=rf"architecture '{bad_arch.decode()}' is not supported "
                                             r"\(supported: llama, qwen2, qwen3, mistral, phi3, .*gemma3, qwen3moe, gpt-oss, qwen2vl, qwen3vl\)"):
        load_model(tmp_path / "bad.gguf")


def test_bench_generator_writes_qwen3_shapes(tmp_path, fp32_model):
    """bench/make_gguf.py's Qwen3 shapes (for side-by-side runs at real sizes): arch qwen3 with
    q/k norms, an explicit head_dim and the vocabulary padded with unused tokens, which our loader
    reads with the tokenizer unchanged."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_gguf", Path(__file__).parent.parent / "bench" / "make_gguf.py")
    make_gguf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_gguf)
    loaded = load_model(make_gguf.write("tiny-qwen3", str(tmp_path / "q.gguf")), "auto")
    cfg = loaded.config
    assert (cfg.architecture, cfg.qk_norm, cfg.head_dim, cfg.vocab_size) == ("Qwen3ForCausalLM", True, 32, 50000)
    assert loaded.model.embed.shape == (50000, 64) and loaded.precision.startswith("int4")
    text = "Hello, world! <|im_start|>user"
    assert loaded.tokenizer.encode(text) == fp32_model.tokenizer.encode(text)
    *_, out = make_engine(loaded).generate(text, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out.token_ids) == 4 and max(out.token_ids) < 50000

# ---- Phi-3 / Phi-4-mini specifics -------------------------------------------------------------
@pytest.mark.parametrize("family", ["phi4-mini"], indirect=True)
@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_longrope_long_factors_past_the_original_length(family, source):
    """Run at the full 1024-token context, the long factors apply (ours: for every position, picked
    once by the context); transformers takes them for a sequence longer than the original 128
    positions, so a 150-token prompt scored at once gets the same logits."""
    ref_model, hf_dir, gguf_file, _, _ = family
    path = hf_dir if source == "hf" else gguf_file
    long, short = load_model(path, "float32"), load_model(path, "float32", max_model_len=PHI4_ORIG)
    assert long.max_model_len == 1024
    for m in (long, short):
        m.model.cover(PHI4_ORIG)
    assert not torch.allclose(long.model.rope.cos[:PHI4_ORIG], short.model.rope.cos[:PHI4_ORIG])  # the sets differ
    prompt = (PROMPT * 10)[:150]
    ours = make_engine(long).score(prompt)
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama3.2"], indirect=True)
def test_llama3_gguf_rope_freqs_are_the_checkpoints_scaling(family, tmp_path, gguf_path):
    """A Llama 3.1+ GGUF keeps its RoPE scaling as a factor per frequency (rope_freqs.weight, every
    published Llama 3.1/3.2/3.3 file has one): its frequencies are the HF checkpoint's llama3 ones
    (to fp32 rounding), the factors matter (without them the logits move), and such a file is not
    written back as a Hugging Face checkpoint it could not describe."""
    from localllm.model.export import export_hf
    from localllm.model.weights import open_weights

    ref_model, hf_dir, gguf_file, _, _ = family
    gguf_model, hf_model = load_model(gguf_file, "float32").model, load_model(hf_dir, "float32").model
    for m in (gguf_model, hf_model):
        m.cover(64)
    torch.testing.assert_close(gguf_model.rope.cos[:64], hf_model.rope.cos[:64], atol=1e-6, rtol=0)
    cfg = open_weights(gguf_file).config
    assert cfg.rope_scaling["rope_type"] == "freq_factors" and max(cfg.rope_scaling["freq_factors"]) == 32.0
    unscaled = copy.deepcopy(ref_model)
    unscaled.config.rope_parameters = {"rope_type": "default", "rope_theta": LLAMA3_ROPE["rope_theta"]}
    plain = write_gguf(unscaled, "llama", tmp_path / "no-rope-freqs.gguf", gguf_path)
    with torch.no_grad():
        ref = ref_model(torch.tensor([PROMPT])).logits[0].float()
    assert not torch.allclose(make_engine(load_model(plain, "float32")).score(PROMPT), ref, atol=1e-2)
    with pytest.raises(ValueError, match="rope_freqs: Llama 3.1"):
        export_hf(gguf_file, tmp_path / "hf")


@pytest.mark.parametrize("arch, rope", [
    ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),  # Qwen2.5's long form
    ("llama", {"rope_type": "linear", "factor": 2.0}),
])
def test_gguf_rope_scaling_keys_give_transformers_frequencies(arch, rope):
    """RoPE scaling written as the converter's keys (rope.scaling.type / factor / original context)
    gives the frequencies and cos/sin factor transformers computes from the same config fields."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from localllm.config import ModelConfig
    from localllm.model.layers import rope_inv_freq

    ctx, theta = 131072, 1e6
    cls = transformers.Qwen2Config if arch == "qwen2" else transformers.LlamaConfig
    hf = cls(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=ctx,
             rope_parameters={**rope, "rope_theta": theta})
    want, want_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    keys = {"attention.head_count": 2, "attention.head_count_kv": 1, "embedding_length": 256, "block_count": 1,
            "feed_forward_length": 512, "rope.freq_base": theta, "context_length": ctx,
            "rope.scaling.type": rope["rope_type"], "rope.scaling.factor": rope["factor"]}
    if "original_max_position_embeddings" in rope:
        keys["rope.scaling.original_context_length"] = rope["original_max_position_embeddings"]
    meta = {f"{arch}.{k}": v for k, v in keys.items()} | {"general.architecture": arch, "tokenizer.ggml.tokens": ["a"]}
    cfg = ModelConfig.from_gguf(meta, ["token_embd.weight"], lambda name: [])
    inv, factor = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, ctx)
    assert torch.equal(inv, want.float()) and factor == pytest.approx(want_factor, rel=1e-12)
    assert not torch.equal(inv, rope_inv_freq(cfg.rotary_dim, theta, None, ctx)[0])


@pytest.mark.parametrize("family", ["phi3-mini"], indirect=True)
def test_phi3_sliding_window_past_the_window(family):
    """Phi-3's window (512 of 1024 here, 2047 of 4096 in Phi-3-mini-4k) applies to every layer, as
    transformers applies it: a 600-token prompt scored at once, and decoding past the window
    after a prefill chunked across it."""
    ref_model, hf_dir, gguf_file, _, _ = family
    prompt = (PROMPT * 40)[:600]
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt])).logits[0].float()
    for path in (hf_dir, gguf_file):
        loaded = load_model(path, "float32")
        assert loaded.max_model_len == 1024 and loaded.model.layers[0].window == 512
        torch.testing.assert_close(make_engine(loaded).score(prompt), ref, atol=2e-4, rtol=1e-4)
    eng = make_engine(load_model(hf_dir, "float32"), max_num_batched_tokens=128)
    *_, out = eng.generate(prompt[:500], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert out.token_ids == hf_greedy(ref_model, prompt[:500], 24)


def test_phi_configs_as_published():
    """config.json of the published models (shapes as on the hub, factor lists shortened to their
    real lengths with made-up values) -> our config, as transformers resolves it."""
    from localllm.config import ModelConfig

    phi4 = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 200064, "hidden_size": 3072,
            "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 24,
            "num_key_value_heads": 8, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
            "partial_rotary_factor": 0.75, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "sliding_window": 262144,
            "tie_word_embeddings": True, "hidden_act": "silu", "pad_token_id": 199999,
            "rope_scaling": {"type": "longrope", "long_factor": [2.0] * 48, "short_factor": [1.0] * 48}}
    c = ModelConfig.from_hf(phi4)
    assert (c.head_dim, c.rotary_dim, c.num_kv_heads, c.tie_word_embeddings) == (128, 96, 8, True)
    assert c.fused_checkpoint and c.sliding_window == 262144
    assert c.rope_scaling["original_max_position_embeddings"] == 4096
    assert c.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    ref = transformers.Phi3Config(**phi4)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, attn = ROPE_INIT_FUNCTIONS["longrope"](ref, None)
    assert attn == pytest.approx(c.rope_scaling["attention_factor"])
    from localllm.model.layers import rope_inv_freq

    ours, ours_attn = rope_inv_freq(c.rotary_dim, c.rope_theta, c.rope_scaling, 4096)
    assert torch.equal(ours, inv) and ours_attn == pytest.approx(attn)
    # Phi-3-mini-128k (old name "su" for longrope) and Phi-3-mini-4k (no scaling, window 2047)
    phi3 = phi4 | {"hidden_size": 3072, "num_attention_heads": 32, "num_key_value_heads": 32,
                   "tie_word_embeddings": False, "sliding_window": 262144}
    del phi3["partial_rotary_factor"]
    c = ModelConfig.from_hf(phi3 | {"rope_scaling": {"type": "su", "long_factor": [2.0] * 48,
                                                     "short_factor": [1.0] * 48}})
    assert c.rope_scaling["rope_type"] == "longrope" and c.rotary_dim == c.head_dim == 96
    c = ModelConfig.from_hf(phi3 | {"rope_scaling": None, "max_position_embeddings": 4096, "sliding_window": 2047})
    assert c.rope_scaling is None and c.sliding_window == 2047 and not c.tie_word_embeddings
    # Mistral v0.1's window applies as transformers applies it; Qwen2's is not read
    assert ModelConfig.from_hf(phi3 | {"architectures": ["MistralForCausalLM"], "sliding_window": 4096}).window(0) == 4096
    assert ModelConfig.from_hf(phi3 | {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}).window(0) is None
    # the registry's parameter counts (planner) are these configs' (Phi-3-mini: vocab 32064)
    from localllm.registry import resolve_model

    assert resolve_model("phi4-mini").spec.params == ModelConfig.from_hf(phi4).num_params
    for alias in ("phi3-mini-4k", "phi3.5-mini"):
        assert resolve_model(alias).spec.params == ModelConfig.from_hf(phi3 | {"vocab_size": 32064}).num_params


# chat templates as published in tokenizer_config.json (Phi-3-mini-4k-instruct, Phi-4-mini-instruct)
PHI3_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] "
                 "+ '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
                 "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}"
                 "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}"
                 "{{ eos_token }}{% endif %}")
PHI4_TEMPLATE = ("{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
                 "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + "
                 "message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + "
                 "message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}")


def test_phi_chat_templates_render():
    from localllm.chat import render_chat

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render_chat(PHI3_TEMPLATE, msgs, eos_token="<|endoftext|>") == \
        "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    assert render_chat(PHI4_TEMPLATE, msgs) == "<|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>"


def test_partial_rotary_triton_rope_equals_torch():
    """The Triton path rotates the leading rotary_dim columns of each head in place (strided views
    of the fused qkv output) and leaves the rest: the same as the torch path."""
    from localllm.model.layers import RotaryEmbedding
    from localllm.model.llama import rope_fused, rope_torch

    scaling = {"rope_type": "longrope", "original_max_position_embeddings": 64, "attention_factor": 1.2,
               "short_factor": [1.0 + 0.1 * i for i in range(12)], "long_factor": [1.0 + i for i in range(12)]}
    rope = RotaryEmbedding(32, 256, 10000.0, scaling, torch.float32, rotary_dim=24)
    g = torch.Generator().manual_seed(0)
    T, H, KVH, D = 5, 4, 2, 32
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g)
    pos = torch.tensor([0, 3, 64, 100, 255])

    def views(t):
        return t[:, :H * D].view(T, H, D), t[:, H * D:(H + KVH) * D].view(T, KVH, D)

    ref_q, ref_k = rope_torch(pos, *views(qkv), rope)
    assert torch.equal(ref_q[..., 24:], views(qkv)[0][..., 24:])
    fused = qkv.clone()
    q, k = rope_fused(pos, *views(fused), rope)
    torch.testing.assert_close(q, ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, ref_k, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["phi4-mini", "phi3-mini"], indirect=True)
def test_phi_gguf_exports_to_an_hf_checkpoint_transformers_runs(family, tmp_path):
    """export_hf of a Phi GGUF: fused qkv_proj / gate_up_proj, partial rotary, LongRoPE and the
    window carried into config.json; transformers on it gives the original model's logits."""
    from localllm.model.export import export_hf

    ref_model, _, gguf_file, _, fam = family
    out = export_hf(gguf_file, tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Phi3ForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(torch.tensor([PROMPT])).logits[0]
        ref = ref_model(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)
    ours = make_engine(load_model(out, "float32", **fam.load)).score(PROMPT)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


# ---- Gemma 2 / Gemma 3 specifics ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemma_norm_rounds_as_transformers(dtype):
    """Gemma's norms scale by (1 + w) in fp32 and cast last (Llama's cast, then scale): with
    16-bit activations ours equal transformers' Gemma2RMSNorm bit for bit, and both weights."""
    from localllm.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(0)
    w = 0.3 * torch.randn(256, generator=gen)
    x = (torch.randn(7, 256, generator=gen) * 5).to(dtype)
    ref = transformers.models.gemma2.modeling_gemma2.Gemma2RMSNorm(256, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(w)
    ours = RMSNorm(w + 1.0, 1e-6, scale_in_fp32=True)
    assert ours.weight.dtype == torch.float32
    assert torch.equal(ours(x), ref(x))
    assert torch.equal(ours(x.float()), ref(x.float()).float())


def test_gemma_configs_as_published():
    """config.json of the published models (as on the hub: Gemma 3 4B+ nests a sparse text_config
    in a multimodal config) -> our config, as transformers completes it."""
    from localllm.config import ModelConfig

    gemma2_27b = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 4608,
                  "intermediate_size": 36864, "num_hidden_layers": 46, "num_attention_heads": 32,
                  "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 144, "sliding_window": 4096,
                  "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "vocab_size": 256000}
    c = ModelConfig.from_hf(gemma2_27b)
    ref = transformers.Gemma2Config(**gemma2_27b)
    assert c.layer_windows == tuple(4096 if t == "sliding_attention" else None for t in ref.layer_types)
    assert c.layer_windows[:2] == (4096, None)
    assert (c.attn_logit_softcap, c.final_logit_softcap, c.query_pre_attn_scalar) == (50.0, 30.0, 144.0)
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling, c.qk_norm) == (10000.0, None, None, False)
    gemma3_4b = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
                 "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                                 "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                                 "sliding_window": 1024}}
    c = ModelConfig.from_hf(gemma3_4b)
    ref = transformers.Gemma3TextConfig(**gemma3_4b["text_config"])
    assert c.architecture == "Gemma3ForCausalLM" and c.qk_norm and c.tie_word_embeddings
    assert c.layer_windows == tuple(1024 if t == "sliding_attention" else None for t in ref.layer_types)
    assert c.layer_windows.count(None) == 5
    assert (c.vocab_size, c.num_heads, c.num_kv_heads, c.head_dim) == (ref.vocab_size, 8, 4, 256)
    assert c.rope_scaling == {"factor": 8.0, "rope_type": "linear"}
    assert (c.rope_theta, c.rope_local_theta) == (ref.rope_parameters["full_attention"]["rope_theta"],
                                                  ref.rope_parameters["sliding_attention"]["rope_theta"])
    assert c.attn_logit_softcap is None and c.final_logit_softcap is None
    # the registry's parameter counts (planner) are these shapes'
    from localllm.registry import resolve_model

    assert resolve_model("gemma3:4b").spec.params == c.num_params


def test_gemma_gguf_attention_scale_follows_llama_cpp():
    """A GGUF has no query_pre_attn_scalar: llama.cpp takes hidden / heads for the 27B models (144
    and 168, known by their layer counts) and head_dim otherwise; so do we."""
    from localllm.config import _gguf_gemma_fields, _gguf_rope_scaling

    meta = {"block_count": 46, "attention.sliding_window": 4096, "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0}
    f = _gguf_gemma_fields(meta.get, "gemma2", 32, 4608, 128)
    assert f["query_pre_attn_scalar"] == 144 and f["layer_windows"][:3] == (4096, None, 4096)
    f = _gguf_gemma_fields((meta | {"block_count": 26}).get, "gemma2", 8, 2304, 256)
    assert f["query_pre_attn_scalar"] == 256
    g3 = {"block_count": 62, "attention.sliding_window": 1024, "rope.scaling.type": "linear", "rope.scaling.factor": 8.0}
    f = _gguf_gemma_fields(g3.get, "gemma3", 32, 5376, 128)
    assert f["query_pre_attn_scalar"] == 168 and f["rope_local_theta"] == 10000.0
    assert _gguf_rope_scaling(g3.get) == {"rope_type": "linear", "factor": 8.0} and f["layer_windows"][5] is None


def test_gemma_gguf_keys_and_their_absence_read_as_llama_cpp():
    """What llama.cpp 0.3.36 (src/models/gemma2.cpp, gemma3.cpp, llama-hparams.h) takes where a
    Gemma GGUF lacks a key, and the keys newer converters write: Gemma 2 without keys slides every
    other layer over 4096 with soft-caps 50 / 30; Gemma 3 without a window attends globally and has
    no soft-caps; rope.freq_base_swa sets the local base (else Gemma 3's 10000, Gemma 2's global
    one); attention.sliding_window_pattern may be one flag per layer."""
    from localllm.config import _gguf_gemma_fields

    f = _gguf_gemma_fields({"block_count": 4}.get, "gemma2", 8, 2304, 256)
    assert f["layer_windows"] == (4096, None, 4096, None) and f["rope_local_theta"] is None
    assert (f["attn_logit_softcap"], f["final_logit_softcap"]) == (50.0, 30.0)
    f = _gguf_gemma_fields({"block_count": 4, "rope.freq_base_swa": 20000.0}.get, "gemma2", 8, 2304, 256)
    assert f["rope_local_theta"] == 20000.0
    f = _gguf_gemma_fields({"block_count": 6}.get, "gemma3", 4, 1152, 256)
    assert f["layer_windows"] == (None,) * 6 and f["rope_local_theta"] == 10000.0
    assert (f["attn_logit_softcap"], f["final_logit_softcap"]) == (None, None)
    meta = {"block_count": 4, "attention.sliding_window": 512, "attention.sliding_window_pattern": [True, False, True, True],
            "rope.freq_base_swa": 5000.0, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    f = _gguf_gemma_fields(meta.get, "gemma3", 4, 1152, 256)
    assert f["layer_windows"] == (512, None, 512, 512) and f["rope_local_theta"] == 5000.0
    assert (f["attn_logit_softcap"], f["final_logit_softcap"]) == (None, 30.0)


@pytest.mark.parametrize("family", ["gemma3"], indirect=True)
@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_gemma3_multimodal_checkpoint_loads_its_text_model(family, prefix, tmp_path):
    """Gemma 3 4B+ ship as Gemma3ForConditionalGeneration: the text model's tensors under a prefix
    (older transformers wrote language_model.model.*, newer model.language_model.*), a vision tower
    beside them, the text config nested. The text model loads and equals the text-only checkpoint."""
    from safetensors.torch import load_file, save_file

    ref_model, hf_dir, _, _, _ = family
    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = {prefix + k[len("model."):]: v for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(8, 3, 2, 2)
    out = tmp_path / "mm"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                 "model_type": "gemma3", "text_config": cfg}))
    for f in hf_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            (out / f.name).write_bytes(f.read_bytes())
    ours = make_engine(load_model(out, "float32")).score(PROMPT)
    with torch.no_grad():
        ref = ref_model(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


# Gemma 3's chat template as published (tokenizer_config.json of google/gemma-3-1b-it, text parts)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n")


def test_gemma_chat_template_renders():
    """The system prompt folds into the first user turn, the assistant is 'model', and a broken
    alternation is the template's own error."""
    from localllm.chat import render_chat

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    assert render_chat(GEMMA3_TEMPLATE, msgs, bos_token="<bos>") == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(Exception, match="must alternate"):
        render_chat(GEMMA3_TEMPLATE, msgs[1:2] * 2)


@pytest.mark.parametrize("family", ["gemma2"], indirect=True)
def test_gemma_export_is_refused_not_written_wrong(family, tmp_path):
    from localllm.model.export import export_hf

    with pytest.raises(ValueError, match="Gemma2ForCausalLM model as a Hugging Face checkpoint is not supported"):
        export_hf(family[2], tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
