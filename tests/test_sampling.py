"""The sampler's fast paths against their plain definitions."""

import pytest
import torch

from localllm.sampling import SamplingParams, _top_p, draw, filter_probs


def top_p_by_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition: sort everything, keep a token while the mass before it is <= top_p."""
    sorted_p, order = probs.sort(descending=True)
    drop = sorted_p.cumsum(-1) - sorted_p > top_p
    return probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 8.0])  # peaked .. nearly flat (past 256 candidates)
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_equals_full_sort(temperature, top_p):
    g = torch.Generator().manual_seed(int(temperature * 10) + int(top_p * 1000))
    probs = torch.softmax(torch.randn(5000, generator=g) * 4 / temperature, -1)
    got = _top_p(probs, top_p)
    assert torch.equal(got, top_p_by_sort(probs, top_p))
    assert got.sum() >= min(top_p, probs.sum()) - 1e-6


def test_top_p_small_vocabulary_and_boundary():
    probs = torch.tensor([0.5, 0.3, 0.2])
    assert torch.equal(_top_p(probs, 0.5), torch.tensor([0.5, 0.3, 0.0]))  # mass before the 2nd is 0.5
    assert torch.equal(_top_p(probs, 0.4), torch.tensor([0.5, 0.0, 0.0]))


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


def test_filter_probs_combinations_match_plain_torch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3000, generator=g) * 3
    params = SamplingParams(temperature=0.7, top_k=100, top_p=0.8, min_p=0.02)
    x = logits / 0.7
    x = x.masked_fill(x < x.topk(100).values[-1], float("-inf"))
    ref = top_p_by_sort(torch.softmax(x, -1), 0.8)
    ref = ref.masked_fill(ref < 0.02 * ref.max(), 0.0)
    assert torch.allclose(filter_probs(logits, params), ref / ref.sum(), atol=0, rtol=1e-6)
