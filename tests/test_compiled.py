"""The compiled decode step (localllm.model.compiled) gives the eager path's tokens.

CI-cheap: a 2-layer int4 model, so the cold compile takes seconds. The same check on the real
30-layer model (a 60-300 s cold compile on 2 cores) is `python bench/check_compiled.py`.
"""

import pytest
import torch
from conftest import make_engine
from test_engine import GREEDY, prompts, run_all

from localllm.model import compiled
from localllm.sampling import SamplingParams


@pytest.fixture(scope="module")
def tiny_int4(tiny_model):
    from localllm.model.loader import load_model

    loaded = load_model(tiny_model.source, "int4")
    assert "int4" in loaded.precision
    return loaded


def test_compiled_decode_equals_eager_alone_and_batched(tiny_int4):
    reqs = prompts(4, seed=3)
    eager_alone = [run_all(make_engine(tiny_int4), [p])[0] for p in reqs]
    eager_batched = run_all(make_engine(tiny_int4), reqs)
    assert eager_batched == eager_alone
    step = compiled.enable(tiny_int4.model)
    try:
        got_alone = [run_all(make_engine(tiny_int4), [p])[0] for p in reqs]
        calls_alone = step.calls
        got_batched = run_all(make_engine(tiny_int4, num_kv_blocks=300), reqs)  # another cache size
    finally:
        compiled.disable(tiny_int4.model)
    assert step.failed is None
    assert calls_alone == len(reqs) * (GREEDY.max_tokens - 1)  # every decode step went through the graph
    assert step.calls > calls_alone
    assert got_alone == eager_alone
    assert got_batched == eager_alone


def test_compiled_step_serves_sampling_and_logprobs(tiny_int4):
    """Non-greedy requests use the graph's hidden states with the eager sampler."""
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True, logprobs=2)
    reqs = prompts(2, seed=4)
    ref = run_all(make_engine(tiny_int4), reqs, params)
    step = compiled.enable(tiny_int4.model)
    try:
        eng = make_engine(tiny_int4)
        got = run_all(eng, reqs, params)
    finally:
        compiled.disable(tiny_int4.model)
    assert step.calls > 0 and step.failed is None
    assert got == ref


def test_conversion_cache_gives_the_same_model(gguf_path, int4_model, tmp_path, monkeypatch):
    """A second load reads the converted tensors back (no repack); every buffer is identical, and a
    corrupt cache file is converted again instead of failing."""
    from localllm.model.loader import ConvertCache, load_model

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    first = load_model(gguf_path, "auto")
    cache = ConvertCache(gguf_path)
    assert cache.hit and cache.path.is_relative_to(tmp_path)
    second = load_model(gguf_path, "auto")
    ref = int4_model.model.state_dict()
    for m in (first.model, second.model):
        sd = m.state_dict()
        assert sd.keys() == ref.keys()
        assert all(torch.equal(sd[k], ref[k]) for k in ref)
    assert torch.equal(second.model.head.fast.packed, int4_model.model.head.fast.packed)
    cache.path.write_bytes(b"not a safetensors file")
    third = load_model(gguf_path, "auto")
    assert torch.equal(third.model.layers[3].qkv.packed, int4_model.model.layers[3].qkv.packed)
    assert ConvertCache(gguf_path).hit  # rewritten
