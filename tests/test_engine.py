"""Engine behaviour: batching, prefix caching, chunked prefill, preemption, aborts, accounting."""

import random

import pytest
from conftest import chat, make_engine

from localllm.engine.block_manager import BlockManager
from localllm.engine.engine import ContextLengthError
from localllm.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(5, 70))] for _ in range(n)]


def run_all(engine, reqs, params=GREEDY, check_blocks: bool = False) -> list[list[int]]:
    """Output token ids of each request, all batched together; optionally checking the block
    accounting after every step."""
    ids = [engine.add_request(p, params) for p in reqs]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        if check_blocks:
            engine.block_manager.check_invariants(engine.live_sequences())
    return [done[i] for i in ids]


def alone(loaded, reqs, params=GREEDY, **kw):
    return [run_all(make_engine(loaded, **kw), [p], params)[0] for p in reqs]


def test_batched_equals_alone(tiny_model):
    reqs = prompts(8)
    eng = make_engine(tiny_model)
    batched = run_all(eng, reqs)
    assert eng.stats["max_batch_size"] == 8
    assert batched == alone(tiny_model, reqs)
    assert eng.block_manager.num_used_blocks == 0


def test_batched_equals_alone_real_model(fp32_model):
    msgs = [chat("What is the capital of France?"), chat("Name a color."), chat("Count to five.")]
    eng = make_engine(fp32_model)
    assert run_all(eng, msgs) == alone(fp32_model, msgs)


def test_requests_join_and_leave_between_steps(tiny_model):
    eng = make_engine(tiny_model)
    a = eng.add_request(prompts(1, 1)[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    eng.step()
    b = eng.add_request(prompts(1, 2)[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    seen = []
    while eng.has_unfinished():
        seen.append({o.request_id for o in eng.step()})
    assert a in seen[0] and b in seen[0]  # b joined the running batch at once
    assert all(a not in s for s in seen[3:])  # a left when done; b kept going
    assert sum(b in s for s in seen) == 6


def test_chunked_prefill_equals_unchunked(tiny_model):
    reqs = prompts(4, 3) + [[7] * 200]
    chunked = make_engine(tiny_model, max_num_batched_tokens=16)
    out = run_all(chunked, reqs)
    assert chunked.stats["steps"] > 200 // 16
    assert out == alone(tiny_model, reqs)


def test_decodes_stream_while_long_prompt_prefills(tiny_model):
    eng = make_engine(tiny_model, max_num_batched_tokens=32)
    a = eng.add_request([5] * 10, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    eng.step()
    eng.add_request([9] * 300, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    steps_with_a = sum(any(o.request_id == a for o in eng.step()) for _ in range(10))
    assert steps_with_a == 10  # the 300-token prefill is chunked around a's decode tokens


def test_preemption_gives_same_tokens(tiny_model):
    reqs = prompts(6, 4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eng = make_engine(tiny_model, num_kv_blocks=14)  # 13 usable blocks: not enough for all at once
    out = run_all(eng, reqs, params)
    assert eng.stats["preemptions"] > 0
    assert out == alone(tiny_model, reqs, params)
    assert eng.block_manager.num_used_blocks == 0


def test_request_that_can_never_fit_is_rejected(tiny_model):
    eng = make_engine(tiny_model, num_kv_blocks=5)  # 64 slots
    with pytest.raises(ContextLengthError, match="KV"):
        eng.add_request([3] * 40, SamplingParams(max_tokens=30))
    with pytest.raises(ContextLengthError, match="1024"):
        make_engine(tiny_model).add_request([3] * 1100, SamplingParams(max_tokens=1))


def test_second_chat_turn_hits_cache(fp32_model):
    eng = make_engine(fp32_model)
    params = SamplingParams(temperature=0, max_tokens=20)
    turn1 = [{"role": "system", "content": "You are a terse assistant. " * 6}, {"role": "user", "content": "Hi!"}]
    ids1 = eng.encode_prompt(turn1)
    *_, r1 = eng.generate(turn1, params)
    turn2 = turn1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "And again?"}]
    ids2 = eng.encode_prompt(turn2)
    computed = ids1 + r1.token_ids[:-1]  # the last sampled token was never fed
    common = next((i for i, (x, y) in enumerate(zip(computed, ids2)) if x != y), min(len(computed), len(ids2)))
    *_, r2 = eng.generate(turn2, params)
    assert common > len(ids1)  # the reply itself is part of the shared prefix
    assert r2.num_cached_tokens == common // 16 * 16
    assert r2.num_cached_tokens > len(ids1) - 16
    assert eng.cache_stats()["hit_rate"] > 0


def test_full_hit_still_generates(tiny_model):
    p = prompts(1, 5)[0][:48]  # exactly 3 blocks
    eng = make_engine(tiny_model)
    first = run_all(eng, [p])[0]
    *_, again = eng.generate(p, GREEDY)
    assert again.num_cached_tokens == 32  # the last block is recomputed to get logits
    assert again.token_ids == first


def test_hash_collisions_never_return_wrong_kv(tiny_model):
    eng = make_engine(tiny_model)
    eng.block_manager.hash_fn = lambda parent, tokens: 42  # every block collides
    a, b = prompts(2, 6)
    a, b = a + [1] * 40, b + [1] * 40
    out_a = run_all(eng, [a])[0]
    *_, ob = eng.generate(b, GREEDY)
    assert ob.num_cached_tokens == 0
    assert ob.token_ids == alone(tiny_model, [b])[0]
    *_, oa = eng.generate(a, GREEDY)  # same tokens: a real hit despite the shared hash
    assert oa.token_ids == out_a


def test_abort_frees_blocks(tiny_model):
    eng = make_engine(tiny_model)
    rid = eng.add_request(prompts(1, 7)[0], SamplingParams(temperature=0, max_tokens=50))
    eng.step()
    assert eng.block_manager.num_used_blocks > 0
    assert eng.abort(rid)
    assert eng.block_manager.num_used_blocks == 0
    assert not eng.abort(rid)
    assert not eng.has_unfinished()


def test_fuzz_block_accounting(tiny_model):
    rng = random.Random(1234)
    eng = make_engine(tiny_model, num_kv_blocks=24, max_num_batched_tokens=48, max_num_seqs=6)
    live = []
    for _ in range(120):
        r = rng.random()
        if r < 0.3:
            p = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 90))]
            if rng.random() < 0.3 and live:  # reuse a prefix sometimes
                p = [1, 2, 3] * 10 + p
            live.append(eng.add_request(p, SamplingParams(temperature=0.8, max_tokens=rng.randrange(1, 40),
                                                          seed=rng.randrange(99))))
        elif r < 0.4 and live:
            eng.abort(live.pop(rng.randrange(len(live))))
        else:
            for out in eng.step():
                if out.finished and out.request_id in live:
                    live.remove(out.request_id)
        eng.block_manager.check_invariants(eng.live_sequences())
    while eng.has_unfinished():
        eng.step()
        eng.block_manager.check_invariants(eng.live_sequences())
    bm = eng.block_manager
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.capacity_blocks
    assert eng.stats["preemptions"] > 0


def test_block_manager_lru_evicts_tails_first():
    from localllm.engine.sequence import Sequence

    bm = BlockManager(9, 4)
    s = Sequence("a", list(range(16)), SamplingParams(), 1)
    bm.allocate(s, 16)
    s.num_computed_tokens = 16
    bm.hash_full_blocks(s)
    table = list(s.block_table)
    bm.free_seq(s)
    order = list(bm.free)
    assert order[-4:] == table[::-1]  # tail block evicted first, head block last
    assert order.index(table[-1]) < order.index(table[0])


def test_stop_strings_and_streaming(fp32_model):
    eng = make_engine(fp32_model)
    msgs = chat("What is the capital of France?")
    *_, full = eng.generate(msgs, SamplingParams(temperature=0, max_tokens=20))
    assert "Paris" in full.text
    stop = "Paris"
    deltas = [o.delta for o in eng.generate(msgs, SamplingParams(temperature=0, max_tokens=20, stop=[stop]))]
    text = "".join(deltas)
    assert text == full.text[:full.text.index(stop)]
    assert not any("Par" in d for d in deltas)


def test_stream_has_no_broken_utf8(fp32_model):
    eng = make_engine(fp32_model)
    msgs = chat("Reply with three emoji and the word 東京 only.")
    outs = list(eng.generate(msgs, SamplingParams(temperature=0, max_tokens=24)))
    assert all("\ufffd" not in o.delta for o in outs)
    assert "".join(o.delta for o in outs) == outs[-1].text == eng.tokenizer.decode(
        [t for t in outs[-1].token_ids if t not in eng.eos_ids])


def test_seed_reproducible_and_params_validated(tiny_model):
    from localllm.sampling import SamplingError

    p = prompts(1, 8)[0]
    s = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=10)
    a = run_all(make_engine(tiny_model), [p], s)[0]
    b = run_all(make_engine(tiny_model), [p], s)[0]
    c = run_all(make_engine(tiny_model), [p], SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=8,
                                                             max_tokens=10))[0]
    assert a == b and a != c
    for bad in [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-5), dict(min_p=2),
                dict(max_tokens=0), dict(repetition_penalty=0), dict(seed="x"), dict(stop=[""])]:
        with pytest.raises(SamplingError) as e:
            SamplingParams(**bad)
        assert e.value.param == next(iter(bad))


def test_kv_cache_sized_from_memory_budget(tiny_model):
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine

    per_token = tiny_model.config.kv_bytes_per_token(4)  # fp32 cache on CPU
    eng = LLMEngine(tiny_model, EngineConfig(kv_memory_bytes=per_token * 16 * 100))
    assert eng.num_blocks == 100
    auto = LLMEngine(tiny_model, EngineConfig(max_num_seqs=4))
    assert auto.num_blocks * 16 >= 4 * auto.max_model_len  # capped by what 4 full contexts need
    assert auto.num_blocks * 16 <= 4 * auto.max_model_len + 32
    with pytest.raises(ValueError, match="kv-memory"):
        LLMEngine(tiny_model, EngineConfig(kv_memory_bytes=per_token * 16))


def test_python_api_generate_and_chat():
    from localllm import LLM

    llm = LLM("smollm2-135m", num_kv_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=12)
    [out] = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params)
    assert "Paris" in out.text and out.finish_reason == "stop" and len(out.prompt_token_ids) == 37
    assert out.token_ids[-1] in llm.engine.eos_ids
    outs = llm.generate(["Once upon a time", "The sky is"], params)
    assert len(outs) == 2 and all(o.finish_reason in ("stop", "length") and o.text for o in outs)
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("Once upon a time", add_special_tokens=True)
    with pytest.raises(ValueError, match="one entry per prompt"):
        llm.generate(["a", "b"], [params])
