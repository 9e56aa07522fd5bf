"""Our engine against transformers (fp32) on the same GGUF weights."""

import pytest
import torch
from conftest import CHAT_PROMPTS, chat, make_engine

from localllm.sampling import SamplingParams


@pytest.fixture(scope="module")
def hf(gguf_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    model.eval()
    return model


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain greedy loop with transformers' KV cache, through EOS (no min_new_tokens: that
    masks EOS and changes the answer)."""
    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            r = model(x, past_key_values=past, use_cache=True)
            past = r.past_key_values
            out.append(int(r.logits[0, -1].argmax()))
            x = torch.tensor([[out[-1]]])
    return out


def our_greedy(loaded, messages, n: int) -> tuple[list[int], list[int]]:
    eng = make_engine(loaded)
    ids = eng.encode_prompt(messages)
    *_, last = eng.generate(messages, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return ids, last.token_ids


@pytest.mark.parametrize("prompt", CHAT_PROMPTS)
def test_fp32_greedy_equals_transformers(hf, fp32_model, prompt):
    ids, ours = our_greedy(fp32_model, chat(prompt), 64)
    assert len(ours) == 64
    assert ours == hf_greedy(hf, ids, 64)


def test_fp32_logits_match_transformers(hf, fp32_model):
    eng = make_engine(fp32_model)
    ids = eng.encode_prompt(chat(CHAT_PROMPTS[0]))
    from localllm.engine.sequence import Sequence

    seq = Sequence("x", ids, SamplingParams(), 1)
    eng.block_manager.allocate(seq, len(ids))
    hidden = eng.runner.forward_hidden([seq], [len(ids)])
    ours = fp32_model.model.logits(hidden)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-3


def test_default_int4_path_follows_reference(hf, int4_model):
    """The fast default (lossless int4 repack of Q4_1, bf16 activations) may only flip near-ties:
    teacher-forced on transformers' greedy continuation, its argmax agrees almost everywhere."""
    eng = make_engine(int4_model)
    agree = total = 0
    for prompt in CHAT_PROMPTS:
        ids = eng.encode_prompt(chat(prompt))
        ref = hf_greedy(hf, ids, 32)
        from localllm.engine.sequence import Sequence

        full = ids + ref
        seq = Sequence("t", full, SamplingParams(), 1)
        eng.block_manager.allocate(seq, len(full))
        hidden = eng.runner.forward_hidden([seq], [len(full)])
        pred = int4_model.model.head.greedy(hidden[len(ids) - 1:-1])
        agree += (pred == torch.tensor(ref)).sum().item()
        total += len(ref)
        eng.block_manager.free_seq(seq)
    assert agree / total >= 0.95, f"{agree}/{total}"
    # and the user-visible answer is the reference answer
    ids, ours = our_greedy(int4_model, chat(CHAT_PROMPTS[0]), 8)
    assert ours == hf_greedy(hf, ids, 8)


def test_tokenizer_matches_transformers(gguf_path, fp32_model):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok = fp32_model.tokenizer
    tricky = [
        "Hello world", "  leading and   multiple   spaces\n\n\ttabs\r\nCRLF", "12345 and 3.14159, 2024!",
        "don't, I'll, we've, HELLO's WORLD'S", "naïve café — 東京 🚀 emoji 👩‍👩‍👧", "def f(x):\n    return x**2  # code",
        "<|im_start|>user\nhi<|im_end|>\n", "special <|endoftext|> inside text", "   ", "a\r\nb", "",
    ]
    for s in tricky:
        assert tok.encode(s) == ref.encode(s, add_special_tokens=False), s
        assert tok.decode(tok.encode(s), skip_special_tokens=False) == s


def test_hf_export_loads_and_gives_same_tokens(hf_export_dir, fp32_model):
    from localllm.model.loader import load_model

    loaded = load_model(hf_export_dir, "float32")
    assert loaded.config == fp32_model.config
    msgs = chat(CHAT_PROMPTS[1])
    a = our_greedy(loaded, msgs, 24)
    b = our_greedy(fp32_model, msgs, 24)
    assert a == b
