"""What the embedding tests compare against: sentences, sentence-transformers on the same files
(loaded once per test run), tiny random BERT checkpoints written by transformers."""

import contextlib
import functools
import json
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

# 50 sentences of every length from one word to far past the model's 256 tokens (cut there)
SENTENCES = [
    "Hello", "The cat sat on the mat.", "Paris is the capital of France.", "What is the capital of Germany?",
    "Berlin is the capital of Germany.", "I love machine learning.", "Deep learning models need lots of data.",
    "The stock market fell sharply on Monday.", "Interest rates were raised by the central bank.",
    "She plays the violin beautifully.", "He scored two goals in the final match.",
    "The recipe calls for two cups of flour and a pinch of salt.", "Quantum computers use qubits.",
    "A lighthouse guided the ships through the storm.", "Rain is expected tomorrow afternoon.",
    "Photosynthesis converts sunlight into chemical energy.", "The museum opens at nine in the morning.",
    "My laptop battery drains too quickly.", "Please restart the server after the update.",
    "The Great Wall of China is visible from space, or so the myth goes.",
    "Elephants are the largest land animals.", "The train to Boston was delayed by an hour.",
    "Vaccines train the immune system to recognise pathogens.", "He forgot his umbrella at the cafe.",
    "The novel was translated into forty languages.", "Solar panels are becoming cheaper every year.",
    "A good night's sleep improves memory.", "The company reported record profits this quarter.",
    "Bees communicate by dancing.", "Mount Everest is the highest mountain above sea level.",
    "¿Dónde está la biblioteca?", "Das Wetter ist heute schön.", "東京は日本の首都です。",
    "Emoji test 🚀🔥 with symbols & punctuation!!!", "numbers 3.14159 2.71828 1.41421 and 42",
    "def add(a, b): return a + b", "SELECT name FROM users WHERE age > 30;",
    "The mitochondria is the powerhouse of the cell.", "Jazz originated in New Orleans.",
    "Water boils at 100 degrees Celsius at sea level.",
    "An apple a day keeps the doctor away, according to an old proverb that many still repeat.",
    "The committee will meet again next week to discuss the budget proposal in more detail.",
    " ".join(["The history of the Roman Empire spans many centuries of conquest and decline."] * 3),
    " ".join(["Machine translation has improved dramatically with neural networks."] * 5),
    " ".join(["Climate change affects weather patterns, sea levels and ecosystems worldwide."] * 8),
    " ".join(["word"] * 200), " ".join(["token"] * 300), " ".join(["A very long sentence keeps going."] * 60),
    "Short.", "The end.",
]
assert len(SENTENCES) == 50



@contextlib.contextmanager
def default_linears():
    """torch's nn.Linear, while in the block, as the BERT-family encoders' default ("auto") computes
    a linear on this CPU: with the weights rounded to bf16 where it has bf16 dot products, and the
    inputs too where that is AVX512-BF16 without the AMX tile unit (which splits them in two parts,
    ~fp32); unchanged on other CPUs. A reference model run in it does our arithmetic, so ours
    must match it to fp32 summation order."""
    from localllm_kernels import cpu_bf16x3

    amx, dot = cpu_bf16x3.available(), cpu_bf16x3.dot_available()
    if not (amx or dot):
        yield
        return
    plain = torch.nn.Linear.forward

    def rounded(self, x):
        x = x if amx else x.to(torch.bfloat16).float()
        return F.linear(x, self.weight.to(torch.bfloat16).float(), self.bias)

    torch.nn.Linear.forward = rounded
    try:
        yield
    finally:
        torch.nn.Linear.forward = plain


@functools.lru_cache(maxsize=2)
def st_model(path: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu")


def st_vectors(path: Path, texts: list[str]) -> torch.Tensor:
    return torch.as_tensor(st_model(path).encode(texts, batch_size=16, convert_to_numpy=True))


def tiny_bert(tmp: Path, minilm_dir: Path, classifier: bool, family: str = "bert") -> Path:
    """A random 2-layer BERT (family "bert") or XLM-RoBERTa ("xlm-roberta") written by
    transformers, with all-MiniLM's tokenizer; the embedder gets sentence-transformers files
    asking for CLS pooling without normalisation (BERT) or mean pooling (XLM-R)."""
    import transformers

    torch.manual_seed(0)
    shape = dict(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, max_position_embeddings=130, num_labels=1)
    if family == "bert":
        cfg = transformers.BertConfig(**shape)
        cls = transformers.BertForSequenceClassification if classifier else transformers.BertModel
    else:  # one token type, positions from pad_token_id + 1 = 2
        cfg = transformers.XLMRobertaConfig(**shape, type_vocab_size=1, pad_token_id=1)
        cls = transformers.XLMRobertaForSequenceClassification if classifier else transformers.XLMRobertaModel
    model = cls(cfg).eval()
    model.save_pretrained(tmp, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(minilm_dir / f, tmp / f)
    if not classifier:
        (tmp / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (tmp / "1_Pooling").mkdir(parents=True)
        cls_pool = family == "bert"
        (tmp / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                    "pooling_mode_cls_token": cls_pool,
                                                                    "pooling_mode_mean_tokens": not cls_pool}))
        (tmp / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 100}))
    return tmp


def tiny_qwen3_reranker(out: Path, tokenizer, seed: int = 1):
    """A random 2-layer Qwen3ForCausalLM (Qwen3-Reranker's architecture) written by transformers,
    with `tokenizer` (an LLMTokenizer: SmolLM2's); weights scaled up from the init's 0.02 so the
    layers, not the embedding alone, decide the logits."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=1e6,
                                   tie_word_embeddings=True)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(20)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_hf(out)
    return model


def qwen3_rerank_reference(model, path: Path, query: str, docs: list[str], max_len: int) -> list[float]:
    """p(yes) per document as Qwen3-Reranker's model card computes it with transformers: its prefix,
    the formatted pair (cut to what is left of max_len), its suffix; softmax over the last
    position's (no, yes) logits."""
    import transformers

    from localllm.model.encoder_loader import (
        QWEN3_RERANK_INSTRUCTION,
        QWEN3_RERANK_PREFIX,
        QWEN3_RERANK_SUFFIX,
    )

    tok = transformers.AutoTokenizer.from_pretrained(path)
    prefix = tok.encode(QWEN3_RERANK_PREFIX, add_special_tokens=False)
    suffix = tok.encode(QWEN3_RERANK_SUFFIX, add_special_tokens=False)
    no, yes = tok.convert_tokens_to_ids("no"), tok.convert_tokens_to_ids("yes")
    out = []
    for d in docs:
        body = tok(f"<Instruct>: {QWEN3_RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: {d}",
                   add_special_tokens=False, truncation="longest_first",
                   max_length=max_len - len(prefix) - len(suffix))["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prefix + body + suffix])).logits[0, -1]
        out.append(torch.log_softmax(logits[[no, yes]], -1)[1].exp().item())
    return out
