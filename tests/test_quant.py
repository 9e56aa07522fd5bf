"""Our quantizer (RTN / GPTQ / AWQ) end to end: standard checkpoints that load back bit-exactly,
GPTQ's algorithm beats rounding on real activations, perplexity, and weight-only int8."""

import json

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
    for tag, method, kw in [("rtn", "rtn", {}), ("gptq", "gptq", {}), ("gptq-act", "gptq", {"act_order": True}),
                            ("gptq-asym", "gptq", {"sym": False}), ("awq", "awq", {})]:
        out[tag] = quantize_model(small_src, root / tag, method, num_samples=2, keep_dequantized=True, **kw)
    return out


@pytest.mark.parametrize("tag", ["rtn", "gptq", "gptq-act", "gptq-asym", "awq"])
def test_checkpoint_loads_back_bit_exactly(quantized, tag):
    from localllm.model.loader import open_weights

    r = quantized[tag]
    assert r.group_size == 64  # 576 = 9 * 64: the largest of 128/64/32 that divides every K
    w = open_weights(r.path)
    assert len(r.dequantized) == 2 * 7
    for name, want in r.dequantized.items():
        w4 = w.int4(name)
        assert w4 is not None and w4.group_size == 64
        assert torch.equal(w4.dequantize_logical(), want), name
        assert torch.equal(w.dense(name), want), name
        assert (w4.in_perm is not None) == (tag == "gptq-act")


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
    p = quantized["gptq-act"].path
    qc = json.loads((p / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["desc_act"], qc["sym"], qc["checkpoint_format"]) == \
        ("gptq", 4, 64, True, True, "gptq")
    assert json.loads((p / "quantize_config.json").read_text())["desc_act"] is True
    with safe_open(str(p / "model.safetensors"), "pt") as f:
        pre = "model.layers.1.mlp.down_proj."
        assert tuple(f.get_tensor(pre + "qweight").shape) == (INTER // 8, HIDDEN)  # [in/8, out]
        assert tuple(f.get_tensor(pre + "qzeros").shape) == (INTER // 64, HIDDEN // 8)
        g_idx = f.get_tensor(pre + "g_idx")
        assert g_idx.dtype == torch.int32 and g_idx.shape == (INTER,)
        assert bool((g_idx[1:] < g_idx[:-1]).any())  # act-order: not monotonic
        assert torch.equal(torch.bincount(g_idx.long()), torch.full((INTER // 64,), 64))
        # sym v1: every stored zero is 8 - 1
        z = f.get_tensor(pre + "qzeros")
        assert bool((z == 0x77777777).all())


def test_quantized_checkpoints_generate(quantized):
    """The act-order checkpoint runs through the engine (input permutation) like the plain one."""
    from localllm.model.loader import load_model

    outs = []
    for tag in ("gptq", "gptq-act"):
        loaded = load_model(quantized[tag].path, "auto")
        assert "int4" in loaded.precision
        *_, last = make_engine(loaded).generate(chat(CHAT_PROMPTS[0]), SamplingParams(temperature=0, max_tokens=4))
        outs.append(last.token_ids)
    assert all(len(o) >= 1 for o in outs)


def test_gptq_beats_rtn_on_the_layer_output(small_src):
    """On real activations (layer 0's normed inputs), GPTQ's output error ||X (W - Q)^T|| is well
    below round-to-nearest's on the same group/sym settings."""
    from localllm.model.loader import open_weights
    from localllm.quant.quantize import RefModel, _hessian, _rms, calibration_ids, gptq, rtn

    w = open_weights(small_src)
    ref = RefModel(w, w.config)
    ids = calibration_ids(w.tokenizer(), None, 8, 256)
    x = _rms(ref.embed[ids], ref.layers[0]["in_norm"], w.config.rms_norm_eps).reshape(-1, HIDDEN)
    W = ref.layers[0]["q"]
    H = _hessian(x)
    for sym in (True, False):
        e_rtn = (x @ (W - rtn(W, 64, sym, True).dequantize()).t()).pow(2).mean()
        e_gptq = (x @ (W - gptq(W, H, 64, sym).dequantize()).t()).pow(2).mean()
        e_act = (x @ (W - gptq(W, H, 64, sym, act_order=True).dequantize()).t()).pow(2).mean()
        assert e_gptq < 0.8 * e_rtn and e_act < 0.8 * e_rtn, (sym, e_rtn, e_gptq, e_act)


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


# ---- perplexity on the full 30-layer model (GPTQ ~40 s on 2 cores). AWQ's full-model perplexity
# is in BENCHMARKS.md only: its search takes minutes on 2 CPU cores, too long for CI. ----
@pytest.fixture(scope="module")
def ppl(hf_export_dir, tmp_path_factory):
    from localllm.model.loader import load_model
    from localllm.quant.quantize import perplexity, quantize_model

    root = tmp_path_factory.mktemp("ppl")
    base = load_model(hf_export_dir, "float32")
    ids = base.tokenizer.encode("\n\n".join(EVAL))
    out = {"fp32": perplexity(base, ids)}
    for tag, method, kw in [("rtn", "rtn", {"sym": False}), ("rtn-sym", "rtn", {}),
                            ("gptq", "gptq", {"act_order": True})]:
        r = quantize_model(hf_export_dir, root / tag, method, **kw)
        out[tag] = perplexity(load_model(r.path, "auto"), ids)
    return out


def test_perplexity_gptq_better_than_rtn(ppl):
    """Measured: fp32 22.8, RTN asym 29.4, RTN sym 33.8, GPTQ act-order ~26 (+14%: the +10% goal
    is not met on this 135M model at 4 bits, g64 - see BENCHMARKS.md)."""
    assert ppl["gptq"] < ppl["rtn"] < ppl["rtn-sym"], ppl
    assert ppl["gptq"] < 1.2 * ppl["fp32"], ppl


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
