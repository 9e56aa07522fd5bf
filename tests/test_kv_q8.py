"""The 8-bit KV cache (--kv-type q8_0, llama.cpp's -ctk/-ctv q8_0): the block format against gguf-py's
Q8_0 quantizer (llama.cpp's reference) bit for bit, every writer (torch, the fused C++ rope_store
on each instruction-set path) producing those bytes, the C++ attention kernel against SDPA on the
dequantized K/V, the real model's greedy tokens against its fp32 cache (agreement counted), the
engine's sizing, the planner's figures and the CLI's choices."""

import numpy as np
import pytest
import torch
from conftest import make_engine
from gguf import GGMLQuantizationType, quants
from test_cli_run import run
from test_cpu_attention import make_batch
from test_cpu_fused import isa  # noqa: F401  (the fixture: each instruction-set path of the fused ops)
from test_engine import run_all

from localllm.cli import print_plan
from localllm.config import EngineConfig
from localllm.model.attention import AttnMeta, describe_batch, torch_attention
from localllm.model.layers import RotaryEmbedding
from localllm.planner import DeviceFacts, ModelFacts, kv_bytes, plan
from localllm.sampling import SamplingParams
from localllm_kernels import cpu_attention, kv_quant


def hard_rows(n: int = 64, D: int = 64, seed: int = 0) -> torch.Tensor:
    """Rows [n, D] with the cases a quantizer gets wrong: exact halves (x * (1/d) = k + 0.5, which
    roundf takes away from zero and torch.round to even), an all-zero block, one-value blocks,
    negative maxima, tiny and large scales."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g) * torch.logspace(-4, 3, n).unsqueeze(1)
    x[0, :32] = 0
    x[1, :32] = torch.arange(32) - 15.5  # amax 15.5
    x[2, :32] = torch.tensor([127.0] + [k + 0.5 for k in range(-16, 15)])  # d = 1: every other value a half
    x[3, :32] = -torch.tensor([127.0] + [k + 0.5 for k in range(-16, 15)])
    x[4, 32:] = 0
    x[4, 40] = -3.0
    return x


def test_quantize_equals_gguf_q8_0_bit_for_bit():
    x = hard_rows()
    got = kv_quant.quantize(x)
    assert got.dtype == torch.uint8 and got.shape == (64, kv_quant.row_bytes(64)) == (64, 68)
    want = quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0)
    assert np.array_equal(got.numpy(), want)
    back = kv_quant.dequantize(got)
    assert np.array_equal(back.numpy(), quants.dequantize(want, GGMLQuantizationType.Q8_0))
    assert torch.equal(kv_quant.quantize(back), got)  # the dequantized values are fixed points
    # half a step d / 2, plus the fp16 rounding of d (relative 2^-11 where d is a normal fp16) times |q| <= 127
    err, amax = ((t.abs().view(64, 2, 32).amax(-1)) for t in (back - x, x))
    normal = amax / 127 >= 2 ** -14
    assert normal.sum() > 64 and (err <= amax * (0.5 / 127 + 2 ** -11) * 1.001)[normal].all()


def test_odd_head_dims_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        kv_quant.row_bytes(48)


def test_rope_store_writes_the_same_q8_0_bytes(isa):  # noqa: F811
    """The fused C++ write (RoPE, quantize) on each path equals torch's RoPE then kv_quant.quantize."""
    T, H, KVH, D = 7, 6, 2, 64
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g) * 4
    pos = torch.tensor([0, 5, 6, 7, 8, 30, 31])
    slots = torch.tensor([17, 18, 19, 40, 2, 63, 0])
    rope = RotaryEmbedding(D, 64, 10000.0, None, torch.float32)
    kc = torch.zeros(4, 16, KVH, kv_quant.row_bytes(D), dtype=torch.uint8)
    vc = kc.clone()
    q = torch.ops.localllm.rope_store(qkv, pos, rope.cos, rope.sin, kc, vc, slots, H, KVH, D, D, None, None, 1e-6)
    rq, rk, rv = qkv.split([H * D, KVH * D, KVH * D], -1)
    rq, rk = rq.reshape(T, H, D), rk.reshape(T, KVH, D)
    rq, rk = rope(pos, rq, rk)
    ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
    ref_k.view(-1, KVH, 68).index_copy_(0, slots, kv_quant.quantize(rk))
    ref_v.view(-1, KVH, 68).index_copy_(0, slots, kv_quant.quantize(rv.reshape(T, KVH, D)))
    assert torch.equal(q, rq) and torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


def q8_batch(specs, H, kvh, D, bs, seed=0):
    q, k, v, *rest = make_batch(specs, H, kvh, D, bs, torch.float32, seed)
    return (q, kv_quant.quantize(k), kv_quant.quantize(v), *rest)


def sdpa_on_dequantized(q, kc, vc, tables, cu, ctx, scale, window=None, softcap=None):
    """Per sequence: its K/V gathered and dequantized, then SDPA (or the capped softmax)."""
    return cpu_attention.reference(q, kv_quant.dequantize(kc), kv_quant.dequantize(vc), tables, cu, ctx, scale,
                                   window, softcap)


@pytest.mark.parametrize("specs,H,kvh,D", [
    ([(1, 33)], 32, 32, 64),  # decode, MHA (the 1.7B shape's heads)
    ([(1, 17), (4, 20), (20, 20), (1, 700)], 9, 3, 64),  # decode, verify, prefill, a long split context
    ([(1, 300), (6, 40)], 16, 2, 128),
])
def test_paged_attention_reads_q8_0_in_place(specs, H, kvh, D):
    assert cpu_attention.load()
    args = q8_batch(specs, H, kvh, D, 16)
    out = torch.ops.localllm.paged_attention(*args, 0.1, 0, 0.0)
    # the dequantized values are exact in fp32: what is left is summation order
    torch.testing.assert_close(out, sdpa_on_dequantized(*args, 0.1), rtol=0, atol=2e-5)
    # window and soft-cap on a q8_0 cache
    out = torch.ops.localllm.paged_attention(*args, 0.1, 21, 5.0)
    torch.testing.assert_close(out, sdpa_on_dequantized(*args, 0.1, 21, 5.0), rtol=0, atol=2e-5)


def test_reference_and_bad_rows():
    args = q8_batch([(2, 40)], 4, 2, 64, 16)
    torch.testing.assert_close(cpu_attention.reference(*args, 0.1), sdpa_on_dequantized(*args, 0.1))
    q, kc, vc, *rest = args
    with pytest.raises(RuntimeError, match="D / 32 \\* 34"):
        torch.ops.localllm.paged_attention(q, kc[..., :64].contiguous(), vc[..., :64].contiguous(), *rest, 0.1, 0, 0.0)


def test_torch_attention_fresh_prompt_sees_what_the_cache_holds():
    """A long fresh prompt attends with SDPA on its own K/V: rounded through q8_0 as a later read
    through the cache would see them, so the kernel's answer for the same rows agrees."""
    T, H, kvh, D, bs = 80, 4, 2, 64, 16
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(T, n, D, generator=g) for n in (H, kvh, kvh))
    tables = torch.arange(1, 7).view(1, -1)
    caches = [torch.zeros(7, bs, kvh, kv_quant.row_bytes(D), dtype=torch.uint8) for _ in range(2)]
    slots = torch.arange(T) + bs
    meta = AttnMeta(slots, tables, torch.tensor([0, T]), torch.tensor([T]), False, [T], [T])
    out = torch_attention(q, k, v, *caches, meta, 0.125)  # SDPA path (T >= 64, nothing cached)
    assert torch.equal(caches[0].view(-1, kvh, 68)[slots], kv_quant.quantize(k))
    assert torch.equal(caches[1].view(-1, kvh, 68)[slots], kv_quant.quantize(v))
    via_cache = torch.ops.localllm.paged_attention(q, *caches, tables, meta.cu_seqlens_q, meta.context_lens,
                                                   0.125, 0, 0.0)
    torch.testing.assert_close(out, via_cache.reshape(T, H * D), rtol=0, atol=2e-5)


def test_greedy_tokens_against_the_fp32_cache(int4_model):
    """The embedded model, default weights, greedy: q8_0 cache vs the exact fp32 cache. Counted:
    every divergence must come where the fp32 run's top-2 logits are close (a near tie)."""
    from conftest import CHAT_PROMPTS

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    runs = {}
    for kv in ("f32", "q8_0"):
        engine = make_engine(int4_model, kv_type=kv)
        reqs = [engine.encode_prompt([{"role": "user", "content": c}]) for c in CHAT_PROMPTS]
        runs[kv] = run_all(engine, reqs, params)
    same = total = 0
    for ref, got, prompt in zip(runs["f32"], runs["q8_0"], reqs):
        n = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
        same, total = same + n, total + len(ref)
        if n < len(ref):  # the fp32 run's logits at the first difference: a near tie
            top2 = last_logits(int4_model, prompt + ref[:n], torch.float32).topk(2).values
            assert (top2[0] - top2[1]).item() < 0.5, (n, top2)
    print(f"greedy tokens equal to the fp32 cache's before any divergence: {same}/{total}")
    assert same > total // 2  # the first divergence, when any, is a near tie (checked above)


def last_logits(loaded, ids: list[int], kv_dtype: torch.dtype) -> torch.Tensor:
    """The logits after `ids` (one prefill into a fresh cache of `kv_dtype`)."""
    n, bs = len(ids), 16
    nb = -(-n // bs) + 1
    caches = loaded.model.new_kv_cache(nb, bs, kv_dtype)
    positions, meta = describe_batch(torch.arange(1, nb).view(1, -1), [n], [n], bs)
    with torch.inference_mode():
        return loaded.model.logits(loaded.model(torch.tensor(ids), positions, meta, caches)[-1:])[0]


def test_q8_0_engine_keeps_its_tokens_with_speculation_and_prefix_hits(int4_model):
    """The same q8_0 run alone, batched, with n-gram speculation (verify steps, rollbacks) and
    again on the cached prefixes: the same tokens (the compiled step is off for q8_0: eager)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reqs = [p * 3 for p in ([5, 77, 901, 4242, 17], [311, 8, 12000, 64, 64, 9])]
    plain = make_engine(int4_model, kv_type="q8_0")
    assert plain.runner.kv_caches[0][0].dtype == torch.uint8 and plain.runner.captured is None
    want = [run_all(plain, [r], params)[0] for r in reqs]
    spec = make_engine(int4_model, kv_type="q8_0", speculative="ngram")
    assert run_all(spec, reqs, params, check_blocks=True) == want
    assert run_all(spec, reqs, params, check_blocks=True) == want  # now from the prefix cache
    assert spec.stats["cached_tokens"] > 0
    compiled = make_engine(int4_model, kv_type="q8_0", compile=True)
    assert compiled.runner.captured is None


def test_engine_sizes_the_cache_by_its_bytes(int4_model):
    budget = 64 << 20
    f16 = make_engine(int4_model, num_kv_blocks=None, kv_memory_bytes=budget, max_model_len=512)
    q8 = make_engine(int4_model, num_kv_blocks=None, kv_memory_bytes=budget, max_model_len=512, kv_type="q8_0")
    c = int4_model.config
    assert f16.runner.kv_caches[0][0].dtype == torch.float16
    assert f16.num_blocks == budget // (2 * c.num_layers * c.num_kv_heads * c.head_dim * 2 * 16)
    assert q8.num_blocks == budget // (2 * c.num_layers * c.num_kv_heads * c.head_dim // 32 * 34 * 16)
    assert q8.runner.kv_caches[0][0].numel() * 2 * c.num_layers <= budget


def test_unknown_kv_type_is_refused():
    with pytest.raises(ValueError, match="choose from auto, f32, f16, bf16, q8_0"):
        EngineConfig(kv_type="q4_0")
    r = run(["run", "--kv-type", "q4_0", "hi"])
    assert r.returncode == 2
    assert "invalid value for --kv-type: 'q4_0'; choose from auto, f32, f16, bf16, q8_0" in r.stderr


def test_planner_counts_the_8bit_cache_and_says_so(capsys):
    f = ModelFacts("m", 10**9, 9 * 10**8, 131072, 32768, 2048, 8192, 49152)
    assert kv_bytes(f, "int4", "cpu", 1000, "q8_0") * 64 == kv_bytes(f, "int4", "cpu", 1000) * 34
    assert kv_bytes(f, "int4", "cpu", 1000, "f32") == 2 * kv_bytes(f, "int4", "cpu", 1000)
    dev = DeviceFacts("cpu", 64 << 30)
    p8, p16 = plan(f, dev, "int4", 4096, kv_type="q8_0"), plan(f, dev, "int4", 4096)
    assert p8.kv_bytes * 64 == p16.kv_bytes * 34 and "(q8_0)" in p8.describe() and "(f16)" in p16.describe()
    print_plan(None, "auto", "cpu", None, None, None, "q8_0")  # what `localllm run --dry-run --kv-type q8_0` prints
    assert "(q8_0)" in capsys.readouterr().out



# ---- the Triton kernels (the GPU path), in Triton's interpreter on CPU: small shapes ------------------


def test_triton_store_quantizes_as_kv_quant():
    from localllm_kernels import store_kv

    T, KVH, D = 5, 3, 64
    k, v = hard_rows(T * KVH, D).view(T, KVH, D), hard_rows(T * KVH, D, seed=1).view(T, KVH, D)
    kc = torch.zeros(4, 16, KVH, kv_quant.row_bytes(D), dtype=torch.uint8)
    vc = kc.clone()
    slots = torch.tensor([17, 18, 3, -1, 40])  # -1: a padding row, written nowhere
    store_kv(k, v, kc, vc, slots)
    ref_k, ref_v = torch.zeros_like(kc), torch.zeros_like(vc)
    keep = slots >= 0
    ref_k.view(-1, KVH, 68)[slots[keep]] = kv_quant.quantize(k[keep])
    ref_v.view(-1, KVH, 68)[slots[keep]] = kv_quant.quantize(v[keep])
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


def test_triton_decode_reads_q8_0():
    from localllm_kernels import paged_decode_attention

    q, kc, vc, tables, cu, ctx = q8_batch([(1, 33), (1, 70), (1, 5)], 6, 3, 64, 16)
    out = paged_decode_attention(q, kc, vc, ctx.int(), tables.int(), 0.125, 2)  # split: both stages
    torch.testing.assert_close(out, sdpa_on_dequantized(q, kc, vc, tables, cu, ctx, 0.125), rtol=0, atol=2e-5)


def test_triton_prefill_reads_q8_0_prefix():
    from localllm_kernels import flash_attn_varlen_paged

    q, kc, vc, tables, cu, ctx = q8_batch([(5, 25), (20, 20), (3, 43)], 4, 2, 64, 16)
    # the new tokens as the cache holds them (what triton_attention passes)
    slots = torch.cat([tables[b, p // 16] * 16 + p % 16 for b, (n, c) in enumerate(zip(cu.diff(), ctx))
                       for p in [torch.arange(c - n, c)]])
    k_new, v_new = (kv_quant.dequantize(c.view(-1, 2, 68)[slots]) for c in (kc, vc))
    cached = (ctx - cu.diff()).int()
    out = flash_attn_varlen_paged(q, k_new, v_new, kc, vc, cu.int(), cached, tables.int(), 0.125)
    torch.testing.assert_close(out, sdpa_on_dequantized(q, kc, vc, tables, cu, ctx, 0.125), rtol=0, atol=2e-5)

