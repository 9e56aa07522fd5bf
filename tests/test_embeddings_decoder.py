"""Decoders as embedders and rerankers on our decoder forward, against transformers on the same
weights: a tiny random Qwen3-Embedding (a Qwen3 decoder saved as sentence-transformers saves it,
last-token pooling, normalised, an instruction prompt) from the HF directory and from a GGUF under
llama.cpp's qwen3 names with pooling_type last, also against sentence-transformers; a tiny random
Qwen3-Reranker (p(yes) at the last token of its model card's prompt); the embedded SmolLM2 chat
model's embedding (its last token's final hidden state, normalised, as Ollama's llama.cpp
engine returns it)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from embed_reference import SENTENCES, qwen3_rerank_reference, st_model, tiny_qwen3_reranker
from test_families import TINY, gguf_tensors

from localllm.engine.embedder import Embedder
from localllm.model.encoder_loader import describe_encoder, encoder_kind, load_encoder

transformers = pytest.importorskip("transformers")

TEXTS = SENTENCES[:10] + [SENTENCES[45]]  # the last is longer than the 128-token max_seq_length: cut
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
EOS = "<|endoftext|>"  # id 0 in SmolLM2's vocabulary; Qwen3-Embedding's tokenizer appends its own


@pytest.fixture(scope="module")
def smol_tokenizer(gguf_path):
    from localllm.model.gguf_weights import GGUFWeights

    return GGUFWeights(gguf_path).tokenizer()


def write_qwen3_embedder(out: Path, tokenizer) -> tuple:
    """A random 2-layer Qwen3Model saved as Qwen3-Embedding ships: config.json saying
    Qwen3ForCausalLM, weights without the `model.` prefix, a tokenizer that appends EOS, and
    sentence-transformers files (last-token pooling, Normalize, max_seq_length, prompts)."""
    from tokenizers.processors import TemplateProcessing

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**TINY, rope_theta=1e6, tie_word_embeddings=True)
    model = transformers.Qwen3Model(cfg).eval()
    with torch.no_grad():  # larger than the init's 0.02, so the layers matter next to the embedding
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(20)
    model.save_pretrained(out, safe_serialization=True)
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**raw, "architectures": ["Qwen3ForCausalLM"]}))
    tok = tokenizer.tok.__class__.from_str(tokenizer.tok.to_str())
    tok.post_processor = TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, tok.token_to_id(EOS))])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "pad_token": EOS, "padding_side": "left",
        "model_max_length": 1024}))
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
        "pooling_mode_lasttoken": True, "include_prompt": True}))
    (out / "2_Normalize").mkdir()
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))
    (out / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {"query": QUERY_PROMPT, "document": ""}, "default_prompt_name": None,
        "similarity_fn_name": "cosine"}))
    return model, out


def write_qwen3_gguf(model, out: Path, tokenizer_gguf: Path) -> Path:
    """The embedder's tensors under llama.cpp's qwen3 names, SmolLM2's tokenizer metadata with EOS
    <|endoftext|> appended (add_eos_token) and pooling_type 3 (last), as llama.cpp's converter
    writes a Qwen3-Embedding GGUF."""
    import gguf

    from localllm.model.gguf import read_gguf

    cfg, meta = model.config, read_gguf(tokenizer_gguf).metadata
    w = gguf.GGUFWriter(str(out), "qwen3")
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_add_bos_token(False)
    w.add_eos_token_id(0)
    w.add_add_eos_token(True)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_pooling_type(gguf.PoolingType.LAST)
    state = {"model." + k: v for k, v in model.state_dict().items()}
    for name, data in gguf_tensors(model, state, arch="qwen3"):
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def qwen3_embedder(tmp_path_factory, smol_tokenizer, gguf_path):
    out = tmp_path_factory.mktemp("qwen3-embedding")
    model, hf_dir = write_qwen3_embedder(out / "hf", smol_tokenizer)
    return model, hf_dir, write_qwen3_gguf(model, out / "qwen3-embedding.gguf", gguf_path)


def reference_vectors(model, ids: list[list[int]]) -> torch.Tensor:
    """transformers' last hidden state at each input's last token, one input at a time, normalised."""
    with torch.no_grad():
        rows = [model(input_ids=torch.tensor([x])).last_hidden_state[0, -1] for x in ids]
    return F.normalize(torch.stack(rows), dim=-1)


def test_qwen3_embedder_matches_transformers_and_sentence_transformers(qwen3_embedder):
    model, hf_dir, _ = qwen3_embedder
    assert encoder_kind(hf_dir) == "embedding"
    emb = Embedder(load_encoder(hf_dir))
    assert (emb.loaded.pooling.mode, emb.loaded.pooling.normalize, emb.max_model_len) == ("last", True, 128)
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    for prompt_name, prefix in ((None, ""), ("query", QUERY_PROMPT)):
        enc = emb.tokenize(TEXTS, prompt_name=prompt_name)
        ref_ids = [tok(prefix + t, truncation=True, max_length=128)["input_ids"] for t in TEXTS]
        assert enc.ids == ref_ids and all(x[-1] == 0 for x in enc.ids)  # EOS appended, kept when cut
        assert len(enc.ids[-1]) == 128
        ours = emb.embed(enc)
        assert (ours - reference_vectors(model, ref_ids)).abs().max().item() < 1e-5
        st = torch.as_tensor(st_model(hf_dir).encode(TEXTS, prompt_name=prompt_name, batch_size=4,
                                                     convert_to_numpy=True))
        assert F.cosine_similarity(ours, st).min().item() >= 0.9999
    with pytest.raises(ValueError, match="'passage' is not one of this model's prompts"):
        emb.tokenize(["x"], prompt_name="passage")
    info = describe_encoder(hf_dir)
    assert (info["kind"], info["pooling"], info["embedding_length"], info["context_length"]) == \
        ("embedding", "last, normalized", 64, 128)


def test_qwen3_embedder_from_gguf_matches_transformers(qwen3_embedder):
    model, hf_dir, gguf_file = qwen3_embedder
    assert encoder_kind(gguf_file) == "embedding"
    emb = Embedder(load_encoder(gguf_file))
    assert (emb.loaded.pooling.mode, emb.loaded.pooling.normalize) == ("last", True)
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    enc = emb.tokenize(TEXTS[:-1])
    assert enc.ids == [tok(t)["input_ids"] for t in TEXTS[:-1]]  # llama.cpp's add_eos_token: EOS appended
    ours = emb.embed(enc)
    assert (ours - reference_vectors(model, enc.ids)).abs().max().item() < 1e-5
    assert describe_encoder(gguf_file)["pooling"] == "last, normalized"


def test_packed_decoder_batch_equals_one_at_a_time(qwen3_embedder):
    """Causal attention stays inside each input of a packed forward (short inputs on the paged
    kernel, long ones through SDPA)."""
    emb = Embedder(load_encoder(qwen3_embedder[1]))
    texts = SENTENCES[:6] + [SENTENCES[43]]
    together = emb.embed(emb.tokenize(texts))
    alone = torch.cat([emb.embed(emb.tokenize([t])) for t in texts])
    assert (together - alone).abs().max().item() < 1e-5


def test_qwen3_reranker_matches_transformers(tmp_path, smol_tokenizer):
    """p(yes) of Qwen3-Reranker's prompt, as its model card computes it with transformers."""
    model = tiny_qwen3_reranker(tmp_path, smol_tokenizer)
    emb = Embedder(load_encoder(tmp_path, kind="rerank"))
    query, docs = "What is the capital of France?", SENTENCES[:6] + [SENTENCES[47]]
    scores = emb.score(emb.tokenize_pairs([(query, d) for d in docs]))
    ref = qwen3_rerank_reference(model, tmp_path, query, docs, emb.max_model_len)
    assert np.allclose(scores.numpy(), ref, atol=1e-5), (scores, ref)
    assert len(set(np.round(ref, 4))) > 1  # the documents are told apart
    # the same checkpoint asked for embeddings is a chat model (no pooling files): its last token's
    # final-norm hidden state, normalised (the embedded SmolLM2's test below is the slow one)
    assert encoder_kind(tmp_path) is None
    chat = Embedder(load_encoder(tmp_path, kind="embedding"))
    enc = chat.tokenize(docs)
    with torch.no_grad():
        rows = [model(input_ids=torch.tensor([x]), output_hidden_states=True).hidden_states[-1][0, -1]
                for x in enc.ids]
    assert (chat.embed(enc) - F.normalize(torch.stack(rows), dim=-1)).abs().max().item() < 1e-5


@pytest.mark.slow  # two fp32 loads of the 135M model (ours, transformers')
def test_chat_model_embedding_is_its_last_hidden_state(gguf_path, hf_export_dir):
    """The embedded SmolLM2 (a chat model, no pooling files) embeds as Ollama's llama.cpp engine
    did: the last token's final-norm hidden state, normalised; transformers on the file's
    dequantized weights."""
    assert encoder_kind(gguf_path) is None
    emb = Embedder(load_encoder(gguf_path, kind="embedding", precision="float32"))
    assert (emb.loaded.pooling.mode, emb.loaded.pooling.normalize, emb.max_model_len) == ("last", True, 4096)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_export_dir, dtype=torch.float32).eval()
    enc = emb.tokenize(TEXTS[:4])
    ours = emb.embed(enc)
    with torch.no_grad():
        rows = [hf(input_ids=torch.tensor([x]), output_hidden_states=True).hidden_states[-1][0, -1] for x in enc.ids]
    assert F.cosine_similarity(ours, torch.stack(rows)).min().item() >= 0.99999
    assert (ours - F.normalize(torch.stack(rows), dim=-1)).abs().max().item() < 1e-4
