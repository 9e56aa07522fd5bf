"""The engine on the Triton backend (the GPU path), checked on CPU in Triton's interpreter.

The same model with the torch backend is the reference: greedy tokens must be equal for a
batch that prefills, decodes, hits the prefix cache and has sequences join and leave. The
decode-graph path (static buffers padded to batch buckets with slot -1 / context length 0)
runs here without capture; on a GPU bench/gpu_e2e.py replays real CUDA graphs.
"""

import pytest
import torch
from conftest import make_engine
from test_engine import prompts

from localllm.engine.cuda_graphs import DecodeGraphs, buckets_for
from localllm.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
def triton_model(tiny_model):
    tiny_model.model.use_attention("triton")
    yield tiny_model
    tiny_model.model.use_attention("torch")


def test_buckets():
    assert buckets_for(1) == [1]
    assert buckets_for(8) == [1, 2, 4, 8]
    assert buckets_for(12) == [1, 2, 4, 8, 12]


def test_unknown_backend(tiny_model):
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        tiny_model.model.use_attention("flash")


def run_mixed(engine, reqs, lengths):
    """Greedy outputs with a different max_tokens per request, so the decode batch shrinks
    5 -> 4 -> 3 -> ... as requests finish (batches of 3 pad to the bucket of 4)."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
           for p, n in zip(reqs, lengths)]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        engine.block_manager.check_invariants(engine.live_sequences())
    return [done[i] for i in ids]


# with captured graphs (~13 s interpreted) in `make test-slow`: CI's 20-minute budget
@pytest.mark.parametrize("graphs", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_triton_backend_equals_torch(tiny_model, graphs):
    # 5 sequences, graph buckets [1, 2, 4]: batches of 3 pad to 4, batches of 5 run eagerly
    # (more than the largest bucket); two prompts share a 40-token prefix (cache hit, extend).
    reqs = prompts(3, seed=3)
    reqs += [reqs[0][:40] + [7, 8, 9], reqs[1] + [11]]
    lengths = [3, 12, 6, 9, 5]
    want = run_mixed(make_engine(tiny_model, compile=False), reqs, lengths)
    tiny_model.model.use_attention("triton")
    try:
        eng = make_engine(tiny_model, compile=graphs, max_graph_batch=4, max_num_batched_tokens=64)
        assert (eng.runner.captured is not None) == graphs
        got = run_mixed(eng, reqs, lengths)
    finally:
        tiny_model.model.use_attention("torch")
    assert got == want
    if graphs:
        assert eng.runner.captured.steps >= 6  # the decode steps of 4 or fewer sequences
    assert eng.stats["cached_tokens"] > 0
    assert eng.block_manager.num_used_blocks == 0


def test_graph_padding_rows_touch_nothing(triton_model):
    """A padded decode step writes only its real rows' slots and returns their hidden states."""
    eng = make_engine(triton_model, max_graph_batch=4, compile=True)
    runner, model = eng.runner, triton_model.model
    reqs = prompts(3, seed=5)
    for p in reqs:
        eng.add_request(p, GREEDY)
    eng.step()  # prefill all three
    seqs = list(eng.scheduler.running)
    assert len(seqs) == 3 and all(s.num_computed_tokens == s.num_prompt_tokens for s in seqs)
    for s in seqs:  # room for the decode token
        eng.block_manager.allocate(s, 1)
    before = [k.clone() for k, _ in runner.kv_caches]
    ids, pos, meta = runner.prepare(seqs, [1, 1, 1])
    hidden = runner.captured.run(ids, pos, meta)
    assert hidden.shape == (3, model.cfg.hidden_size)
    assert runner.captured.slots[3].item() == -1 and runner.captured.context_lens[3].item() == 0
    # exactly the three new slots changed, in every layer (bitwise: never-written slots may hold NaN)
    for (k, _), k0 in zip(runner.kv_caches, before):
        k, k0 = k.flatten(0, 1).view(torch.int32), k0.flatten(0, 1).view(torch.int32)
        changed = (k != k0).flatten(1).any(1).nonzero().flatten()
        assert sorted(changed.tolist()) == sorted(meta.slot_mapping.tolist())
    # and the same rows as the eager batch of three (the KV writes are idempotent)
    eager = model(ids, pos, meta, runner.kv_caches)
    torch.testing.assert_close(hidden, eager, rtol=1e-5, atol=1e-5)


def test_graph_falls_back_when_table_too_wide(triton_model):
    eng = make_engine(triton_model, max_graph_batch=2, compile=True)
    graphs: DecodeGraphs = eng.runner.captured
    eng.add_request(prompts(1, seed=7)[0], GREEDY)
    eng.step()
    seq = eng.scheduler.running[0]
    eng.block_manager.allocate(seq, 1)
    ids, pos, meta = eng.runner.prepare([seq], [1])
    meta.block_tables = torch.zeros(1, graphs.block_tables.shape[1] + 1, dtype=torch.int32)
    assert graphs.run(ids, pos, meta) is None


@pytest.mark.parametrize("rows", [1, 5, 70])  # fused kernel (decode / verify) and dequant + matmul
def test_int4_linear_triton_path(rows):
    """The layer the GPU runs (Triton kernel), with GPTQ act-order input permutation and bias,
    against x @ W.T on the checkpoint's own weight."""
    from localllm.model.int4 import quantize_rtn
    from localllm.model.layers import Int4Linear

    g = torch.Generator().manual_seed(rows)
    n, k = 48, 128
    w = quantize_rtn(torch.randn(n, k, generator=g), 32)
    w.in_perm = torch.randperm(k, generator=g)
    bias = torch.randn(n, generator=g)
    layer = Int4Linear(w, torch.float32, bias, triton=True)
    assert layer.cuda_path
    x = torch.randn(rows, k, generator=g)
    ref = x.double() @ w.dequantize_logical(torch.float64).T + bias.double()
    out = layer(x)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_triton_attention_window_and_softcap_equals_torch():
    """The backends' attention entry points with a sliding window and soft-capped scores: a prefill
    of two fresh prompts, then a decode step of each, the same on Triton (interpreted) and torch."""
    from localllm.model.attention import AttnMeta, torch_attention, triton_attention

    g = torch.Generator().manual_seed(0)
    H, kvh, D, bs, window, cap = 4, 2, 64, 16, 9, 20.0
    tables = torch.tensor([[3, 0, 5], [1, 4, 2]])
    caches = {name: [torch.zeros(6, bs, kvh, D) for _ in range(2)] for name in ("torch", "triton")}

    def step(n_new, ctx):
        T = sum(n_new)
        q, k, v = (torch.randn(T, h, D, generator=g) * 2 for h in (H, kvh, kvh))
        pos = [torch.arange(c - n, c) for n, c in zip(n_new, ctx)]
        slots = torch.cat([tables[b, p // bs] * bs + p % bs for b, p in enumerate(pos)])
        cu = torch.tensor([0, *n_new]).cumsum(0)
        ctx_t, decode = torch.tensor(ctx), all(n == 1 for n in n_new)
        ref = torch_attention(q, k, v, *caches["torch"], AttnMeta(slots, tables, cu, ctx_t, decode, n_new, ctx),
                              D ** -0.5, window, cap)
        meta = AttnMeta(slots, tables.int(), cu.int(), ctx_t.int(), decode,
                        cached_lens=(ctx_t - torch.tensor(n_new)).int())
        out = triton_attention(q, k, v, *caches["triton"], meta, D ** -0.5, window, cap)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)

    step([40, 25], [40, 25])
    step([1, 1], [41, 26])
