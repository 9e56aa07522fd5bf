"""Our quantizer (RTN / GPTQ / AWQ) end to end: standard checkpoints that load back bit-exactly,
GPTQ's algorithm beats rounding on real activations, perplexity, and weight-only int8."""

import json
from pathlib import Path

import pytest
import torch
from conftest import CHAT_PROMPTS, chat, make_engine
from safetensors import safe_open

from localllm.quant.calib_text import EVAL
from localllm.sampling import SamplingParams

HIDDEN, INTER, KV_OUT = 576, 1536, 192  # SmolLM2-135M: hidden, MLP, 3 KV heads x 64


@pytest.fixture(scope="module")
def small_src(tmp_path_factory, gguf_path):
    from localllm.model.export import export_hf

    return export_hf(gguf_path, tmp_path_factory.mktemp("q") / "src2", num_layers=2)


@pytest.fixture(scope="module")
def quantized(small_src, tmp_path_factory):
    """Each method once, with what the quantizer computed kept for comparison."""
    from localllm.quant.quantize import quantize_model

    out = {}
    root = tmp_path_factory.mktemp("qout")
    for tag, method, kw in [("rtn", "rtn", {}), ("gptq", "gptq", {}),
                            ("gptq-plain", "gptq", {"act_order": False, "sym": True, "mse": False}), ("awq", "awq", {})]:
        out[tag] = quantize_model(small_src, root / tag, method, num_samples=2, keep_dequantized=True, **kw)
    return out


@pytest.mark.parametrize("tag", ["rtn", "gptq", "gptq-plain", "awq"])
def test_checkpoint_loads_back_bit_exactly(quantized, tag):
    from localllm.model.weights import open_weights

    r = quantized[tag]
    assert r.group_size == 64  # 576 = 9 * 64: the largest of 128/64/32 that divides every K
    w = open_weights(r.path)
    assert len(r.dequantized) == 2 * 7
    for name, want in r.dequantized.items():
        w4 = w.int4(name)
        assert w4 is not None and w4.group_size == 64
        assert torch.equal(w4.dequantize_logical(), want), name
        assert torch.equal(w.dense(name), want), name
        assert (w4.in_perm is not None) == (tag == "gptq")  # act-order is GPTQ's default


def test_awq_checkpoint_is_standard(quantized):
    p = quantized["awq"].path
    qc = json.loads((p / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm",
                  "modules_to_not_convert": None}
    with safe_open(str(p / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        pre = "model.layers.0.self_attn.k_proj."
        assert f.get_tensor(pre + "qweight").dtype == torch.int32
        assert tuple(f.get_tensor(pre + "qweight").shape) == (HIDDEN, KV_OUT // 8)  # [in, out/8]
        assert tuple(f.get_tensor(pre + "qzeros").shape) == (HIDDEN // 64, KV_OUT // 8)
        s = f.get_tensor(pre + "scales")
        assert s.dtype == torch.float16 and tuple(s.shape) == (HIDDEN // 64, KV_OUT)
        assert f.get_tensor("model.layers.0.input_layernorm.weight").dtype == torch.float16
    assert pre + "weight" not in keys and pre + "g_idx" not in keys
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {x.name for x in p.iterdir()}


def test_gptq_checkpoint_is_standard(quantized):
    """The default (act-order, asymmetric) and the plain (sym, no act-order) GPTQ v1 layouts."""
    pre = "model.layers.1.mlp.down_proj."
    for tag, desc_act, sym in [("gptq", True, False), ("gptq-plain", False, True)]:
        p = quantized[tag].path
        qc = json.loads((p / "config.json").read_text())["quantization_config"]
        assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["desc_act"], qc["sym"],
                qc["checkpoint_format"]) == ("gptq", 4, 64, desc_act, sym, "gptq")
        assert json.loads((p / "quantize_config.json").read_text())["desc_act"] is desc_act
        with safe_open(str(p / "model.safetensors"), "pt") as f:
            assert tuple(f.get_tensor(pre + "qweight").shape) == (INTER // 8, HIDDEN)  # [in/8, out]
            assert tuple(f.get_tensor(pre + "qzeros").shape) == (INTER // 64, HIDDEN // 8)
            g_idx = f.get_tensor(pre + "g_idx")
            z = f.get_tensor(pre + "qzeros")
        assert g_idx.dtype == torch.int32 and g_idx.shape == (INTER,)
        assert bool((g_idx[1:] < g_idx[:-1]).any()) == desc_act  # act-order: not monotonic
        assert torch.equal(torch.bincount(g_idx.long()), torch.full((INTER // 64,), 64))
        # sym v1: every stored zero is 8 - 1; asym: true zeros 1..15 stored minus one, not all 7
        assert bool((z == 0x77777777).all()) == sym


def test_quantized_checkpoints_generate(quantized):
    """The act-order checkpoint runs through the engine (input permutation) like the plain one."""
    from localllm.model.loader import load_model

    outs = []
    for tag in ("gptq-plain", "gptq"):
        loaded = load_model(quantized[tag].path, "auto")
        assert "int4" in loaded.precision
        *_, last = make_engine(loaded).generate(chat(CHAT_PROMPTS[0]), SamplingParams(temperature=0, max_tokens=4))
        outs.append(last.token_ids)
    assert all(len(o) >= 1 for o in outs)


def test_gptq_beats_rtn_on_the_layer_output(small_src):
    """On real activations (layer 0's normed inputs), GPTQ's output error ||X (W - Q)^T|| is well
    below round-to-nearest's on the same group/sym settings."""
    from localllm.model.loader import load_model
    from localllm.quant.quantize import _hessian, calibration_ids, gptq, rtn

    m = load_model(small_src, "float32")
    ids = calibration_ids(m.tokenizer, None, 8, 256)
    layer = m.model.layers[0]
    x = layer.input_norm(m.model.embed_tokens(ids)).reshape(-1, HIDDEN)
    W = layer.qkv.weight[:HIDDEN]  # q_proj: the first rows of the fused qkv
    H = _hessian(x)
    for sym in (True, False):
        e_rtn = (x @ (W - rtn(W, 64, sym, True, v1_zeros=not sym).dequantize()).t()).pow(2).mean()
        e_gptq = (x @ (W - gptq(W, H, 64, sym).dequantize()).t()).pow(2).mean()
        e_act = (x @ (W - gptq(W, H, 64, sym, act_order=True).dequantize()).t()).pow(2).mean()
        e_mse = (x @ (W - gptq(W, H, 64, sym, act_order=True, mse=True).dequantize()).t()).pow(2).mean()
        assert e_gptq < 0.8 * e_rtn and e_act < 0.8 * e_rtn, (sym, e_rtn, e_gptq, e_act)
        assert e_mse < e_act, (sym, e_act, e_mse)  # the Hessian-weighted scale search helps


def test_mse_params_never_worse_than_minmax():
    """The shrink search includes the plain min/max range, so its weighted error is never larger;
    it keeps v1's zero >= 1 and fp16-exact scales."""
    from localllm.quant.quantize import minmax_params, mse_params, quantize_cols

    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 64, generator=g) * torch.rand(256, 1, generator=g)
    w[:8, 0] = 6.0  # outliers: where shrinking the range pays
    cw = torch.rand(64, generator=g) * 4

    def err(s, z):
        return (((quantize_cols(w, s, z) - z[:, None]) * s[:, None] - w).pow(2) * cw).sum(1)

    for sym in (True, False):
        s0, z0 = minmax_params(w, sym, zero_in_range=True)
        z0 = z0 if sym else z0.clamp(min=1)
        s, z = mse_params(w, sym, not sym, cw)
        e0, e = err(s0, z0), err(s, z)
        assert bool((e <= e0).all()) and float(e.sum()) < 0.97 * float(e0.sum()), (sym, e.sum(), e0.sum())
        assert torch.equal(s, s.half().float()) and bool((z >= (8 if sym else 1)).all() and (z <= 15).all())
        assert bool((z == 8).all()) == sym


def test_quantizer_rejects_bad_input(small_src, quantized, tmp_path):
    from localllm.quant.quantize import QuantizeError, quantize_model

    with pytest.raises(QuantizeError, match="group-size 128 does not divide"):
        quantize_model(small_src, tmp_path / "x", "rtn", group_size=128)
    with pytest.raises(QuantizeError, match="method"):
        quantize_model(small_src, tmp_path / "x", "hqq")
    with pytest.raises(QuantizeError, match="bits"):
        quantize_model(small_src, tmp_path / "x", "gptq", bits=3)
    with pytest.raises(QuantizeError, match="already quantized"):
        quantize_model(quantized["awq"].path, tmp_path / "x", "gptq")
    with pytest.raises(QuantizeError, match="act-order applies to GPTQ only"):
        quantize_model(small_src, tmp_path / "x", "rtn", act_order=True)
    with pytest.raises(QuantizeError, match="applies to GPTQ only"):
        quantize_model(small_src, tmp_path / "x", "awq", mse=True)


# ---- perplexity on the full 30-layer model (the default GPTQ takes ~60 s on one core). AWQ's
# full-model perplexity (+12.9%, another ~60 s) is in BENCHMARKS.md only, to keep CI short. ----
@pytest.fixture(scope="module")
def ppl(hf_export_dir, tmp_path_factory):
    from localllm.model.loader import load_model
    from localllm.quant.quantize import perplexity, quantize_model

    root = tmp_path_factory.mktemp("ppl")
    base = load_model(hf_export_dir, "float32")
    ids = base.tokenizer.encode("\n\n".join(EVAL))
    out = {"fp32": perplexity(base, ids)}
    for tag, method, kw in [("rtn", "rtn", {}), ("rtn-sym", "rtn", {"sym": True}),
                            ("gptq", "gptq", {})]:  # defaults: asymmetric; GPTQ act-order + scale search
        r = quantize_model(hf_export_dir, root / tag, method, **kw)
        out[tag] = perplexity(load_model(r.path, "auto"), ids)
    return out


@pytest.mark.slow  # ~2 min (GPTQ over all 30 layers): `make test-slow`, outside CI's 20-minute budget
def test_perplexity_gptq_within_10_percent_and_better_than_rtn(ppl):
    """On the ~1600-token held-out EVAL (fp32 reference = the GGUF exported dense): the default GPTQ
    (act-order, asymmetric, Hessian-weighted scale search, g64) is within +10% of fp32 and better than
    rounding. Numbers: BENCHMARKS.md, Quantization."""
    assert ppl["gptq"] < ppl["rtn"] < ppl["rtn-sym"], ppl
    assert ppl["gptq"] < 1.10 * ppl["fp32"], ppl


# ---- Gemma: the quantizer runs the model's own forward (embedding scale, GeGLU, sandwich norms) ----
def gemma2_from_smollm2(gguf_path: Path, fp32_model, out: Path) -> Path:
    """A Gemma 2 checkpoint written by transformers, carrying SmolLM2-135M's trained weights: a
    tiny random Gemma's perplexity is near its vocabulary size, where any quantizer passes (and
    dropping SmolLM2's layers is as degenerate: 4 of 30 kept give ~6e7). Mapped to compute nearly
    what SmolLM2 does, so quantization matters as on a trained model (fp32 perplexity 125 on EVAL,
    RTN +14%): embeddings divided by Gemma's sqrt(hidden) = 24 (a quantizer that drops the scale
    sees a first input 24x too small) and the final norm times it (the tied head); norms stored
    as Gemma's w for (1 + w); GeGLU for SiLU*up with gate / 1.702 and up * 1.702 (gelu(x) ~
    x·σ(1.702x)); the sandwich norms on attention and MLP outputs scaled to each one's median RMS
    in SmolLM2 on calibration text; Gemma 2's published soft-caps (50, 30) and sliding windows of
    128 on every other layer (they bite in 256-token calibration and 512-token EVAL windows)."""
    import transformers

    from localllm.model.weights import open_weights
    from localllm.quant.quantize import calibration_ids

    w = open_weights(gguf_path)
    c = w.config
    H, L = c.hidden_size, c.num_layers
    rms = {}  # (layer, "o" | "down") -> the median over tokens of the output's RMS (the mean is
    # swayed by the first tokens' massive activations: fp32 perplexity 510 instead of 125)
    hooks = [getattr(layer, m).register_forward_hook(
        lambda _m, _a, y, k=(i, m): rms.__setitem__(k, y.pow(2).mean(-1).sqrt().median().item()))
        for i, layer in enumerate(fp32_model.model.layers) for m in ("o", "down")]
    try:
        make_engine(fp32_model).score(calibration_ids(fp32_model.tokenizer, None, 1, 256)[0].tolist())
    finally:
        for h in hooks:
            h.remove()
    tok = fp32_model.tokenizer
    cfg = transformers.Gemma2Config(
        vocab_size=c.vocab_size, hidden_size=H, intermediate_size=c.intermediate_size, num_hidden_layers=L,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        query_pre_attn_scalar=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=1024, hidden_activation="gelu_pytorch_tanh", sliding_window=128,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    scale = torch.tensor(H ** 0.5).item()  # exactly 24 in fp32
    state = {"model.embed_tokens.weight": w.dense("model.embed_tokens.weight") / scale,
             "model.norm.weight": w.dense("model.norm.weight") * scale - 1}
    for i in range(L):
        p = f"model.layers.{i}."
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj"):
            state[p + m + ".weight"] = w.dense(p + m + ".weight")
        state[p + "mlp.gate_proj.weight"] = w.dense(p + "mlp.gate_proj.weight") / 1.702
        state[p + "mlp.up_proj.weight"] = w.dense(p + "mlp.up_proj.weight") * 1.702
        state[p + "input_layernorm.weight"] = w.dense(p + "input_layernorm.weight") - 1
        state[p + "pre_feedforward_layernorm.weight"] = w.dense(p + "post_attention_layernorm.weight") - 1
        state[p + "post_attention_layernorm.weight"] = torch.full((H,), rms[(i, "o")] - 1)
        state[p + "post_feedforward_layernorm.weight"] = torch.full((H,), rms[(i, "down")] - 1)
    model = transformers.Gemma2ForCausalLM(cfg)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected, (missing, unexpected)  # tied
    model.tie_weights()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_hf(out)
    return out


@pytest.fixture(scope="module")
def gemma_ppl(gguf_path, fp32_model, tmp_path_factory):
    from localllm.model.loader import load_model
    from localllm.quant.quantize import perplexity, quantize_model

    root = tmp_path_factory.mktemp("gemma-ppl")
    src = gemma2_from_smollm2(gguf_path, fp32_model, root / "hf")
    base = load_model(src, "float32")
    ids = base.tokenizer.encode("\n\n".join(EVAL))
    out = {"fp32": perplexity(base, ids)}
    for method in ("rtn", "gptq"):  # the defaults, as in the Llama test above
        out[method] = perplexity(load_model(quantize_model(src, root / method, method).path, "auto"), ids)
    return out


@pytest.mark.slow  # ~3 min on one core (GPTQ over 30 layers): `make test-slow`, as the Llama one above
def test_perplexity_gemma_gptq_within_10_percent_and_better_than_rtn(gemma_ppl):
    """The Llama test's margin and text on a Gemma 2 checkpoint (SmolLM2's weights in Gemma's
    layers, see gemma2_from_smollm2), quantized through the model's own forward. Measured (one
    core): fp32 125.3, RTN 142.8 (+14.0%), GPTQ 136.6 (+9.1%); main's quantizer, whose
    calibration dropped the embedding scale, gave GPTQ 163.7 (+30.7%, worse than rounding).
    AWQ is not asserted (as in the Llama test): here it gives 144.6 (+15.5%, above RTN), open."""
    p = gemma_ppl
    assert p["gptq"] < p["rtn"], p
    assert p["gptq"] < 1.10 * p["fp32"], p


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_calibration_is_the_models_forward_on_gemma(name, fp32_model, tmp_path):
    """What GPTQ's Hessians and AWQ's searches are computed from, on a tiny Gemma written by
    transformers (windows of 12 crossed by 40-token sequences, soft-caps, sandwich norms, Gemma
    3's q/k norms and local RoPE): each layer's input residual stream in `Calibration` equals the
    one transformers' layers get (main's calibration dropped Gemma's embedding scale: every
    stream off by sqrt(hidden) = 8 here), and the MLP block AWQ judges gate/up candidates on
    (`DecoderLayer.mlp`, fed the input the quantizer captures for gate/up) equals transformers'
    Gemma MLP (GeGLU) on transformers' own MLP input."""
    from test_families import FAMILIES, peaked, write_hf

    from localllm.model.loader import load_model
    from localllm.quant.quantize import Calibration

    torch.manual_seed(0)
    ref = FAMILIES[name].make().eval()
    peaked(ref, seed=1)
    ref.tie_weights()
    model = load_model(write_hf(ref, tmp_path / name, fp32_model.tokenizer), "float32").model
    B, T = 2, 40
    ids = torch.randint(0, ref.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(0))
    want_in, want_mlp = [], []
    hooks = [lay.register_forward_pre_hook(lambda _m, a, kw: want_in.append((a or [kw["hidden_states"]])[0]),
                                           with_kwargs=True) for lay in ref.model.layers]
    hooks += [lay.mlp.register_forward_hook(lambda _m, a, y: want_mlp.append((a[0], y))) for lay in ref.model.layers]
    try:
        with torch.no_grad():
            ref(ids)
    finally:
        for h in hooks:
            h.remove()
    assert len(want_in) == len(want_mlp) == len(model.layers) == ref.config.num_hidden_layers

    def close(ours, theirs):
        torch.testing.assert_close(ours.reshape(theirs.shape), theirs, rtol=1e-4, atol=1e-4 * theirs.abs().max().item())

    calib = Calibration(model, ids)
    x, residual = calib.embed(), None
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            close(x if residual is None else x + residual, want_in[i])
            h = calib.run_to(layer, x, residual, layer.gate_up)
            close(h, want_mlp[i][0])
            close(layer.mlp(want_mlp[i][0].reshape(B * T, -1), model.ops), want_mlp[i][1])
            x, residual = calib.run(layer, x, residual)


def test_calibration_captures_every_row_of_a_long_batch(fp32_model):
    """The model's CPU ops run a chunk's MLP in row blocks of 256; the quantizer's hooks take a
    module's input from its first call, so its calibration runs the MLP on all rows at once: the
    gate/up and down inputs it judges on hold every token of a 600-row batch."""
    from localllm.quant.quantize import Calibration

    model = fp32_model.model
    assert model.ops.mlp_rows == 256
    ids = torch.randint(3, 1000, (2, 300), generator=torch.Generator().manual_seed(0))
    calib = Calibration(model, ids)
    layer = model.layers[0]
    with torch.no_grad():
        for module in (layer.gate_up, layer.down):
            assert calib.run_to(layer, calib.embed(), None, module).shape[0] == 600


# ---- int8 weight-only ---------------------------------------------------------------------------
def test_int8_follows_fp32(gguf_path, fp32_model):
    """--quant int8 (per-channel symmetric): teacher-forced on fp32's greedy continuation, the
    argmax agrees almost everywhere, and the answer starts the same."""
    from localllm.engine.sequence import Sequence
    from localllm.model.layers import Int8Linear
    from localllm.model.loader import load_model

    int8 = load_model(gguf_path, "int8")
    assert int8.precision.startswith("int8") and isinstance(int8.model.layers[0].qkv, Int8Linear)
    ref_eng, eng = make_engine(fp32_model), make_engine(int8)
    agree = total = 0
    for prompt in CHAT_PROMPTS:
        msgs = chat(prompt)
        *_, last = ref_eng.generate(msgs, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        ids, ref = eng.encode_prompt(msgs), last.token_ids
        full = ids + ref
        seq = Sequence("t", full, SamplingParams(), 1)
        eng.block_manager.allocate(seq, len(full))
        hidden = eng.runner.forward_hidden([seq], [len(full)])
        pred = int8.model.logits(hidden[len(ids) - 1:-1]).argmax(-1)
        agree += (pred == torch.tensor(ref)).sum().item()
        total += len(ref)
        eng.block_manager.free_seq(seq)
    assert agree / total >= 0.9, f"{agree}/{total}"
    *_, a = eng.generate(chat(CHAT_PROMPTS[0]), SamplingParams(temperature=0, max_tokens=6))
    *_, b = ref_eng.generate(chat(CHAT_PROMPTS[0]), SamplingParams(temperature=0, max_tokens=6))
    assert a.token_ids[:3] == b.token_ids[:3]


def test_cli_quantize_and_run_int8(small_src, tmp_path):
    from typer.testing import CliRunner

    from localllm.cli import app

    r = CliRunner().invoke(app, ["quantize", str(small_src), "--method", "rtn", "-o", str(tmp_path / "rtn")])
    assert r.exit_code == 0, r.output
    assert "wrote" in r.output and "group 64" in r.output
    r = CliRunner().invoke(app, ["quantize", str(small_src), "--method", "awq", "--group-size", "128", "-o",
                                 str(tmp_path / "x")])
    assert r.exit_code == 2 and "use --group-size 64" in r.output
    r = CliRunner().invoke(app, ["run", str(small_src), "--quant", "int8", "--temperature", "0", "-n", "3", "Hi"])
    assert r.exit_code == 0, r.output
