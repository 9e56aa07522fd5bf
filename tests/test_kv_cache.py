"""The KV cache: 16-bit on the default CPU path (as measured in bench/check_kv.py) and sized for
the contexts asked for, not for free memory."""

import torch
from conftest import make_engine

from localllm.config import EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.model.attention import AttnMeta


def teacher_forced(loaded, ids: list[int], kv_dtype: torch.dtype) -> torch.Tensor:
    """Logits [T-1, V] predicting ids[1:], one decode step each (the whole context read back)."""
    model, n, bs = loaded.model, len(ids), 16
    caches = model.new_kv_cache(n // bs + 2, bs, kv_dtype)
    table = torch.arange(1, n // bs + 2).view(1, -1)
    rows = []
    with torch.inference_mode():
        for p in range(n - 1):
            meta = AttnMeta.captured(table[0, p // bs:p // bs + 1] * bs + p % bs, table, torch.tensor([0, 1]),
                                     torch.tensor([p + 1]))
            rows.append(model.logits(model(torch.tensor([ids[p]]), torch.tensor([p]), meta, caches))[0])
    return torch.stack(rows)


def test_fp16_kv_follows_the_fp32_cache_on_the_real_model(int4_model):
    from localllm.quant.calib_text import EVAL

    assert int4_model.kv_dtype == torch.float16  # the default CPU int4 path
    ids = int4_model.tokenizer.encode("\n\n".join(EVAL))[:160]
    ref = teacher_forced(int4_model, ids, torch.float32)
    got = teacher_forced(int4_model, ids, torch.float16)
    # measured over 599 steps: max |dlogit| 0.033, greedy 599/599, perplexity +0.001%
    assert (got - ref).abs().max().item() < 0.1
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    target = torch.tensor(ids[1:])
    ppl = [torch.nn.functional.cross_entropy(x, target).exp().item() for x in (ref, got)]
    assert abs(ppl[1] / ppl[0] - 1) < 1e-3


def test_fp32_weights_keep_an_fp32_cache(fp32_model):
    assert fp32_model.kv_dtype == torch.float32


def test_cache_holds_the_contexts_asked_for(int4_model):
    blocks_per_context = -(-2048 // 16)
    one = LLMEngine(int4_model, EngineConfig(max_model_len=2048, parallel=1, compile=False))
    assert one.num_blocks == blocks_per_context + 1  # + the null block
    four = LLMEngine(int4_model, EngineConfig(max_model_len=2048, parallel=4, compile=False))
    assert four.num_blocks == 4 * blocks_per_context + 1
    assert make_engine(int4_model, num_kv_blocks=77).num_blocks == 77  # an explicit count wins
    k, _ = one.runner.kv_caches[0]
    assert k.dtype == torch.float16 and k.shape[0] == one.num_blocks
