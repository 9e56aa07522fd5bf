"""gpt-oss GGUFs (llama.cpp's arch "gpt-oss") against transformers' GptOssForCausalLM (fp32, eager
attention) on a tiny random checkpoint written under llama.cpp's names and layout: attention
sinks, biases on every linear and the router, a sliding window on the even layers, YaRN RoPE,
the router's softmax over its top k, the experts' clamped SwiGLU; MXFP4 experts (the type the
published files hold) against transformers on the file's own dequantized values; the o200k
pre-tokenizer and harmony's end-of-generation tokens."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_engine
from test_families import PROMPT, batch_with_prefix_hits, gguf_tensors, hf_greedy, write_gguf

from localllm.model.loader import load_model
from localllm.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

WINDOW = 8  # the 16-token prompt and the generated tokens cross it
CONFIG = dict(vocab_size=49152, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
              max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
              rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})


def peaked_gpt_oss(model: torch.nn.Module, seed: int) -> None:
    """Random weights with peaked logits (as test_families.peaked): norms near 1, sinks on both sides of
    the scores, small biases, the experts' [E, in, out] stacks scaled by their input width."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g) * 2)
            elif "bias" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() == 3:  # experts: x @ W[e], W[e] [in, out]
                p.copy_(torch.randn(p.shape, generator=g) * 2 / p.shape[1] ** 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 2 / p.shape[1] ** 0.5)


def gpt_oss_gguf(model, out: Path, tokenizer_gguf: Path, qtype_of=None) -> Path:
    """The model as llama.cpp's converter writes gpt-oss: experts split from transformers' interleaved
    gate_up [E, H, 2I] (gate the even columns) into ffn_gate_exps / ffn_up_exps [E, I, H] and their
    biases, ffn_down_exps [E, H, I], the router as ffn_gate_inp (+ bias), sinks as attn_sinks, the
    norm before the MLP as post_attention_norm; yarn and the window as metadata."""

    cfg = model.config
    state = model.state_dict()
    special = {n: state.pop(n) for n in list(state) if ".mlp." in n or n.endswith(".sinks")
               or n.endswith("post_attention_layernorm.weight")}

    def tensors():
        yield from gguf_tensors(model, state)
        for name, t in special.items():
            i, a = name.split(".")[2], t.float().numpy()
            blk = f"blk.{i}."
            if name.endswith(".sinks"):
                yield blk + "attn_sinks.weight", a
            elif name.endswith("post_attention_layernorm.weight"):
                yield blk + "post_attention_norm.weight", a
            elif ".router." in name:
                yield blk + "ffn_gate_inp." + name.rsplit(".", 1)[1], a
            elif name.endswith("gate_up_proj"):
                yield blk + "ffn_gate_exps.weight", np.ascontiguousarray(a[:, :, 0::2].transpose(0, 2, 1))
                yield blk + "ffn_up_exps.weight", np.ascontiguousarray(a[:, :, 1::2].transpose(0, 2, 1))
            elif name.endswith("gate_up_proj_bias"):
                yield blk + "ffn_gate_exps.bias", np.ascontiguousarray(a[:, 0::2])
                yield blk + "ffn_up_exps.bias", np.ascontiguousarray(a[:, 1::2])
            elif name.endswith("down_proj"):
                yield blk + "ffn_down_exps.weight", np.ascontiguousarray(a.transpose(0, 2, 1))
            elif name.endswith("down_proj_bias"):
                yield blk + "ffn_down_exps.bias", a
            else:
                raise AssertionError(name)

    rope = cfg.rope_parameters
    kv = {"gpt-oss.expert_count": cfg.num_local_experts, "gpt-oss.expert_used_count": cfg.num_experts_per_tok,
          "gpt-oss.expert_feed_forward_length": cfg.intermediate_size, "gpt-oss.attention.sliding_window": WINDOW,
          "gpt-oss.rope.scaling.type": "yarn", "gpt-oss.rope.scaling.factor": float(rope["factor"]),
          "gpt-oss.rope.scaling.original_context_length": rope["original_max_position_embeddings"]}
    return write_gguf(model, "gpt-oss", out, tokenizer_gguf, tensors=tensors(), extra_kv=kv,
                      qtype_of=qtype_of or (lambda name, a: None))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory, gguf_path):
    """(transformers model, its F32 GGUF)."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG, attn_implementation="eager")).eval()
    peaked_gpt_oss(model, seed=1)
    out = tmp_path_factory.mktemp("gpt-oss")
    return model, gpt_oss_gguf(model, out / "gpt-oss.gguf", gguf_path)


def test_config_from_the_file(gpt_oss):
    from localllm.model.weights import open_weights

    cfg = open_weights(gpt_oss[1]).config
    assert cfg.architecture == "GptOssForCausalLM" and cfg.attn_sinks and cfg.expert_act == "swiglu_oai"
    assert cfg.layer_windows == (WINDOW, None, WINDOW, None)  # transformers' layer_types
    assert gpt_oss[0].config.layer_types[:2] == ["sliding_attention", "full_attention"]
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.router_gating) == (4, 2, "topk_softmax")


def test_logits_match_transformers(gpt_oss):
    """Every position's logits of a 16-token prompt (prefill through our paged kernel with sinks and
    the window) against transformers' eager attention, which adds the sinks to its softmax."""
    ref_model, path = gpt_oss
    loaded = load_model(path, "float32")
    ours = make_engine(loaded).score(PROMPT)
    with torch.no_grad():
        ref = ref_model(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_sinks_and_router_change_the_answer(gpt_oss):
    """The test sees the features: zeroing the sinks (or the router biases) moves the logits."""
    ref_model, path = gpt_oss
    loaded = load_model(path, "float32")
    base = make_engine(loaded).score(PROMPT)
    for layer in loaded.model.layers:
        layer.sinks.fill_(-1e4)  # no weight left to the sinks: plain attention
    assert (make_engine(loaded).score(PROMPT) - base).abs().max() > 0.1


def test_greedy_decode_and_batches_equal_transformers(gpt_oss):
    """Decode token by token over the paged cache (the window crossed), and a batch of three where two
    share a prefix from the cache, prompts prefilled in 8-token chunks: transformers' greedy tokens."""
    ref_model, path = gpt_oss
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    *_, last = make_engine(load_model(path, "float32")).generate(list(PROMPT), params)
    assert last.token_ids == hf_greedy(ref_model, PROMPT, 24)
    eng = make_engine(load_model(path, "float32"), max_num_batched_tokens=8, block_size=16)
    first, replies = batch_with_prefix_hits(eng, params)
    assert eng.cache_stats()["cached_tokens"] >= 32 and first == replies[0][1]
    for prompt, tokens in replies:
        assert tokens == hf_greedy(ref_model, prompt, 24)


def test_mxfp4_experts_run_on_the_files_values(gpt_oss, tmp_path, gguf_path):
    """The published files' layout: MXFP4 experts, Q8_0 matrices, F32 biases, norms, sinks and router.
    Loaded by default (our int8-lane kernel for MXFP4 and Q8_0; the experts stacked for moe_int8w with
    their biases and clamped SwiGLU): greedy tokens equal transformers' fp32 on the file's dequantized
    values, and the stacked op's logits are the looped experts' bit for bit."""
    import gguf

    from localllm.model.moe import Int8wExperts, LoopExperts
    from localllm.model.weights import open_weights

    ref_model, _ = gpt_oss

    def qtype_of(name, a):
        if "_exps.weight" in name:
            return gguf.GGMLQuantizationType.MXFP4
        if a.ndim == 2 and "ffn_gate_inp" not in name and not name.endswith(".bias"):
            return gguf.GGMLQuantizationType.Q8_0
        return None

    path = gpt_oss_gguf(ref_model, tmp_path / "mxfp4.gguf", gguf_path, qtype_of)
    loaded = load_model(path, "auto")
    assert "MXFP4/Q8_0 weights as stored" in loaded.precision
    assert isinstance(loaded.model.layers[0].moe.experts, Int8wExperts)
    # transformers on the file's values: every tensor dequantized back into its place
    weights = open_weights(path)
    ref = transformers.GptOssForCausalLM(ref_model.config).eval()
    ref.load_state_dict(ref_model.state_dict())
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            ex = layer.mlp.experts
            for part in ("gate", "up", "down"):
                t = weights.file.tensors[f"blk.{i}.ffn_{part}_exps.weight"]
                w = torch.from_numpy(gguf.quants.dequantize(t.data, gguf.GGMLQuantizationType.MXFP4).reshape(t.shape))
                if part == "down":
                    ex.down_proj.copy_(w.transpose(1, 2))
                else:
                    start = 0 if part == "gate" else 1
                    ex.gate_up_proj[:, :, start::2].copy_(w.transpose(1, 2))
            att = layer.self_attn
            for name, lin in (("attn_q", att.q_proj), ("attn_k", att.k_proj), ("attn_v", att.v_proj),
                              ("attn_output", att.o_proj)):
                lin.weight.copy_(weights.dense(_hf_name(i, name)))
        ref.model.embed_tokens.weight.copy_(weights.dense("model.embed_tokens.weight"))
        ref.lm_head.weight.copy_(weights.dense("lm_head.weight"))
    # our kernels take 16-bit activations (two int8 parts a value): teacher-forced on transformers'
    # greedy continuation, the argmax may differ only where transformers' top two nearly tie
    want = hf_greedy(ref, PROMPT, 32)
    ours, theirs = teacher_forced(make_engine(loaded), ref, want)
    assert (ours - theirs).abs().max() < 0.02 * theirs.abs().max()
    *_, last = make_engine(loaded).generate(list(PROMPT), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert last.token_ids == want[:8]
    for layer in loaded.model.layers:  # the same experts looped: the same logits, bit for bit
        ex = layer.moe.experts
        layer.moe.experts = LoopExperts(*zip(*[_expert_linears(ex, e) for e in range(ex.w1.shape[0])]))
    assert torch.equal(make_engine(loaded).score(PROMPT + want), make_engine(load_model(path, "auto")).score(PROMPT + want))


def teacher_forced(eng, ref, want: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Our and transformers' logits at each step of transformers' greedy continuation `want` of PROMPT;
    checks our argmax is its token but for at most 2 steps where its top two nearly tie (< 0.05)."""
    ours = eng.score(PROMPT + want)[len(PROMPT) - 1:-1]
    with torch.no_grad():
        theirs = ref(torch.tensor([PROMPT + want])).logits[0, len(PROMPT) - 1:-1].float()
    flips = (ours.argmax(-1) != torch.tensor(want)).nonzero().flatten().tolist()
    top2 = theirs.topk(2, dim=-1).values
    gaps = [(top2[i, 0] - top2[i, 1]).item() for i in flips]
    assert len(flips) <= 2 and all(gap < 0.05 for gap in gaps), (flips, gaps)
    return ours, theirs


def _expert_linears(ex, e: int):
    """Expert e of stacked Int8wExperts as the two Int8wLinears it was stacked from."""
    from localllm.model.layers import Int8wLinear

    gate_up = Int8wLinear(ex.w1[e], ex.s1[e], 2 * ex.inter, ex.group1, ex.zero1, ex.b1[e])
    down = Int8wLinear(ex.w2[e], ex.s2[e], ex.b2.shape[1], ex.group2, ex.zero2, ex.b2[e])
    return gate_up, down


def _hf_name(i: int, gguf_name: str) -> str:
    proj = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}[gguf_name]
    return f"model.layers.{i}.self_attn.{proj}.weight"


def test_triton_backend_matches_transformers(gpt_oss):
    """The same model on the Triton kernels (here in Triton's interpreter; natively on CUDA): sinks in
    the prefill and the split decode kernels, the window on the even layers."""
    ref_model, path = gpt_oss
    loaded = load_model(path, "float32")
    loaded.model.use_attention("triton")
    eng = make_engine(loaded)
    with torch.no_grad():
        ref = ref_model(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(eng.score(PROMPT), ref, atol=2e-4, rtol=1e-4)
    *_, last = eng.generate(list(PROMPT), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert last.token_ids == hf_greedy(ref_model, PROMPT, 12)


# ---- Hugging Face checkpoints: transformers' own layout and the published MXFP4 one ----------

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, K] -> the published checkpoints' (blocks uint8 [..., rows, K / 32, 16], scales uint8
    [..., rows, K / 32]): per 32 values an E8M0 scale 2^(s - 127) putting the largest at most 6, each
    value its nearest E2M1 code; byte j holds values 2j (low nibble) and 2j + 1."""
    *pre, k = w.shape
    b = w.reshape(*pre, k // 32, 32)
    e = torch.ceil(torch.log2(b.abs().amax(-1).clamp(min=1e-30) / 6)).clamp(-127, 127)
    codes = (b / torch.exp2(e).unsqueeze(-1)).unsqueeze(-1).sub(FP4).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (e + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def gpt_oss_hf(gpt_oss, tmp_path_factory, fp32_model):
    """Directories of the model as transformers writes it in fp32 ("fp32") and in bf16 ("bf16": the
    fine-tunes' layout, experts fused [E, in, out], gate and up interleaved), and as openai/gpt-oss-*
    are published ("mxfp4": the bf16 one with the experts as MXFP4 blocks and scales, quant_method
    mxfp4)."""
    import json

    from safetensors.torch import load_file, save_file
    from test_families import write_hf

    ref_model, _ = gpt_oss
    out = tmp_path_factory.mktemp("gpt-oss-hf")
    dirs = {"fp32": write_hf(ref_model, out / "fp32", fp32_model.tokenizer)}
    bf16 = transformers.GptOssForCausalLM(ref_model.config).eval()
    bf16.load_state_dict(ref_model.state_dict())
    dirs["bf16"] = write_hf(bf16.to(torch.bfloat16), out / "bf16", fp32_model.tokenizer)
    dirs["mxfp4"] = mx = write_hf(bf16, out / "mxfp4", fp32_model.tokenizer)
    state = load_file(mx / "model.safetensors")
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        state[name + "_blocks"], state[name + "_scales"] = mxfp4_blocks(state.pop(name).float().transpose(1, 2))
    save_file(state, mx / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((mx / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (mx / "config.json").write_text(json.dumps(cfg))
    return dirs


def test_hf_checkpoint_matches_transformers(gpt_oss, gpt_oss_hf):
    """transformers' own fp32 checkpoint of the model (router, sinks and fused experts under its names):
    the same config as the GGUF's, every position's logits to 2e-4, greedy tokens equal."""
    from localllm.model.weights import open_weights

    ref_model, path = gpt_oss
    ours, gguf = (dataclasses.asdict(open_weights(p).config) for p in (gpt_oss_hf["fp32"], path))
    rope = ours.pop("rope_scaling")  # (HF's keeps rope_theta in it too; the GGUF's eps is an fp32)
    assert all(rope[k] == v for k, v in gguf.pop("rope_scaling").items())
    assert ours.pop("rms_norm_eps") == pytest.approx(gguf.pop("rms_norm_eps")) and ours == gguf
    loaded = load_model(gpt_oss_hf["fp32"], "auto")
    with torch.no_grad():
        ref = ref_model(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(make_engine(loaded).score(PROMPT), ref, atol=2e-4, rtol=1e-4)
    *_, last = make_engine(loaded).generate(list(PROMPT), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert last.token_ids == hf_greedy(ref_model, PROMPT, 16)


def _reference(path, **kw):
    """transformers' fp32 model of a checkpoint directory (an MXFP4 one dequantized by its own reader:
    E2M1 times a power of two is exact in bf16, so in fp32 too)."""
    return transformers.GptOssForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32,
                                                          **kw).eval()


def test_bf16_checkpoint_keeps_its_weights_in_16_bits(gpt_oss_hf):
    """A bf16 checkpoint by default: every matrix on our 16-bit kernel as stored (the experts sliced
    out of their fused stacks), fp32 math: transformers' fp32 on the same values, logits to fp32
    summation-order error, greedy tokens equal; with the default 16-bit KV cache, flips at near ties."""
    from localllm.model.layers import W16Linear

    loaded = load_model(gpt_oss_hf["bf16"], "auto")
    assert loaded.precision.startswith("16-bit weights (bf16")
    assert all(isinstance(m, W16Linear) for m in loaded.model.layers[0].moe.experts.gate_up)
    ref = _reference(gpt_oss_hf["bf16"])
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    # on an fp32 KV cache: the default 16-bit one moves these peaked logits by up to 0.1 (a greedy
    # token at a 0.005 tie flips), as it does for every 16-bit and quantized model
    exact = make_engine(loaded, kv_type="f32")
    torch.testing.assert_close(exact.score(PROMPT), want, atol=2e-4, rtol=1e-4)
    *_, last = exact.generate(list(PROMPT), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert last.token_ids == hf_greedy(ref, PROMPT, 16)
    teacher_forced(make_engine(loaded), ref, last.token_ids)


def test_published_mxfp4_checkpoint_runs_on_its_blocks(gpt_oss_hf):
    """openai/gpt-oss-*'s layout: read by default without a dequantized copy, each expert matrix's
    blocks repacked as the checkpoint keeps them for our int8-lane kernel (their values bit-equal to
    transformers' own MXFP4 reader's), stacked for moe_int8w with their biases; attention, embedding and head bf16 as
    stored. Exact math ("float32") matches transformers on the checkpoint to 2e-4; the default (16-bit
    activations into the kernels) gives its greedy tokens, flips only where its top two nearly tie.
    The second load takes the experts from the conversion cache: the same logits."""
    from test_model_memory import planner_matches_held
    from test_moe import assert_stacks_are_one_by_ones
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from localllm.model.layers import W16Linear, W16Matrix
    from localllm.model.moe import Int8wExperts
    from localllm.model.weights import open_weights

    mx = gpt_oss_hf["mxfp4"]
    ref = _reference(mx, quantization_config=transformers.Mxfp4Config(dequantize=True))
    weights = open_weights(mx)
    for i, layer in enumerate(ref.model.layers):
        ex = layer.mlp.experts
        assert torch.equal(ex.down_proj, convert_moe_packed_tensors(
            *(weights.dense(f"model.layers.{i}.mlp.experts.down_proj_{s}") for s in ("blocks", "scales")),
            dtype=torch.float32))  # (transformers' reader: its dequantizer)
        for e in range(ex.num_experts):
            gate, up, down = (weights.blocks(f"model.layers.{i}.mlp.experts.{e}.{part}_proj.weight").values().t()
                              for part in ("gate", "up", "down"))
            assert torch.equal(gate, ex.gate_up_proj[e][:, 0::2]) and torch.equal(up, ex.gate_up_proj[e][:, 1::2])
            assert torch.equal(down, ex.down_proj[e])

    with torch.no_grad():
        want_logits = ref(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(make_engine(load_model(mx, "float32")).score(PROMPT), want_logits, atol=2e-4, rtol=1e-4)

    loaded = load_model(mx, "auto")
    assert loaded.precision.startswith("BF16/MXFP4 weights as stored (our int8-lane/16-bit kernels")
    layer = loaded.model.layers[0]
    assert isinstance(layer.moe.experts, Int8wExperts) and layer.moe.experts.b1 is not None
    assert isinstance(layer.qkv, W16Linear) and isinstance(loaded.model.embed, W16Matrix)
    planner_matches_held(loaded, mx)
    assert_stacks_are_one_by_ones(loaded, mx)  # each layer's experts repacked at once, as one by one
    want = hf_greedy(ref, PROMPT, 32)
    teacher_forced(make_engine(loaded), ref, want)
    from localllm.model.convert_cache import ConvertCache
    from localllm.paths import cache_home

    ConvertCache.wait_written()
    assert list((cache_home() / "converted").glob("mxfp4-*.safetensors"))
    again = load_model(mx, "auto")
    assert torch.equal(make_engine(again).score(PROMPT + want), make_engine(loaded).score(PROMPT + want))


def test_the_registry_name_pulls_the_published_layout_and_answers_as_from_disk(gpt_oss_hf, tmp_path):
    """`localllm pull gpt-oss:20b`, then `localllm run gpt-oss:20b "..."` (and by its repo id) as a
    user types them, against a loopback hub holding the published layout under openai/gpt-oss-20b
    with its second checkpoint under original/: the pull takes the top-level files only, `list`
    shows the MXFP4 form, and the answer is the one `localllm run DIR` gives on the same files.
    (Before the download the run is planned from the published config: test_planner.)"""
    import os
    import shutil
    import subprocess
    import sys

    from hub_mirror import HubMirror, make_repo

    repo = shutil.copytree(gpt_oss_hf["mxfp4"], tmp_path / "repo")
    (repo / "original").mkdir()
    (repo / "original" / "model.safetensors").write_bytes(b"\0" * 4096)  # (13 GB in the real repo)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}

    def cli(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "localllm.cli", *args], env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def run(model: str) -> str:
        return cli("run", model, "Hello", "-n", "6", "--temperature", "0")

    with HubMirror({"openai/gpt-oss-20b": make_repo(repo)}) as hub:
        env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=hub.url, HF_HUB_DISABLE_TELEMETRY="1")
        cli("pull", "gpt-oss:20b")
        fetched = [p for _, p, _ in hub.gets()]
    assert fetched and not any("original" in p for p in fetched)
    assert any(p.endswith("model.safetensors") for p in fetched)
    listed = [line.split() for line in cli("list").splitlines() if line.startswith("gpt-oss-20b ")]
    assert [row[1:] for row in listed if "downloaded" in row][0][0] == "mxfp4"
    pulled = run("gpt-oss:20b")
    assert pulled.strip() and pulled == run("openai/gpt-oss-20b") == run(str(gpt_oss_hf["mxfp4"]))


def test_the_registry_plan_is_the_checkpoints(gpt_oss_hf):
    """What the planner counts for a gpt-oss checkpoint from its config.json alone (a registry
    entry before its download) is what it counts from the files (which test_published_mxfp4_...
    holds to what the loader holds)."""
    import json

    from localllm.planner import config_facts, facts_for_path

    mx = gpt_oss_hf["mxfp4"]
    before, after = config_facts("m", json.loads((mx / "config.json").read_text())), facts_for_path(mx)
    assert (before.params, before.native, before.native_bytes) == (after.params, after.native, after.native_bytes)
