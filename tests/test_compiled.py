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


@pytest.fixture(autouse=True)
def package_dir(tmp_path_factory, monkeypatch):
    """Packages of the temporary test model go to a temporary home, not ~/.cache."""
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path_factory.getbasetemp() / "localllm-home"))


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
    from safetensors import safe_open

    from localllm.model.loader import load_model

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    first = load_model(gguf_path, "auto")
    files = list((tmp_path / "converted").glob("*.safetensors"))
    assert len(files) == 1
    second = load_model(gguf_path, "auto")
    assert second.model.layers[0].qkv.dense_mapped  # really read from the cache
    ref = int4_model.model.state_dict()
    for m in (first.model, second.model):
        sd = m.state_dict()
        assert sd.keys() == ref.keys()
        assert all(torch.equal(sd[k], ref[k]) for k in ref)
    def same(a, b):
        ta, tb = a.kernel_tensors(), b.kernel_tensors()
        return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)

    assert same(second.model.head.fast, int4_model.model.head.fast)
    files[0].write_bytes(b"not a safetensors file")
    third = load_model(gguf_path, "auto")
    assert same(third.model.layers[3].qkv, int4_model.model.layers[3].qkv)
    with safe_open(str(files[0]), "pt") as f:  # rewritten
        assert "3.qkv.group" in f.keys()


def test_package_is_reused_by_a_later_process(tiny_int4, monkeypatch):
    """A second CompiledDecode (as in a new process) loads the package from disk instead of
    compiling again; a stale package of the same weights is removed when one is built."""
    req = prompts(1, seed=9)
    path = compiled.package_path(tiny_int4.model, "b1")
    stale = path.with_name(path.name.rsplit("-", 1)[0] + "-000000000000.pt2")
    if path.exists():  # built by an earlier test: build again so the clean-up runs
        path.unlink()
    stale.write_bytes(b"old")
    step = compiled.enable(tiny_int4.model)
    try:
        first = run_all(make_engine(tiny_int4), req)
    finally:
        compiled.disable(tiny_int4.model)
    assert step.calls > 0 and step.failed is None and path.is_file() and not stale.exists()

    def no_build(*a, **k):
        raise AssertionError("compiled again")

    monkeypatch.setattr(compiled, "build_package", no_build)
    step = compiled.enable(tiny_int4.model)
    try:
        again = run_all(make_engine(tiny_int4), req)
    finally:
        compiled.disable(tiny_int4.model)
    assert step.failed is None and step.calls > 0
    assert again == first


def test_speculation_pauses_while_decode_is_compiled(tiny_int4, caplog):
    """Verify steps would run eagerly (slower than the compiled step, and not token-identical at
    near-ties), so a speculative engine decodes through the package alone and says so."""
    reqs = prompts(2, seed=11)
    step = compiled.enable(tiny_int4.model)
    try:
        plain = run_all(make_engine(tiny_int4), reqs)
        eng = make_engine(tiny_int4, speculative="ngram")
        with caplog.at_level("WARNING", logger="localllm.engine.engine"):
            spec = run_all(eng, reqs)
    finally:
        compiled.disable(tiny_int4.model)
    assert step.failed is None
    assert spec == plain
    assert eng.cache_stats()["speculative"]["proposed"] == 0
    assert "speculative decoding is paused" in caplog.text
    assert eng._speculating()  # without the compiled step the same engine speculates again
