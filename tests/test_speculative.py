"""Speculative decoding: exact greedy outputs, the sampling rule's distribution, KV rollback."""

import dataclasses
import random

import pytest
import torch
from conftest import chat, make_engine
from test_engine import alone, run_all

from localllm.engine.speculative import NgramProposer, accept_greedy, accept_sampling
from localllm.sampling import SamplingParams

REPETITIVE = "Rewrite this code with one change: rename x to y.\n\n" + \
    "def area(x):\n    return x * x\n\ndef double(x):\n    return x + x\n\ndef cube(x):\n    return x * x * x\n"


def repetitive_prompts(n: int) -> list[list[int]]:
    rng = random.Random(11)
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, 49152) for _ in range(rng.randrange(3, 9))]
        out.append((motif * 12)[: rng.randrange(20, 90)])
    return out


@pytest.mark.parametrize("k", [1, 2, 4])
def test_ngram_greedy_is_token_identical_batched(tiny_model, k):
    reqs = repetitive_prompts(5)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    eng = make_engine(tiny_model, speculative="ngram", num_speculative_tokens=k)
    out = run_all(eng, reqs, params, check_blocks=True)
    assert out == alone(tiny_model, reqs, params)
    assert eng.cache_stats()["speculative"]["proposed"] > 0
    assert eng.block_manager.num_used_blocks == 0


def test_ngram_on_a_code_edit_accepts_runs(int4_model):
    params = SamplingParams(temperature=0, max_tokens=40)
    msgs = [chat(REPETITIVE)]
    eng = make_engine(int4_model, speculative="ngram", num_speculative_tokens=4)
    # k follows measured step times; this test is about what n-gram proposals accept, so the
    # costs stay at their prior (a loaded machine's timings made k, hence the counts, vary)
    eng.adaptive.observe = lambda k, seconds: None
    assert run_all(eng, msgs, params) == alone(int4_model, msgs, params)
    st = eng.cache_stats()["speculative"]
    assert st["accepted"] > 10 and st["mean_accepted_length"] > 1.5, st


def test_draft_model_greedy_is_token_identical(fp32_model, int4_model):
    """Target: fp32 weights; draft: the int4 copy of the same GGUF (own paged KV cache)."""
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    msgs = [chat("What is the capital of France?"), chat(REPETITIVE)]
    for k in (2, 5):
        eng = LLMEngine(fp32_model, EngineConfig(num_kv_blocks=256, speculative="draft", num_speculative_tokens=k),
                        draft=int4_model)
        assert run_all(eng, msgs, params) == alone(fp32_model, msgs, params)
        st = eng.cache_stats()["speculative"]
        assert st["acceptance_rate"] > 0.5, st  # int4 copy agrees with its fp32 self
        assert eng.block_manager.num_used_blocks == 0
        assert eng.proposer.bm.num_used_blocks == 0  # the draft's cache is rolled back and freed too


def test_sampling_with_ngram_matches_target_distribution_statistically(tiny_model):
    """Many seeded samples of the 2nd token with and without speculation: same distribution."""
    prompt = repetitive_prompts(1)[0]
    params = dict(temperature=1.5, max_tokens=2, ignore_eos=True)
    counts = [{}, {}]
    for which, spec in enumerate([None, "ngram"]):
        eng = make_engine(tiny_model, speculative=spec, num_speculative_tokens=2)
        for seed in range(150):
            *_, o = eng.generate(prompt, SamplingParams(seed=seed, **params))
            counts[which][tuple(o.token_ids)] = counts[which].get(tuple(o.token_ids), 0) + 1
    keys = set(counts[0]) | set(counts[1])
    tv = sum(abs(counts[0].get(k, 0) - counts[1].get(k, 0)) for k in keys) / 300
    assert tv < 0.25, tv


def test_rejection_rule_reproduces_target_distribution():
    """Known p (target) and q (draft) on a 5-token vocabulary: the first emitted token must be
    distributed as p, for a drafted token sampled from q and for a deterministic proposal."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.5, 0.1, 0.1, 0.1, 0.2]])
    n = 40000
    hist = torch.zeros(5)
    for _ in range(n):
        x = int(torch.multinomial(q[0], 1, generator=g))
        hist[accept_sampling([x], p, q, g)[0]] += 1
    assert (hist / n - p[0]).abs().max() < 0.01
    hist = torch.zeros(5)
    for _ in range(n):
        hist[accept_sampling([1], p, None, g)[0]] += 1  # a one-hot proposal, as n-gram lookup makes
    assert (hist / n - p[0]).abs().max() < 0.01


def test_accept_greedy_rules():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept_greedy([5, 9, 7], [5, 6, 7, 8]) == [5, 6]  # first mismatch replaced by the target
    assert accept_greedy([], [3]) == [3]


def test_ngram_lookup():
    prop = NgramProposer(n_max=3)
    assert prop._lookup([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert prop._lookup([9, 8, 7], 2) == []


def test_draft_with_other_tokenizer_is_refused(tiny_model, fp32_model):
    from tokenizers import Tokenizer, models

    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine
    from localllm.tokenizer import LLMTokenizer, TokenizerInfo

    other = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "<eos>": 2}, merges=[]))
    alien = dataclasses.replace(tiny_model, tokenizer=LLMTokenizer(TokenizerInfo(other, eos_token="<eos>")))
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        LLMEngine(fp32_model, EngineConfig(num_kv_blocks=64, speculative="draft"), draft=alien)


def test_speculation_stats_reach_prometheus_metrics(tiny_model):
    from localllm.server.metrics import ServerMetrics, parse

    eng = make_engine(tiny_model, speculative="ngram")
    run_all(eng, repetitive_prompts(5), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    st = eng.cache_stats()
    m = parse(ServerMetrics().render(st, {}))
    assert m["localllm_spec_proposed_tokens_total"] == st["speculative"]["proposed"] > 0
    assert m["localllm_spec_accepted_tokens_total"] == st["speculative"]["accepted"]
    plain = parse(ServerMetrics().render(make_engine(tiny_model).cache_stats(), {}))
    assert "localllm_spec_proposed_tokens_total" not in plain


def test_adaptive_k_turns_speculation_off_when_it_does_not_pay_and_probes_again():
    from localllm.engine.speculative import AdaptiveK

    ak = AdaptiveK(k_max=4, probe_every=5)
    for k, seconds in ((0, 1.0), (1, 1.6), (2, 2.2), (3, 2.8), (4, 3.4)):  # verify rows are expensive here
        ak.observe(k, seconds)
    assert ak.cost(2) == pytest.approx(2.2)
    ak.update("r", proposed=4, accepted=0)
    ak.update("r", proposed=2, accepted=0)  # acceptance ~0.25: 1.33 tokens for 1.6x the time
    assert ak.choose("r", 1) == 0
    assert [ak.choose("r", 1) for _ in range(5)] == [0, 0, 0, 0, 1]  # a probe with k=1 every 5 steps
    for _ in range(6):
        ak.update("good", proposed=4, accepted=4)
    assert ak.choose("good", 1) == 4  # acceptance ~1: 5 tokens for 3.4x the time
    cheap = AdaptiveK(k_max=4)
    for k in range(5):
        cheap.observe(k, 1.0 + 0.05 * k)
    cheap.update("m", proposed=4, accepted=2)
    assert 1 <= cheap.choose("m", 1) <= 4 and cheap.choose("m", 32) == 0  # big batches never speculate
    assert AdaptiveK.expected_tokens(0.0, 4) == 1.0 and AdaptiveK.expected_tokens(1.0, 4) == 5.0


def test_ngram_with_logit_bias_is_token_identical(tiny_model):
    """A logit_bias shifts the target's logits in verification as in plain decoding: the greedy
    tokens with speculation equal those without, and a banned token never comes out."""
    reqs = repetitive_prompts(3)
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    banned = alone(tiny_model, reqs[:1], free)[0][0]
    params = dataclasses.replace(free, logit_bias={banned: -100.0})
    eng = make_engine(tiny_model, speculative="ngram", num_speculative_tokens=4)
    out = run_all(eng, reqs, params)
    assert out == alone(tiny_model, reqs, params)
    assert out[0][0] != banned and all(banned not in o for o in out)
    assert eng.cache_stats()["speculative"]["proposed"] > 0
