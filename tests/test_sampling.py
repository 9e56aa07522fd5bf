"""The sampler's fast paths against their plain definitions."""

import pytest
import torch

from localllm.sampling import (
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    SamplingError,
    SamplingParams,
    apply_logit_bias,
    draw,
    filter_probs,
    generator_seed,
    nucleus,
    sample_row,
)
from localllm_kernels import cpu_sampler


@pytest.fixture(params=["native", "torch"])
def kernel(request, monkeypatch):
    """Each test twice: with sampler.cpp's pass over the row, and with the torch ops it replaces."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_sampler, "load", lambda: False)
    else:
        assert cpu_sampler.load(), "the sampler kernel must build here"
    return request.param


def top_p_by_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition: sort everything, keep a token while the mass before it is <= top_p."""
    sorted_p, order = probs.sort(descending=True)
    drop = sorted_p.cumsum(-1) - sorted_p > top_p
    return probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))


def reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p as dense torch ops over the whole vocabulary."""
    x = logits / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        x = x.masked_fill(x < x.topk(params.top_k).values[-1], float("-inf"))
    p = torch.softmax(x, -1)
    if params.top_p < 1:
        p = top_p_by_sort(p, params.top_p)
    if params.min_p > 0:
        p = p.masked_fill(p < params.min_p * p.max(), 0.0)
    return p / p.sum()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 8.0])  # peaked .. nearly flat (past 256 candidates)
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_equals_full_sort(temperature, top_p, kernel):
    g = torch.Generator().manual_seed(int(temperature * 10) + int(top_p * 1000))
    logits = torch.randn(5000, generator=g) * 4
    params = SamplingParams(temperature=temperature, top_p=top_p)
    ref = reference(logits, params)
    idx, probs = nucleus(logits, params)
    assert set(idx.tolist()) == set(ref.nonzero().flatten().tolist())
    assert (probs[:-1] >= probs[1:]).all()  # most likely first
    torch.testing.assert_close(probs, ref[idx], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(filter_probs(logits, params), ref, rtol=1e-5, atol=1e-7)


def test_flat_rows_of_a_small_vocabulary_reach_the_last_tier(kernel):
    """A vocabulary under 4096 tokens whose candidates fall short of top_p: the partition tier
    ranks the whole row (its k must stay inside the row) and the nucleus is the definition's."""
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(7))
    params = SamplingParams(temperature=8.0, top_p=0.999)
    ref = reference(logits, params)
    idx, probs = nucleus(logits, params)
    assert set(idx.tolist()) == set(ref.nonzero().flatten().tolist())
    torch.testing.assert_close(probs, ref[idx], rtol=1e-5, atol=1e-7)


def test_top_p_small_vocabulary_and_boundary(kernel):
    logits = torch.tensor([0.0, float("-inf"), 0.0])  # probabilities 0.5, 0, 0.5: exact in binary
    idx, probs = nucleus(logits, SamplingParams(temperature=1.0, top_p=0.5))  # mass before the 2nd: 0.5
    assert sorted(idx.tolist()) == [0, 2] and probs.tolist() == [0.5, 0.5]
    assert len(nucleus(logits, SamplingParams(temperature=1.0, top_p=0.4))[0]) == 1


@pytest.mark.parametrize("kw", [dict(top_k=100, top_p=0.8, min_p=0.02), dict(top_k=7), dict(min_p=0.1),
                                dict(top_k=1000, top_p=0.99), dict(top_p=0.3, min_p=0.5), dict()])
def test_filter_combinations_match_plain_torch(kw, kernel):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3000, generator=g) * 3
    params = SamplingParams(temperature=0.7, **kw)
    ref = reference(logits, params)
    torch.testing.assert_close(filter_probs(logits, params), ref, rtol=1e-5, atol=1e-7)


def test_masked_logits_are_never_drawn(kernel):
    logits = torch.randn(2000, generator=torch.Generator().manual_seed(2))
    logits[logits.argmax()] = float("-inf")  # min_tokens masks end-of-sequence ids this way
    for kw in (dict(top_p=0.95), dict(), dict(top_k=5)):
        p = filter_probs(logits, SamplingParams(temperature=1.0, **kw))
        assert p[logits == float("-inf")].sum() == 0 and abs(float(p.sum()) - 1) < 1e-5


def test_sample_row_follows_the_nucleus():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 3.0])
    params = SamplingParams(temperature=1.0, top_p=0.8)
    ref = reference(logits, params)
    g = torch.Generator().manual_seed(3)
    n = 20000
    hist = torch.zeros(5)
    for _ in range(n):
        hist[sample_row(logits, params, g)] += 1
    assert hist[ref == 0].sum() == 0
    assert (hist / n - ref).abs().max() < 0.015


@pytest.mark.parametrize("V", [1, 15, 16, 17, 49152 + 7])
def test_softmax_top_kernel_against_torch(V):
    assert cpu_sampler.load()
    g = torch.Generator().manual_seed(V)
    x = torch.randn(V, generator=g) * 5
    if V > 2:
        x[1] = float("-inf")
    inv_t, span = 1 / 0.7, 8.0
    idx, stats = torch.ops.localllm.softmax_top(x, inv_t, span)
    m = x.max()
    assert stats[0] == m
    torch.testing.assert_close(stats[1], torch.exp((x.double() - m) * inv_t).sum().float(), rtol=1e-6, atol=0)
    assert idx.tolist() == (x >= m - span / inv_t).nonzero()[:, 0].tolist()


def test_draw_follows_the_distribution_and_never_picks_zeros():
    p = torch.tensor([0.0, 0.1, 0.0, 0.4, 0.2, 0.3, 0.0])
    g = torch.Generator().manual_seed(0)
    n = 20000
    hist = torch.zeros(7)
    for _ in range(n):
        hist[draw(p, g)] += 1
    assert hist[p == 0].sum() == 0
    assert (hist / n - p).abs().max() < 0.015
    # the same seed draws the same tokens
    a = [draw(p, torch.Generator().manual_seed(5)) for _ in range(3)]
    assert a == [draw(p, torch.Generator().manual_seed(5)) for _ in range(3)]


def test_draw_when_the_uniform_rounds_up_to_the_total(monkeypatch):
    p = torch.tensor([0.25, 0.75, 0.0, 0.0])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1.0, dtype=torch.float64))
    assert draw(p, None) == 1  # the last token with mass, not past the end


def test_tiny_temperatures_sample_at_the_floor(kernel):
    """1e-199 overflowed logits / T to inf and the probabilities to NaN (the fuzz test's find):
    a positive temperature below MIN_TEMPERATURE samples at it, never NaN."""
    logits = torch.randn(3000, generator=torch.Generator().manual_seed(4)) * 3
    for kw in (dict(top_p=0.9), dict(), dict(top_k=5)):
        p = filter_probs(logits, SamplingParams(temperature=1e-199, **kw))
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, filter_probs(logits, SamplingParams(temperature=MIN_TEMPERATURE, **kw)))
        assert sample_row(logits, SamplingParams(temperature=1e-199, **kw), None) == int(logits.argmax())


def test_seeds_use_their_full_width():
    assert generator_seed(0) == 0 and generator_seed(2**32 - 1) == 2**32 - 1  # as given
    wide = [generator_seed(s) for s in (2**32, 2**63, -1, -(2**63), 2**64 - 1)]
    assert len(set(wide + [0])) == len(wide) + 1 and all(0 <= s < 2**32 for s in wide)
    for bad in (2**64, -(2**63) - 1):
        with pytest.raises(SamplingError, match="seed"):
            SamplingParams(seed=bad)
    with pytest.raises(SamplingError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=MIN_REPETITION_PENALTY / 2)


@pytest.mark.parametrize("bias", [{1: 101}, {1: -100.5}, {-1: 1.0}, {True: 1.0}, {"1": 1.0}, {1: float("nan")}, [1]])
def test_logit_bias_is_checked(bias):
    with pytest.raises(SamplingError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_logit_bias_is_added_to_the_row():
    row = torch.tensor([0.0, 1.0, 2.0])
    p = SamplingParams(temperature=0, logit_bias={0: 100.0, 2: -5.0})
    assert p.needs_logits and not SamplingParams(temperature=0, logit_bias={}).needs_logits
    assert apply_logit_bias(row, p).tolist() == [100.0, 1.0, -3.0] and row.tolist() == [0.0, 1.0, 2.0]
    assert sample_row(apply_logit_bias(row, p), p, None) == 0
