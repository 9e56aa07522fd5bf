"""The fused CPU layer ops (localllm_kernels/cpu/fused_ops.cpp, chosen at load by localllm.model.cpu_ops):
each op against the torch ops it replaces, on every instruction-set path this CPU has (bit-exact
where the math is the same sequence of roundings: residual adds, RoPE, cache writes; a few ulp
for the norms' and activations' reductions and exp), and the model on the fused ops against the
same model on the plain torch ops, token for token: alone, batched, with speculation, with
prefix-cache hits."""

import pytest
import torch
import torch.nn.functional as F
from conftest import make_engine
from test_engine import prompts, run_all

from localllm.model.cpu_ops import decode_layer_args
from localllm.model.layers import RotaryEmbedding
from localllm.sampling import SamplingParams
from localllm_kernels import cpu_fused


def paths() -> list[str]:
    assert cpu_fused.load()
    have = []
    for isa in ("avx512", "avx2", "generic"):
        try:
            have.append(cpu_fused.isa(isa))
        except RuntimeError:  # this CPU lacks it
            pass
    cpu_fused.isa("auto")
    return have


@pytest.fixture(params=["avx512", "avx2", "generic"])
def isa(request):
    """Each path the CPU can run, pinned for the test (a path the CPU lacks runs the best one: the
    test then repeats that one rather than being skipped)."""
    assert cpu_fused.load()
    want = request.param if request.param in paths() else "auto"
    yield cpu_fused.isa(want)
    cpu_fused.isa("auto")


def test_this_machine_runs_its_best_path():
    import localllm_kernels.cpu_int4 as cpu_int4

    best = cpu_fused.isa("auto")
    assert best == ("avx512" if cpu_int4._cpu_has(("avx512f", "avx512dq")) else
                    "avx2" if cpu_int4._cpu_has(("avx2", "fma")) else "generic")


@pytest.mark.parametrize("rows,n", [(1, 576), (3, 64), (37, 100), (300, 576)])
def test_add_rms_norm_matches_torch(isa, rows, n):
    g = torch.Generator().manual_seed(rows * n)
    x, r, w = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g) * 3, torch.randn(n, generator=g)
    normed, res = torch.ops.localllm.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(res, r + x)
    ref = F.rms_norm(r + x, (n,), w, 1e-5)
    torch.testing.assert_close(normed, ref, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(torch.ops.localllm.rms_norm(x, w, 1e-6), F.rms_norm(x, (n,), w, 1e-6),
                               rtol=2e-6, atol=2e-6)


def test_norm_paths_agree_exactly():
    """The sums of squares run in 16 lanes in the same order on every path: the same bits."""
    x, w = torch.randn(9, 1000), torch.randn(1000)
    outs = []
    for isa in paths():
        cpu_fused.isa(isa)
        outs.append(torch.ops.localllm.rms_norm(x, w, 1e-5))
    cpu_fused.isa("auto")
    assert all(torch.equal(o, outs[0]) for o in outs)


@pytest.mark.parametrize("gelu", [False, True])
def test_gated_activations_match_torch(isa, gelu):
    g = torch.Generator().manual_seed(1)
    gate_up = torch.cat([torch.randn(5, 1536, generator=g) * 6, torch.tensor([[0.0, -0.0, 100.0, -100.0] * 384])])
    gate, up = gate_up.chunk(2, dim=-1)
    if gelu:
        got, ref = torch.ops.localllm.gelu_tanh_mul(gate_up), F.gelu(gate, approximate="tanh") * up
    else:
        got, ref = torch.ops.localllm.silu_mul(gate_up), F.silu(gate) * up
    # torch's GeGLU computes 1 + tanh(y), which cancels for y << 0: a few 1e-6 absolute there
    tol = {"rtol": 4e-6, "atol": 1e-5 if gelu else 1e-6}
    torch.testing.assert_close(got, ref, **tol)
    odd = torch.cat([gate_up, gate_up], 1)[:, :1538].contiguous()  # a width that leaves a tail past the vector lanes
    want = (F.gelu(odd[:, :769], approximate="tanh") if gelu else F.silu(odd[:, :769])) * odd[:, 769:1538]
    got = torch.ops.localllm.gelu_tanh_mul(odd) if gelu else torch.ops.localllm.silu_mul(odd)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim,qk_norm", [(64, False), (32, False), (64, True)])
def test_rope_store_equals_split_norm_rope_and_cache_write(isa, kv_dtype, rotary_dim, qk_norm):
    H, KVH, D, T = 6, 2, 64, 5
    g = torch.Generator().manual_seed(rotary_dim)
    rope = RotaryEmbedding(D, 256, 10000.0, None, torch.float32, rotary_dim)
    wide = torch.randn(T, (H + 2 * KVH) * D + 16, generator=g)
    qkv = wide[:, :(H + 2 * KVH) * D]  # rows at a stride, as a padded GEMM output's slice
    positions = torch.tensor([0, 7, 100, 255, 3])
    slots = torch.tensor([17, 3, 40, 41, 16])
    qw = kw = None
    if qk_norm:
        qw, kw = torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5
    kc, vc = torch.zeros(4, 16, KVH, D, dtype=kv_dtype), torch.zeros(4, 16, KVH, D, dtype=kv_dtype)
    q = torch.ops.localllm.rope_store(qkv, positions, rope.cos, rope.sin, kc, vc, slots, H, KVH, D, rotary_dim,
                                      qw, kw, 1e-6)
    rq, rk, rv = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    rq, rk, rv = rq.reshape(T, H, D), rk.reshape(T, KVH, D), rv.reshape(T, KVH, D)
    if qk_norm:  # the norm's reduction order differs from torch's: the rest is compared on its output
        rq, rk = F.rms_norm(rq, (D,), qw, 1e-6), F.rms_norm(rk, (D,), kw, 1e-6)
    rq, rk = rope(positions, rq, rk)
    ref_k, ref_v = torch.zeros_like(kc).view(-1, KVH, D), torch.zeros_like(vc).view(-1, KVH, D)
    ref_k.index_copy_(0, slots, rk.to(kv_dtype))
    ref_v.index_copy_(0, slots, rv.to(kv_dtype))
    assert torch.equal(vc.view(-1, KVH, D), ref_v)
    if qk_norm:
        torch.testing.assert_close(q, rq, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kc.view(-1, KVH, D).float(), ref_k.float(), rtol=1e-2, atol=1e-5)
    else:
        assert torch.equal(q, rq) and torch.equal(kc.view(-1, KVH, D), ref_k)


def test_bad_inputs_are_refused_with_the_reason():
    assert cpu_fused.load()
    kc = torch.zeros(2, 16, 2, 64)
    cos = torch.zeros(8, 64)
    qkv = torch.zeros(1, 10 * 64)
    with pytest.raises(RuntimeError, match="position 8 outside the table of 8"):
        torch.ops.localllm.rope_store(qkv, torch.tensor([8]), cos, cos, kc, kc.clone(), torch.tensor([0]), 6, 2,
                                      64, 64, None, None, 1e-6)
    with pytest.raises(RuntimeError, match="slot 32 outside the cache of 32"):
        torch.ops.localllm.rope_store(qkv, torch.tensor([0]), cos, cos, kc, kc.clone(), torch.tensor([32]), 6, 2,
                                      64, 64, None, None, 1e-6)
    with pytest.raises(RuntimeError, match=r"qkv must be \[T, \(H \+ 2 KVH\) D\]"):
        torch.ops.localllm.rope_store(qkv, torch.tensor([0]), cos, cos, kc, kc.clone(), torch.tensor([0]), 8, 2,
                                      64, 64, None, None, 1e-6)
    with pytest.raises(RuntimeError, match="float32 CPU matrix"):
        torch.ops.localllm.silu_mul(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"weight must be float32 \[8\]"):
        torch.ops.localllm.rms_norm(torch.zeros(2, 8), torch.zeros(7), 1e-6)
    with pytest.raises(RuntimeError, match="force must be auto, avx512, avx2 or generic"):
        cpu_fused.isa("sse2")
    def layer(weights: list, ints: list) -> None:
        torch.ops.localllm.decode_layer(qkv, None, weights, ints, [0.0] * 4, torch.tensor([0]), cos, cos, kc,
                                        kc.clone(), torch.tensor([0]), torch.tensor([[0]]), torch.tensor([0, 1]),
                                        torch.tensor([1]), 64, 1.0)

    with pytest.raises(RuntimeError, match=r"weights must be 2 norms \(4 with q/k norms\) and 3 tensors per linear part"):
        layer([qkv], [6, 2, 64, 0, 0, 1, 1, 1, 1, 2] + [0, 32, 640, 0] * 4)
    with pytest.raises(RuntimeError, match="each linear at least one"):
        layer([qkv] * 11, [6, 2, 64, 0, 0, 0, 1, 1, 1, 2] + [0, 32, 640, 0] * 3)
    with pytest.raises(RuntimeError, match=r"part kind 5 is none of int4 \(0\)"):
        layer([torch.ones(640)] * 2 + [qkv] * 12, [6, 2, 64, 0, 0, 1, 1, 1, 1, 2] + [5, 32, 640, 0] * 4)


# ---- the model on the fused ops vs the plain torch ops ------------------------------------------

@pytest.fixture(scope="module")
def tiny_int4(tiny_gguf):
    from localllm.model.loader import load_model

    loaded = load_model(tiny_gguf, "auto")
    assert loaded.model.ops.attend.__module__ == "localllm.model.cpu_ops"  # chosen at load on CPU
    # ... and so is the one-call layer: every layer's linears are on our int4 kernel
    assert loaded.model.ops.layer.__module__ == "localllm.model.cpu_ops"
    assert all(decode_layer_args(layer) is not None for layer in loaded.model.layers)
    return loaded


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32])
def test_one_call_layers_equal_the_ops_one_by_one(tiny_int4, isa, kv_dtype):
    """torch.ops.localllm.decode_layer runs the fused ops' sequence in C++: the same bits as the
    ops called one by one from Python (hidden states and every cache slot written), for the steps it
    takes (decode alone and batched, a speculative verify, a prefix-hit extend), on each path."""
    assert_one_call_equals_one_by_one(tiny_int4.model, kv_dtype)


def test_one_call_layers_add_each_parts_bias_after_its_cut(tiny_gguf, isa):
    """Biased linears (Qwen2's qkv; any linear of an HF checkpoint): decode_layer adds each int4
    part's bias after the cut to its out features, as Int4Linear.forward does, with the bits of
    the ops one by one; a bias set after the arguments were made is seen."""
    from localllm.model.loader import load_model

    m = load_model(tiny_gguf, "auto").model
    g = torch.Generator().manual_seed(5)
    for layer in m.layers:
        for lin in (layer.qkv, layer.o):
            lin.bias = torch.nn.Parameter(torch.randn(lin.out_features, generator=g), requires_grad=False)
    args = [decode_layer_args(layer) for layer in m.layers]
    assert all(a is not None for a in args)
    assert all(a[0][4] is layer.qkv.bias for a, layer in zip(args, m.layers))  # 2 norms, then qkv's w, scales, bias
    assert_one_call_equals_one_by_one(m, torch.float32)
    layer = m.layers[0]
    layer.down.bias = torch.nn.Parameter(torch.zeros(layer.down.out_features), requires_grad=False)
    assert decode_layer_args(layer)[0][-1] is layer.down.bias


def assert_one_call_equals_one_by_one(m, kv_dtype) -> None:
    """Model `m` (on the fused ops, one call per layer) gives the hidden states and cache writes of
    the same ops called one by one, for decode at batch 1 and 3, a 4-token verify and an extend,
    on the int4 GEMM's VNNI path (where the CPU has it) and its AVX2 one."""
    from localllm.model.attention import describe_batch
    from localllm.model.cpu_ops import fused_cpu_ops
    from localllm.model.llama import Ops

    one_by_one = fused_cpu_ops(Ops.for_backend("torch"), one_call_layers=False)
    assert m.ops.layer is not one_by_one.layer
    g = torch.Generator().manual_seed(3)
    # (new tokens, context) per sequence: decode at batch 1 and 3, a 4-token verify, an extend
    for lens in ([(1, 21)], [(1, 21), (1, 40), (1, 7)], [(4, 24)], [(13, 45)]):
        W = 4
        tables = torch.tensor([[1 + b * W + j for j in range(W)] for b in range(len(lens))])
        pos, meta = describe_batch(tables, [n for n, _ in lens], [c for _, c in lens], 16)
        ids = torch.randint(3, 1000, (pos.shape[0],), generator=g)
        kv0 = m.new_kv_cache(1 + W * len(lens), 16, kv_dtype)
        for k, v in kv0:  # the cached prefix: any numbers, the same for both
            k.copy_(torch.randn(k.shape, generator=g))
            v.copy_(torch.randn(v.shape, generator=g))
        for avx2 in (False, True):
            torch.ops.localllm.int4_isa(avx2)
            try:
                kv1, kv2 = ([(k.clone(), v.clone()) for k, v in kv0] for _ in range(2))
                h0, h1 = m(ids, pos, meta, kv1, one_by_one), m(ids, pos, meta, kv2)
            finally:
                torch.ops.localllm.int4_isa(False)
            assert torch.equal(h0, h1), (lens, avx2)
            assert all(torch.equal(a, b) for p1, p2 in zip(kv1, kv2) for a, b in zip(p1, p2)), (lens, avx2)


def test_prompt_chunks_mlp_in_row_blocks_equals_the_whole_chunk(tiny_int4, isa):
    """A prompt chunk of 512 rows or more runs its MLP 256 rows at a time (the last block taking the
    rest), in the one-call layer (an extend: paged attention) and in the ops one by one (a fresh
    prompt: SDPA): hidden states and cache writes bit for bit those of the whole chunk at once."""
    import dataclasses

    from localllm.model.attention import describe_batch
    from localllm.model.cpu_ops import fused_cpu_ops
    from localllm.model.llama import Ops

    m = tiny_int4.model
    assert m.ops.mlp_rows == 256
    whole = dataclasses.replace(fused_cpu_ops(Ops.for_backend("torch"), one_call_layers=False), mlp_rows=0)
    g = torch.Generator().manual_seed(4)
    for n, ctx in ((600, 620), (600, 600), (511, 530)):  # extend, fresh prompt, one block
        W = -(-ctx // 16)
        pos, meta = describe_batch(torch.arange(1, W + 1).view(1, W), [n], [ctx], 16)
        ids = torch.randint(3, 1000, (n,), generator=g)
        kv0 = m.new_kv_cache(1 + W, 16, torch.float32)
        for k, v in kv0:
            k.copy_(torch.randn(k.shape, generator=g))
            v.copy_(torch.randn(v.shape, generator=g))
        kv1, kv2 = ([(k.clone(), v.clone()) for k, v in kv0] for _ in range(2))
        h0, h1 = m(ids, pos, meta, kv1, whole), m(ids, pos, meta, kv2)
        assert torch.equal(h0, h1), (n, ctx)
        assert all(torch.equal(a, b) for p1, p2 in zip(kv1, kv2) for a, b in zip(p1, p2)), (n, ctx)


def plain_and_fused(loaded, fn):
    """fn() on the plain torch ops, then on the fused ops (the load-time choice, restored)."""
    m = loaded.model
    m.use_attention("torch", fused_cpu=False)
    try:
        plain = fn()
    finally:
        m.use_attention("torch", fused_cpu=True)
    return plain, fn()


def test_fused_tokens_equal_plain_alone_batched_and_with_prefix_hits(tiny_int4):
    reqs = prompts(4, seed=5)
    reqs.append(reqs[0][:40] + [7, 8, 9])  # a prefix-cache hit: its extend step reads a cached prefix
    reqs.append(prompts(1, seed=9)[0] * 2)  # 64+ tokens: a fresh prompt attends with SDPA

    def run():
        eng = make_engine(tiny_int4)
        alone = [run_all(eng, [p])[0] for p in reqs]
        assert eng.stats["cached_tokens"] > 0
        return alone, run_all(make_engine(tiny_int4, num_kv_blocks=300), reqs)

    (plain_alone, plain_batched), (alone, batched) = plain_and_fused(tiny_int4, run)
    assert alone == plain_alone and batched == plain_batched == plain_alone


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_fused_hidden_states_match_plain_on_other_cache_dtypes(tiny_int4, kv_dtype):
    from localllm.model.attention import AttnMeta

    m = tiny_int4.model
    ids = torch.arange(20) * 2411 % 49000 + 3
    pos = torch.arange(20)
    meta = AttnMeta(pos + 16, torch.tensor([[1, 2]]), torch.tensor([0, 20]), torch.tensor([20]), False, [20], [20])

    def hidden():
        kv = m.new_kv_cache(4, 16, kv_dtype)
        return m(ids, pos, meta, kv), kv

    (h0, kv0), (h1, kv1) = plain_and_fused(tiny_int4, hidden)
    # the int4 GEMMs round their inputs to 16 bits: a norm 1 ulp off can move one such rounding,
    # so the layers' outputs agree to ~1e-4 of their size (a wrong slot or rotation gives O(1))
    assert ((h1 - h0).norm() / h0.norm()).item() < 1e-3
    for j in (0, 1):  # the keys and values written, every layer
        a, b = (torch.cat([layer[j].flatten(0, 1)[16:36].flatten().float() for layer in kv]) for kv in (kv1, kv0))
        assert b.norm() > 0 and ((a - b).norm() / b.norm()).item() < 1e-3


@pytest.mark.parametrize("k", [2, 4])
def test_fused_speculation_keeps_the_tokens(tiny_int4, k):
    reqs = [p * 3 for p in prompts(3, seed=11)]  # repeats: the n-gram proposer finds matches
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    stats = {}

    def run():
        eng = make_engine(tiny_int4, speculative="ngram", num_speculative_tokens=k)
        out = run_all(eng, [list(p) for p in reqs], params)
        stats["proposed"] = eng.cache_stats()["speculative"]["proposed"]
        return out, run_all(make_engine(tiny_int4), [list(p) for p in reqs], params)

    (plain_spec, plain), (spec, fused) = plain_and_fused(tiny_int4, run)
    assert stats["proposed"] > 0
    assert spec == plain_spec == plain == fused


def test_fused_sampling_and_logprobs_equal_plain(tiny_int4):
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True, logprobs=2)
    reqs = prompts(2, seed=4)
    plain, fused = plain_and_fused(tiny_int4, lambda: run_all(make_engine(tiny_int4), reqs, params))
    assert fused == plain
