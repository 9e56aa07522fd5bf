"""Mixture-of-experts models (Mixtral, Qwen3-MoE) against transformers (fp32) on tiny random
checkpoints written by transformers itself, loaded from the HF directory and from GGUFs with
llama.cpp's 3-D expert tensors; the int4 MoE op against the torch loop; the compiled CPU step on
an MoE model. The shared family tests of tests/test_families.py run here on the MoE `family`."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_engine
from test_families import (  # noqa: F401  (the imported tests run on this module's `family`)
    PROMPT,
    TINY,
    Family,
    build_family,
    gguf_reader,
    gguf_tensors,
    hf_greedy,
    llama_tensors,
    peaked,
    test_batched_with_prefix_hits_and_chunked_prefill,
    test_greedy_decode_equals_transformers,
    test_int4_gguf_follows_its_fp32_weights,
    test_logits_match_transformers,
    write_gguf,
    write_hf,
)

from localllm.config import ModelConfig
from localllm.model.loader import load_model
from localllm.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

MOE = {k: v for k, v in TINY.items() if k != "intermediate_size"} | dict(num_experts_per_tok=2)
FAMILIES = {
    # every layer sparse, top-2 of 8 renormalised
    "mixtral": Family(lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **MOE, intermediate_size=64, num_local_experts=8, rope_theta=1e6)), "llama", False),
    # layer 0 a dense MLP (mlp_only_layers), layer 1 top-2 of 8 not renormalised
    "qwen3moe": Family(lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **MOE, intermediate_size=128, moe_intermediate_size=64, num_experts=8, mlp_only_layers=[0],
        norm_topk_prob=False, rope_theta=1e6)), "qwen3moe", False),
}


def moe_gguf(model, arch: str, out: Path, tokenizer_gguf: Path, quantized: bool = False,
             split: bool = False, qtype_of=None) -> Path:
    """The model as llama.cpp's converter writes it: routers as ffn_gate_inp, the experts (held
    fused by transformers: gate_up [E, 2I, H], down [E, H, I]) as ffn_{gate,up,down}_exps, or
    with `split` one ffn_{gate,up,down}.{e} tensor each (the first Mixtral GGUFs)."""
    cfg = model.config
    state = model.state_dict()
    moe = {n: state.pop(n) for n in list(state) if ".experts." in n or n.endswith("mlp.gate.weight")}

    def tensors():
        yield from llama_tensors(model, state) if arch == "llama" else gguf_tensors(model, state)
        for name, t in moe.items():
            i, a = name.split(".")[2], t.float().numpy()
            if name.endswith("gate.weight"):
                yield f"blk.{i}.ffn_gate_inp.weight", a
            elif name.endswith("gate_up_proj"):
                half = a.shape[1] // 2
                yield f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(a[:, :half])
                yield f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(a[:, half:])
            else:
                yield f"blk.{i}.ffn_down_exps.weight", a

    def split_experts(pairs):
        for name, a in pairs:
            if split and "_exps." in name:
                yield from ((name.replace("_exps.", f".{e}."), np.ascontiguousarray(x)) for e, x in enumerate(a))
            else:
                yield name, a

    n = cfg.num_local_experts if arch == "llama" else cfg.num_experts
    kv = {f"{arch}.expert_count": n, f"{arch}.expert_used_count": cfg.num_experts_per_tok}
    if arch == "qwen3moe":
        kv |= {f"{arch}.expert_feed_forward_length": cfg.moe_intermediate_size,
               f"{arch}.expert_weights_norm": bool(cfg.norm_topk_prob)}
    return write_gguf(model, arch, out, tokenizer_gguf, quantized, split_experts(tensors()), kv, qtype_of)


def moe_peaked(model: torch.nn.Module, seed: int) -> None:
    """peaked() with the 3-D expert stacks scaled by their own input width."""
    peaked(model, seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 3:
                p.mul_((p.shape[1] / p.shape[2]) ** 0.5)


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    from localllm.model.weights import open_weights

    return open_weights(gguf_path).tokenizer()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, tokenizer, gguf_path):
    """(transformers model, HF directory, F32 GGUF, Q4_1 GGUF, Family) of one tiny MoE checkpoint."""
    return build_family(request.param, FAMILIES, moe_peaked, moe_gguf, tmp_path_factory, tokenizer, gguf_path)


def test_moe_config_and_parameter_counts(family):
    from localllm.model.weights import open_weights

    ref_model, hf_dir, gguf_file, _, _ = family
    hf, gg = open_weights(hf_dir).config, open_weights(gguf_file).config
    mixtral = isinstance(ref_model, transformers.MixtralForCausalLM)
    assert hf.architecture == gg.architecture == ("MixtralForCausalLM" if mixtral else "Qwen3MoeForCausalLM")
    assert hf.moe_layers == gg.moe_layers == ((True, True) if mixtral else (False, True))
    for f in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "intermediate_size",
              "qk_norm", "num_params"):
        assert getattr(hf, f) == getattr(gg, f), f
    assert hf.norm_topk_prob == mixtral and hf.num_experts == 8
    assert ModelConfig.from_hf(hf.to_hf()) == hf  # the quantizer and exporters write configs from to_hf
    qk_norms = sum(p.numel() for n, p in ref_model.named_parameters() if "_norm." in n and "self_attn" in n)
    assert hf.num_params == sum(p.numel() for p in ref_model.parameters()) - qk_norms
    assert hf.num_params - hf.active_params == 6 * 3 * 64 * 64 * sum(hf.moe_layers)  # 6 of 8 experts idle
    # published configs: Qwen3-30B-A3B (num_experts, norm_topk_prob true) and Mixtral-8x7B
    q3 = ModelConfig.from_hf({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
                              "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                              "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                              "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                              "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False})
    assert q3.norm_topk_prob and all(q3.moe_layers) and q3.qk_norm
    assert round(q3.num_params / 1e9, 1) == 30.5 and round(q3.active_params / 1e9, 2) == 3.35
    mx = ModelConfig.from_hf({"architectures": ["MixtralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
                              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                              "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2})
    assert mx.num_params == 46_702_792_704 and round(mx.active_params / 1e9, 1) == 12.9
    # the planner sizes the registry's MoE models with every expert resident
    from localllm.planner import plan_for

    p = plan_for("qwen3-30b-a3b", max_memory=64, device="cpu")
    assert p.precision == "bfloat16" and p.weights_bytes >= 2 * q3.num_params


def test_other_expert_layouts_load_the_same(family, tmp_path, gguf_path):
    """transformers 5's in-memory layout (experts fused per layer under mlp.experts, routers as
    mlp.gate), which save_pretrained converts back to one tensor per expert: both load. So do
    Mixtral GGUFs with one tensor per expert."""
    from safetensors.torch import save_file

    ref_model, hf_dir, *_ = family
    for f in hf_dir.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file({n: t.contiguous() for n, t in ref_model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    want = make_engine(load_model(hf_dir, "float32")).score(PROMPT)
    assert torch.equal(make_engine(load_model(tmp_path, "float32")).score(PROMPT), want)
    if isinstance(ref_model, transformers.MixtralForCausalLM):  # the first Mixtral GGUFs: experts one by one
        split = moe_gguf(ref_model, "llama", tmp_path / "split.gguf", gguf_path, split=True)
        torch.testing.assert_close(make_engine(load_model(split, "float32")).score(PROMPT), want, atol=2e-4, rtol=1e-4)


def test_gguf_exports_to_an_hf_checkpoint_transformers_runs(family, tmp_path):
    """export_hf of an MoE GGUF: one tensor per expert as the hub checkpoints store them, the
    config from to_hf; transformers on it gives the original model's logits."""
    from localllm.model.export import export_hf

    ref_model, _, gguf_file, _, _ = family
    out = export_hf(gguf_file, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf) is type(ref_model)
    with torch.no_grad():
        got, ref = hf(torch.tensor([PROMPT])).logits[0], ref_model(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


def mxfp4_moe(name: str, a: np.ndarray):
    """llama.cpp's MXFP4_MOE file type (gpt-oss's layout): experts MXFP4, the other matrices Q8_0,
    routers and norms F32."""
    import gguf

    if "_exps." in name:
        return gguf.GGMLQuantizationType.MXFP4
    return gguf.GGMLQuantizationType.Q8_0 if a.ndim >= 2 and "ffn_gate_inp" not in name else None


def test_mxfp4_experts_run_on_the_files_values(family, tmp_path, gguf_path, monkeypatch):
    """MXFP4 experts (gpt-oss's type; any MoE quantized to MXFP4_MOE) held as their 4-bit codebook
    indices with power-of-two scales on the int8-lane kernel, repacked by the C++ pass and stacked
    for moe_int8w: the file's values exactly (against gguf-py's dequantization), and greedy tokens
    equal to transformers' fp32 on the file's dequantized weights."""
    import gguf

    from localllm.model.export import export_hf
    from localllm.model.moe import Int8wExperts
    from localllm.model.weights import open_weights
    from localllm_kernels import cpu_int8, cpu_repack

    ref_model, _, _, _, fam = family
    path = moe_gguf(ref_model, fam.arch, tmp_path / "mxfp4.gguf", gguf_path, qtype_of=mxfp4_moe)
    calls, block32 = [], cpu_repack.block32
    monkeypatch.setattr(cpu_repack, "block32", lambda raw, kind, *a, **kw: calls.append(kind) or block32(raw, kind, *a, **kw))
    loaded = load_model(path, "auto")
    # each MoE layer's experts in two repacks, one a matrix, giving the stacks one expert at a time gives
    assert calls.count("MXFP4") == 2 * sum(map(loaded.config.is_moe_layer, range(loaded.config.num_layers)))
    assert_stacks_are_one_by_ones(loaded, path)
    assert "MXFP4/Q8_0 weights as stored" in loaded.precision  # our CPU kernels, not the fp32 fallback
    layer = len(loaded.model.layers) - 1  # an MoE layer in both families
    experts = loaded.model.layers[layer].moe.experts
    tensor = open_weights(path).file.tensors[f"blk.{layer}.ffn_down_exps.weight"]
    assert tensor.qtype.name == "MXFP4"
    file_values = gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType.MXFP4).reshape(tensor.shape)
    assert isinstance(experts, Int8wExperts) and experts.zero2 == 16  # MXFP4's codebook indices
    for e in range(loaded.config.num_experts):
        held = cpu_int8.dequantize(experts.w2[e], experts.s2[e], file_values.shape[1], experts.group2, experts.zero2)
        assert np.array_equal(held.numpy(), file_values[e])
    hf = transformers.AutoModelForCausalLM.from_pretrained(export_hf(path, tmp_path / "hf"), dtype=torch.float32)
    *_, last = make_engine(loaded).generate(list(PROMPT), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert last.token_ids == hf_greedy(hf.eval(), PROMPT, 24)


@pytest.mark.parametrize("family", ["qwen3moe"], indirect=True)
def test_mixed_experts_stack_a_layer_at_once(family, tmp_path, gguf_path, monkeypatch):
    """A K-quant mix's shape of experts, 4-bit gate/up beside an 8-bit down (here Q4_0 and Q8_0, which
    gguf-py writes): each MoE layer's experts in one repack a matrix, Int8wExperts holding the int4
    matrix in its int8-lane form, the stacks make_experts builds one expert at a time."""
    import gguf

    from localllm.model.moe import Int8wExperts
    from localllm_kernels import cpu_repack

    def mixed(name: str, a: np.ndarray):
        if "_exps." in name and "down" not in name:
            return gguf.GGMLQuantizationType.Q4_0
        return mxfp4_moe(name, a) and gguf.GGMLQuantizationType.Q8_0  # the rest as in mxfp4_moe
    path = moe_gguf(family[0], family[4].arch, tmp_path / "mixed.gguf", gguf_path, qtype_of=mixed)
    calls, q4 = [], cpu_repack.q4_0_1
    monkeypatch.setattr(cpu_repack, "q4_0_1", lambda raws, *a: calls.append(len(raws[0])) or q4(raws, *a))
    loaded = load_model(path, "auto")
    cfg = loaded.config
    assert calls == [2 * cfg.num_experts * cfg.moe_intermediate_size]  # the one MoE layer's gate/up at once
    assert isinstance(loaded.model.layers[1].moe.experts, Int8wExperts)
    assert_stacks_are_one_by_ones(loaded, path)


def assert_stacks_are_one_by_ones(loaded, path) -> None:
    """Every MoE layer's stacked experts (built a layer at a time) are what make_experts stacks from
    each expert's own linears: the same class, buffers and forms."""
    from localllm.model import loader
    from localllm.model.moe import EXPERT_ACTS, expert_tensor_names, make_experts
    from localllm.model.weights import open_weights

    weights, cfg = open_weights(path), loaded.config
    act = (EXPERT_ACTS[cfg.expert_act], cfg.swiglu_alpha, cfg.swiglu_limit)
    for i in filter(cfg.is_moe_layer, range(cfg.num_layers)):
        def expert(e: int, names=expert_tensor_names(cfg, i)[1]):
            return tuple(loader._linear(weights, parts, "int4", torch.float32, "cpu")
                         for parts in (list(names[e][:2]), [names[e][2]]))
        want, got = make_experts(expert, cfg.num_experts, cfg.moe_intermediate_size, act), loaded.model.layers[i].moe.experts
        ws, gs = want.state_dict(), got.state_dict()
        assert type(want) is type(got) and ws.keys() == gs.keys() and all(torch.equal(ws[k], gs[k]) for k in ws), i
        for a in ("group1", "zero1", "group2", "zero2", "inter", "act_kind", "alpha", "limit"):
            assert getattr(want, a, None) == getattr(got, a, None), (i, a)


def test_quantizer_refuses_moe_in_one_line(family, tmp_path):
    from typer.testing import CliRunner

    from localllm.cli import app

    r = CliRunner().invoke(app, ["quantize", str(family[1]), "--output", str(tmp_path / "q"), "--method", "rtn"])
    assert r.exit_code != 0 and "mixture-of-experts models" in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output


def _int4_experts(E: int, H: int, inter: int, g: torch.Generator):
    """(gate_up Int4Linears, down Int4Linears, their fp32 weights as pairs) of E random experts."""
    from localllm.model.int4 import quantize_rtn
    from localllm.model.layers import Int4Linear

    def lin(n, k):
        w = quantize_rtn(torch.randn(n, k, generator=g) / k ** 0.5, 32)
        return Int4Linear(w, torch.float32), w.dequantize()
    gate_up, down = [lin(2 * inter, H) for _ in range(E)], [lin(H, inter) for _ in range(E)]
    return [m for m, _ in gate_up], [m for m, _ in down], [(a, b) for (_, a), (_, b) in zip(gate_up, down)]


def test_moe_int4_op_matches_the_torch_loop():
    """localllm::moe_int4 (experts stacked, rows grouped per expert in C++) against the torch loop
    over the same int4 experts (one int4_gemm each) and the dequantized fp32 math, at batch 1 and
    5 with several expert sets: tokens sharing experts, an expert used twice, every expert."""
    from localllm.model.llama import silu_mul
    from localllm.model.moe import Int4Experts, LoopExperts
    from localllm_kernels import cpu_int4

    if not cpu_int4.load():
        pytest.skip("no int4 CPU kernel on this machine (it needs AVX2)")
    g = torch.Generator().manual_seed(0)
    E, H, inter = 8, 128, 96
    gate_up, down, dense = _int4_experts(E, H, inter, g)
    fused, loop = Int4Experts.stacked(zip(gate_up, down), E, inter), LoopExperts(gate_up, down)
    sets = [[[3, 5]], [[0, 7]], [[2, 2]],
            [[1, 4], [4, 1], [6, 0], [4, 6], [1, 4]], [[0, 1], [2, 3], [4, 5], [6, 7], [7, 0]]]
    for ids in sets:
        ids = torch.tensor(ids)
        x = torch.randn(len(ids), H, generator=g)
        w = torch.softmax(torch.randn(ids.shape, generator=g), -1)
        got, want = fused(x, ids, w, silu_mul), loop(x, ids, w, silu_mul)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        ref = torch.zeros_like(x)
        for t in range(len(ids)):
            for j, e in enumerate(ids[t].tolist()):
                h = silu_mul(x[t] @ dense[e][0].t())
                ref[t] += w[t, j] * (h @ dense[e][1].t())
        assert ((got - ref).norm() / ref.norm()) < 1e-2  # 16-bit activations inside the kernel


def _int8w_experts(kind: str, E: int, H: int, inter: int, seed: int):
    """E experts of a GGUF type ("Q4_K+Q6_K": gate_up of one, down of the other, as a K-quant mix
    has them) as the loader builds them (the file's form; Q4_K on the int4 kernel, the others on the
    int8-lane one), and their dequantized fp32 matrices."""
    from test_gguf_kquants import random_blocks

    from localllm.model import gguf_blocks
    from localllm.model.layers import Int4Linear, Int8wLinear
    from localllm_kernels import cpu_int4, cpu_int8

    kinds = kind.split("+") * (2 if "+" not in kind else 1)
    layers, dense = [], []
    for e in range(E):
        pair, ref = [], []
        for kind, (n, k) in zip(kinds, ((2 * inter, H), (H, inter))):
            raw = random_blocks(kind, n, k, seed=seed * 100 + 2 * e + (n == H), std=k ** -0.5)
            b = gguf_blocks.decode(kind, torch.from_numpy(raw))
            sub = None if b.sub is None else b.sub.packed()
            if kind == "Q4_K":
                qw, qsc = cpu_int4.pack_dm(b.q, b.d, b.m, sub)
                pair.append(Int4Linear.from_kernel_tensors({"qw": qw, "qsc": qsc}, n, 32))
            else:
                qw, qsc = cpu_int8.pack(b.q, b.d, b.m, b.zero, 4 if b.lut is not None else b.bits, sub, b.lut)
                pair.append(Int8wLinear(qw, qsc, n, b.group, b.zero))
            ref.append(b.values())
        layers.append(tuple(pair))
        dense.append(ref)
    return layers, dense


@pytest.mark.parametrize("kind", ["MXFP4", "Q6_K", "Q8_0", "Q4_K+Q6_K"])
def test_moe_int8w_op_matches_the_torch_loop(kind):
    """localllm::moe_int8w (int8-lane experts stacked, rows grouped per expert in C++) bit for bit
    the torch loop over the same experts (one int8w_gemm each) on every instruction-set path: tokens
    sharing experts, an expert used twice, every expert, and a prefill's many rows per expert
    (several tiles; AVX2's dense route); and against the dequantized fp32 math. A K-quant mix's
    experts (Q4_K gate/up on the int4 kernel, Q6_K down) stack too: the int4 layout is the
    int8-lane one, and the two kernels give the same bits (below AVX2's dense route, 192 rows an
    expert, which the int4 kernel does not take: the sets here stay below it)."""
    from localllm.model.llama import silu_mul
    from localllm.model.moe import Int8wExperts, LoopExperts, make_experts
    from localllm_kernels import cpu_int8

    assert cpu_int8.load()
    E, H, inter = 8, 256, 256 if "_K" in kind else 96  # (K-quants: blocks of 256)
    pairs, dense = _int8w_experts(kind, E, H, inter, seed=3)
    fused = make_experts(lambda e: pairs[e], E, inter)
    loop = LoopExperts([g for g, _ in pairs], [d for _, d in pairs])
    assert isinstance(fused, Int8wExperts)
    g = torch.Generator().manual_seed(0)
    sets = [[[3, 5]], [[2, 2]], [[1, 4], [4, 1], [6, 0], [4, 6], [1, 4]],
            [[e % 8, (e + 1) % 8] for e in range(400)]]
    best = cpu_int8.isa()
    paths = {"avx512_vnni": ["avx512_vnni", "avx2", "generic"], "avx2": ["avx2", "generic"]}.get(best, ["generic"])
    try:
        for path in paths:
            torch.ops.localllm.int8w_isa(path)
            for ids in sets:
                ids = torch.tensor(ids)
                x = torch.randn(len(ids), H, generator=g)
                w = torch.softmax(torch.randn(ids.shape, generator=g), -1)
                got, want = fused(x, ids, w, silu_mul), loop(x, ids, w, silu_mul)
                assert torch.equal(got, want), path  # the same kernels, silu and order of sums
                ref = torch.zeros_like(x)
                for t in range(len(ids)):
                    for j, e in enumerate(ids[t].tolist()):
                        ref[t] += w[t, j] * (silu_mul(x[t] @ dense[e][0].t()) @ dense[e][1].t())
                assert ((got - ref).norm() / ref.norm()) < 1e-3, path  # 16-bit activations inside the kernel
    finally:
        torch.ops.localllm.int8w_isa("auto")


@pytest.mark.parametrize("kind", ["MXFP4", "Q4_K+Q6_K"])
def test_moe_int8w_with_biases_and_clamped_swiglu(kind):
    """gpt-oss's experts in the one op: biases on gate_up and down, the clamped SwiGLU (alpha 1.702,
    limit 7, with gate/up outputs past the limit so the clamps act): bit for bit the torch loop over
    the same biased linears with moe.swiglu_oai, on every instruction-set path, and near the fp32 math."""
    import functools

    from localllm.model.moe import Int8wExperts, LoopExperts, make_experts, swiglu_oai
    from localllm_kernels import cpu_int8

    assert cpu_int8.load()
    E, H, inter = 8, 256, 256 if "_K" in kind else 96
    pairs, dense = _int8w_experts(kind, E, H, inter, seed=5)
    g = torch.Generator().manual_seed(1)
    for gate_up, down in pairs:
        gate_up.bias = torch.nn.Parameter(torch.randn(2 * inter, generator=g) * 3, requires_grad=False)
        down.bias = torch.nn.Parameter(torch.randn(H, generator=g) * 0.3, requires_grad=False)
    act = functools.partial(swiglu_oai, alpha=1.702, limit=7.0)
    fused = make_experts(lambda e: pairs[e], E, inter, (1, 1.702, 7.0))
    loop = LoopExperts([g for g, _ in pairs], [d for _, d in pairs])
    assert isinstance(fused, Int8wExperts) and fused.b1 is not None
    best = cpu_int8.isa()
    paths = {"avx512_vnni": ["avx512_vnni", "avx2", "generic"], "avx2": ["avx2", "generic"]}.get(best, ["generic"])
    try:
        for path in paths:
            torch.ops.localllm.int8w_isa(path)
            for ids in ([[3, 5]], [[1, 4], [4, 1], [6, 0], [4, 6]], [[e % 8, (e + 3) % 8] for e in range(300)]):
                ids = torch.tensor(ids)
                x = torch.randn(len(ids), H, generator=g) * 4
                w = torch.softmax(torch.randn(ids.shape, generator=g), -1)
                got = fused(x, ids, w, act)
                assert torch.equal(got, loop(x, ids, w, act)), path
                ref = torch.zeros_like(x)
                for t in range(len(ids)):
                    for j, e in enumerate(ids[t].tolist()):
                        gu = x[t] @ dense[e][0].t() + pairs[e][0].bias
                        ref[t] += w[t, j] * (act(gu) @ dense[e][1].t() + pairs[e][1].bias)
                assert ((got - ref).norm() / ref.norm()) < 2e-3, path
            gu = torch.cat([p[0](torch.randn(4, H, generator=g) * 4) for p in pairs])
            assert (gu.abs() > 7).any()  # the clamps are reached
    finally:
        torch.ops.localllm.int8w_isa("auto")


def test_moe_int8w_in_expert_groups():
    """A prefill's pairs over wide experts run in groups of experts whose buffers stay under 16 MB
    (here 4 groups of ~600 pairs at N = 4096): still bit for bit the looped experts, biases and the
    clamped SwiGLU included, each token's sum in expert order across the groups."""
    import functools

    from localllm.model.moe import LoopExperts, make_experts, swiglu_oai

    E, H, inter = 4, 2048, 2048
    pairs, _ = _int8w_experts("MXFP4", E, H, inter, seed=7)
    g = torch.Generator().manual_seed(2)
    for gate_up, down in pairs:
        gate_up.bias = torch.nn.Parameter(torch.randn(2 * inter, generator=g), requires_grad=False)
        down.bias = torch.nn.Parameter(torch.randn(H, generator=g) * 0.1, requires_grad=False)
    act = functools.partial(swiglu_oai, alpha=1.702, limit=7.0)
    fused = make_experts(lambda e: pairs[e], E, inter, (1, 1.702, 7.0))
    loop = LoopExperts([p[0] for p in pairs], [p[1] for p in pairs])
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(1200)])
    x = torch.randn(len(ids), H, generator=g)
    w = torch.softmax(torch.randn(ids.shape, generator=g), -1)
    assert torch.equal(fused(x, ids, w, act), loop(x, ids, w, act))


@pytest.mark.slow  # ~11 s of compiling: `make test-slow`, outside CI's 20-minute budget
@pytest.mark.parametrize("family", ["mixtral"], indirect=True)  # one family: each package compiles ~20 s
def test_compiled_step_covers_int4_moe(family):
    """An int4 MoE model (Q4_1 experts on our int4 kernel) compiles: the d1 package (exported with
    the MoE op, checked against the eager step when built) decodes the eager tokens. An fp32 MoE
    model (experts looped in Python) runs eagerly."""
    from localllm.model import compiled
    from localllm.model.moe import Int4Experts
    from localllm_kernels import cpu_int4

    model, _, gguf_file, q4_file, _ = family
    if not cpu_int4.load():
        pytest.skip("no int4 CPU kernel on this machine (it needs AVX2)")
    assert make_engine(load_model(gguf_file, "float32"), compile=True).runner.captured is None
    loaded = load_model(q4_file, "auto")
    assert isinstance(loaded.model.layers[0].moe.experts, Int4Experts)
    compiled.build_package(loaded.model, "d1", loaded.kv_dtype,
                           compiled.package_path(loaded.model, "d1", loaded.kv_dtype))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    *_, eager = make_engine(loaded).generate(list(PROMPT), params)
    eng = make_engine(loaded, compile=True)
    *_, got = eng.generate(list(PROMPT), params)
    assert eng.runner.captured.steps >= 15 and got.token_ids == eager.token_ids


def test_experts_stack_one_at_a_time():
    """make_experts stacks experts as they are built (buffers allocated once): fp16 and fp32 scales
    stack as fp32, exactly; a layer that leaves the kernel's terms mid-way (another group size) is
    built again as LoopExperts. Kernel buffers made up: no VNNI needed, nothing runs."""
    from localllm.model.layers import Int4Linear
    from localllm.model.moe import Int4Experts, LoopExperts, make_experts

    g = torch.Generator().manual_seed(0)

    def lin(n, k, group, dtype=torch.float16):
        qw = torch.randint(0, 256, (n // 16, k // 8, 64), dtype=torch.uint8, generator=g)
        qsc = torch.randn(n // 16, k // group, 2, 16, generator=g).to(dtype)
        return Int4Linear.from_kernel_tensors({"qw": qw, "qsc": qsc}, n, group)
    experts = [(lin(64, 32, 32), lin(32, 32, 32, torch.float32 if e == 2 else torch.float16)) for e in range(4)]
    calls = []

    def expert(e):
        calls.append(e)
        return experts[e]
    got = make_experts(expert, 4, 32)
    assert isinstance(got, Int4Experts) and calls == [0, 1, 2, 3]
    assert got.s1.dtype == torch.float16 and got.s2.dtype == torch.float32
    for e, (gate_up, down) in enumerate(experts):
        assert torch.equal(got.w1[e], gate_up.qw) and torch.equal(got.s1[e], gate_up.qsc)
        assert torch.equal(got.w2[e], down.qw) and torch.equal(got.s2[e], down.qsc.float())
    experts[3] = (lin(64, 32, 32), lin(32, 64, 64))
    calls.clear()
    got = make_experts(expert, 4, 32)
    assert isinstance(got, LoopExperts) and calls == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [m for pair in zip(got.gate_up, got.down) for m in pair] == [m for pair in experts for m in pair]


@pytest.mark.parametrize("family", ["qwen3moe"], indirect=True)  # a dense layer and an MoE layer
@pytest.mark.parametrize("kind", ["Q4_1", "MXFP4"])
def test_moe_layers_load_from_the_conversion_cache(family, kind, tmp_path, monkeypatch, gguf_path):
    """A Q4_1 MoE GGUF's second load takes its experts (Int4Experts' stacks, or each looped
    expert on CPUs without VNNI) and routers from the conversion cache, an MXFP4_MOE one its
    Int8wExperts' stacks: nothing is repacked or read from the GGUF's expert tensors, the buffers
    are the first load's, and so are the logits and greedy tokens."""
    from localllm.model import convert_cache, loader

    q4_file = family[3] if kind == "Q4_1" else moe_gguf(family[0], family[4].arch, tmp_path / "mx.gguf", gguf_path,
                                                        qtype_of=mxfp4_moe)
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))  # a cache of this test's own
    caches = []
    open_cache = convert_cache.ConvertCache.open
    monkeypatch.setattr(convert_cache.ConvertCache, "open", staticmethod(lambda *a: caches.append(open_cache(*a)) or caches[-1]))
    cold = load_model(q4_file, "auto")
    assert not caches[0].hit and any(".experts." in k for k in caches[0].tensors)
    assert_stacks_are_one_by_ones(cold, q4_file)

    def fail(*a, **kw):
        raise AssertionError("a cache hit built a layer")
    for name in ("make_experts", "_linear"):
        monkeypatch.setattr(loader, name, fail)
    monkeypatch.setattr(loader.GGUFWeights, "_expert_tensor", fail)
    dense = loader.GGUFWeights.dense  # norms are read again; routers are not
    monkeypatch.setattr(loader.GGUFWeights, "dense", lambda w, name: fail() if ".mlp.gate." in name else dense(w, name))
    warm = load_model(q4_file, "auto")
    assert caches[1].hit
    moe_cold, moe_warm = cold.model.layers[1].moe, warm.model.layers[1].moe
    assert type(moe_warm.experts) is type(moe_cold.experts)
    assert kind == "Q4_1" or type(moe_warm.experts).__name__ == "Int8wExperts"
    want, got = cold.model.state_dict(), warm.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert torch.equal(make_engine(warm).score(PROMPT), make_engine(cold).score(PROMPT))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    *_, a = make_engine(cold).generate(list(PROMPT), params)
    *_, b = make_engine(warm).generate(list(PROMPT), params)
    assert a.token_ids == b.token_ids


def test_bench_tiny_moe_gguf_runs(tmp_path, gguf_path):
    """bench/make_gguf.py's qwen3moe shapes (the tiny one here): our int4 and fp32 runs agree
    (llama.cpp runs the same file side by side in bench/compare.py)."""
    spec = importlib.util.spec_from_file_location("make_gguf", Path(__file__).parent.parent / "bench" / "make_gguf.py")
    make_gguf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_gguf)
    assert Path(make_gguf.source_gguf()) == gguf_path
    path = make_gguf.write("tiny-moe", str(tmp_path / "tiny-moe.Q4_1.gguf"), src=gguf_reader(gguf_path))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [1, 504, 3458, 282, 5248]
    runs = {}
    for precision in ("auto", "float32"):
        loaded = load_model(path, precision)
        assert loaded.config.num_experts == 8 and all(loaded.config.moe_layers)
        *_, out = make_engine(loaded).generate(list(prompt), params)
        runs[precision] = out.token_ids
    assert runs["auto"] == runs["float32"]
