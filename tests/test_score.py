"""LLMEngine.score: the logits of every position of a token sequence, through the runner's paged
forward (chunked like a long prefill), equal one plain forward of the model; its blocks are freed."""

import pytest
import torch
from conftest import make_engine

from localllm.quant.calib_text import EVAL

T = 320


@pytest.fixture(scope="module")
def ids(fp32_model) -> list[int]:
    return fp32_model.tokenizer.encode("\n\n".join(EVAL))[:T]


def plain_logits(loaded, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """LlamaModel.forward over the sequence on a cache of its own: at once, or `chunk` tokens at a
    time, each chunk attending to the cached ones."""
    from localllm.model.attention import AttnMeta

    model, n, bs = loaded.model, len(ids), 16
    nb = -(-n // bs)
    caches = model.new_kv_cache(nb + 1, bs, loaded.kv_dtype)
    table = torch.arange(1, nb + 1).view(1, -1)
    out = []
    for start in range(0, n, chunk or n):
        end = min(n, start + (chunk or n))
        k = end - start
        pos = torch.arange(start, end)
        meta = AttnMeta(bs + pos, table, torch.tensor([0, k]), torch.tensor([end]), k == 1, [k], [end])
        out.append(model.logits(model(torch.tensor(ids[start:end]), pos, meta, caches)).float())
    return torch.cat(out)


@pytest.mark.parametrize("which, budget", [("fp32", 2048), ("fp32", 64), ("int4", 2048), ("int4", 64)])
def test_score_equals_a_plain_forward(fp32_model, int4_model, ids, which, budget):
    """Chunked by the batch budget as a prefill is, each chunk attending to the earlier ones through
    the paged cache. fp32 equals one forward of the whole sequence; int4 (16-bit KV cache, int4
    kernels below 160 rows) equals the model's forward over the same chunks."""
    loaded = fp32_model if which == "fp32" else int4_model
    eng = make_engine(loaded, max_num_batched_tokens=budget)
    got = eng.score(ids)
    want = plain_logits(loaded, ids, None if which == "fp32" else budget)
    assert got.shape == (T, loaded.config.vocab_size) and got.dtype == torch.float32
    assert (got - want).abs().max().item() < 1e-4
    assert eng.block_manager.num_used_blocks == 0
    eng.block_manager.check_invariants([])
    assert torch.equal(eng.score(ids), got)  # again: every row computed again, none from the prefix cache
    assert eng.block_manager.num_used_blocks == 0


def test_score_beside_a_live_request_and_limits(fp32_model, ids):
    from localllm.engine.engine import ContextLengthError
    from localllm.sampling import SamplingParams

    eng = make_engine(fp32_model, num_kv_blocks=40, max_model_len=512)
    rid = eng.add_request(ids[:40], SamplingParams(temperature=0, max_tokens=4))
    eng.step()
    used = eng.block_manager.num_used_blocks
    assert used > 0
    got = eng.score(ids[:200])
    assert (got - plain_logits(fp32_model, ids[:200])).abs().max().item() < 1e-4
    assert eng.block_manager.num_used_blocks == used  # the live request keeps its blocks, ours are gone
    outs = [o for _ in range(8) for o in eng.step() if o.request_id == rid]
    assert outs and outs[-1].finished
    with pytest.raises(ContextLengthError):
        eng.score(ids[:1] * 513)
    with pytest.raises(ValueError):
        eng.score([])
