"""Embeddings and reranking through a real plain `localllm serve` (every local model on demand),
called with the official clients, each compared with sentence-transformers' vectors for the same
texts on the same files; a reranker (a tiny random cross-encoder in the HF cache) against
transformers' sequence-classification logits."""

import base64
import os
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from embed_reference import (
    SENTENCES,
    qwen3_rerank_reference,
    st_model,
    st_vectors,
    tiny_bert,
    tiny_qwen3_reranker,
)
from server_proc import ServerProc, openai_client

TEXTS = SENTENCES[:8] + [SENTENCES[46]]  # the last one is longer than the model's 256 tokens: cut
RERANKER = "test-org/tiny-reranker"
QWEN3_RERANKER_REPO = "Qwen/Qwen3-Reranker-0.6B"


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    from localllm.registry import resolve_model

    return resolve_model("all-minilm").local_path


def snapshot(home: Path, repo_id: str) -> Path:
    """An empty snapshot of `repo_id` in the HF cache at `home`, as `pull` lays it out."""
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    commit = "0" * 40
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / "blobs").mkdir()
    return snap


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, minilm_dir, gguf_path) -> Path:
    """An HF cache holding two downloaded models: a tiny random cross-encoder, and a tiny random
    Qwen3 decoder where the registry's qwen3-reranker-0.6b is (its kind comes from the registry)."""
    from localllm.model.gguf_weights import GGUFWeights

    home = tmp_path_factory.mktemp("hf")
    tiny_bert(snapshot(home, RERANKER), minilm_dir, classifier=True)
    tiny_qwen3_reranker(snapshot(home, QWEN3_RERANKER_REPO), GGUFWeights(gguf_path).tokenizer())
    return home


@pytest.fixture(scope="module")
def started(hf_home):
    """The server, starting: the references are computed while it boots."""
    s = ServerProc(env={**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"})
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def reference(started, minilm_dir) -> torch.Tensor:
    return st_vectors(minilm_dir, TEXTS)


@pytest.fixture(scope="module")
def server(started, reference):
    return started.wait_ready()


def cos(a, b) -> torch.Tensor:
    return F.cosine_similarity(torch.as_tensor(np.asarray(a, dtype=np.float32)), b)


def test_openai_client_embeddings(server, reference, minilm_dir):
    client = openai_client(server)
    r = client.embeddings.create(model="all-minilm", input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in r.data] == list(range(len(TEXTS))) and r.model == "all-minilm"
    assert cos([d.embedding for d in r.data], reference).min().item() >= 0.9999
    tok = st_model(minilm_dir).tokenizer
    counts = [min(len(tok(t)["input_ids"]), 256) for t in TEXTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(counts)
    # floats, Matryoshka dimensions (truncated, unit length again), and token ids as input
    r = client.embeddings.create(model="all-minilm", input=TEXTS[:3], encoding_format="float", dimensions=96)
    assert cos([d.embedding for d in r.data], F.normalize(reference[:3, :96], dim=-1)).min().item() >= 0.9999
    assert np.allclose(np.linalg.norm([d.embedding for d in r.data], axis=1), 1, atol=1e-5)
    ids = [tok(t)["input_ids"] for t in TEXTS[:2]]
    r = client.embeddings.create(model="all-minilm", input=ids, encoding_format="float")
    assert cos([d.embedding for d in r.data], reference[:2]).min().item() >= 0.9999
    raw = httpx.post(server.base + "/v1/embeddings", json={"model": "all-minilm", "input": TEXTS[0],
                                                           "encoding_format": "base64"}, timeout=60).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert vec.shape == (384,) and cos([vec], reference[:1]).item() >= 0.9999


def test_ollama_client_embed_and_legacy_embeddings(server, reference):
    import ollama

    client = ollama.Client(host=server.base, timeout=60)
    r = client.embed(model="all-minilm", input=TEXTS)
    assert r.model == "all-minilm" and len(r.embeddings) == len(TEXTS)
    assert cos(r.embeddings, reference).min().item() >= 0.9999
    assert r.prompt_eval_count > len(TEXTS) and r.total_duration >= r.load_duration >= 0
    one = client.embed(model="all-minilm:latest", input=TEXTS[1], dimensions=64)
    assert cos(one.embeddings, F.normalize(reference[1:2, :64], dim=-1)).item() >= 0.9999
    legacy = client.embeddings(model="all-minilm", prompt=TEXTS[2])
    assert cos([legacy.embedding], reference[2:3]).item() >= 0.9999
    with pytest.raises(ollama.ResponseError) as e:  # Ollama's answer to a long input with truncate false
        client.embed(model="all-minilm", input=TEXTS[-1], truncate=False)
    assert e.value.status_code == 400 and "input exceeds maximum context length" in e.value.error


def test_langchain_ollama_and_openai_embeddings(server, reference):
    from langchain_ollama import OllamaEmbeddings
    from langchain_openai import OpenAIEmbeddings

    lo = OllamaEmbeddings(model="all-minilm", base_url=server.base)
    assert cos(lo.embed_documents(TEXTS), reference).min().item() >= 0.9999
    assert cos([lo.embed_query(TEXTS[0])], reference[:1]).item() >= 0.9999
    lc = OpenAIEmbeddings(model="all-minilm", base_url=server.base + "/v1", api_key="unused",
                          check_embedding_ctx_length=False, max_retries=0)
    assert cos(lc.embed_documents(TEXTS), reference).min().item() >= 0.9999
    assert cos([lc.embed_query(TEXTS[3])], reference[3:4]).item() >= 0.9999


def test_capabilities_and_what_each_kind_refuses(server):
    show = httpx.post(server.base + "/api/show", json={"model": "all-minilm"}, timeout=30).json()
    assert show["capabilities"] == ["embedding"] and show["details"]["family"] == "bert"
    assert show["model_info"]["bert.embedding_length"] == 384
    tags = {m["name"]: m for m in httpx.get(server.base + "/api/tags", timeout=30).json()["models"]}
    assert tags["all-minilm"]["capabilities"] == ["embedding"]
    assert tags["smollm2-135m"]["capabilities"] == ["completion"]
    assert tags[RERANKER]["capabilities"] == ["rerank"]
    chat = httpx.post(server.base + "/api/chat", json={"model": "all-minilm", "messages": [
        {"role": "user", "content": "hi"}]}, timeout=30)
    assert chat.status_code == 400 and chat.json()["error"].startswith('"all-minilm" does not support chat')
    gen = httpx.post(server.base + "/api/generate", json={"model": "all-minilm", "prompt": "hi"}, timeout=30)
    assert gen.status_code == 400 and gen.json()["error"].startswith('"all-minilm" does not support generate')
    v1 = httpx.post(server.base + "/v1/chat/completions", json={"model": "all-minilm", "messages": [
        {"role": "user", "content": "hi"}]}, timeout=30)
    assert v1.status_code == 400 and v1.json()["error"]["param"] == "model"
    bad = httpx.post(server.base + "/v1/embeddings", json={"model": "all-minilm", "input": "x", "dimensions": 999},
                     timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dimensions"


def test_rerank_and_score_match_transformers(server, hf_home):
    import transformers

    snap = next((hf_home / "hub").glob("models--test-org*/snapshots/*"))
    query = "What is the capital of France?"
    docs = SENTENCES[:6]
    tok = transformers.AutoTokenizer.from_pretrained(snap)
    hf = transformers.BertForSequenceClassification.from_pretrained(snap).eval()
    batch = tok([query] * len(docs), docs, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        ref = torch.sigmoid(hf(**batch).logits[:, 0]).tolist()
    for path in ("/v1/rerank", "/rerank"):
        r = httpx.post(server.base + path, json={"model": RERANKER, "query": query, "documents": docs, "top_n": 3},
                       timeout=60)
        assert r.status_code == 200, r.text
        res = r.json()["results"]
        best = sorted(range(len(docs)), key=lambda i: -ref[i])[:3]
        assert [x["index"] for x in res] == best
        assert all(abs(x["relevance_score"] - ref[x["index"]]) < 1e-5 for x in res)
        assert all(x["document"]["text"] == docs[x["index"]] for x in res)
    r = httpx.post(server.base + "/rerank", json={"model": RERANKER, "query": query, "return_documents": False,
                                                  "documents": [{"text": d} for d in docs]}, timeout=60).json()
    assert len(r["results"]) == len(docs) and "document" not in r["results"][0]
    s = httpx.post(server.base + "/score", json={"model": RERANKER, "text_1": query, "text_2": docs},
                   timeout=60).json()
    assert [d["index"] for d in s["data"]] == list(range(len(docs)))
    assert max(abs(d["score"] - ref[d["index"]]) for d in s["data"]) < 1e-5
    emb = httpx.post(server.base + "/v1/rerank", json={"model": "all-minilm", "query": "q", "documents": ["d"]},
                     timeout=30)
    assert emb.status_code == 400 and "does not support reranking" in emb.json()["error"]["message"]



@pytest.mark.slow  # loads the 135M chat model in the server (~10-25 s)
def test_chat_model_embeds_as_ollama(server, gguf_path):
    """/api/embed and /v1/embeddings with a chat model: its last token's hidden state, normalised
    (Ollama's llama.cpp engine's answer), from the model as the server loads it (the file's Q4
    weights on our int4 kernel) against the fp32 dequantized weights' (test_embeddings_decoder
    pins those to transformers)."""
    from localllm.engine.embedder import Embedder
    from localllm.model.encoder_loader import load_encoder

    texts = TEXTS[:3]
    r = httpx.post(server.base + "/api/embed", json={"model": "smollm2-135m", "input": texts}, timeout=120)
    assert r.status_code == 200, r.text
    got = torch.tensor(r.json()["embeddings"])
    assert got.shape == (3, 576) and torch.allclose(got.norm(dim=-1), torch.ones(3), atol=1e-5)
    assert r.json()["prompt_eval_count"] > 0
    ref = Embedder(load_encoder(gguf_path, kind="embedding", precision="float32"))
    assert F.cosine_similarity(got, ref.embed(ref.tokenize(texts))).min().item() >= 0.995
    v1 = openai_client(server).embeddings.create(model="smollm2-135m", input=texts[0])
    assert v1.model == "smollm2-135m" and cos(v1.data[0].embedding, got[:1]).item() >= 0.99999
    ps = {m["name"] for m in httpx.get(server.base + "/api/ps", timeout=30).json()["models"]}
    assert "smollm2-135m" in ps  # the embedder twin, listed as the model


def test_qwen3_reranker_on_rerank_and_score(server, hf_home):
    """A decoder reranker (Qwen3-Reranker's architecture, named by the registry) on /v1/rerank,
    /rerank and /score: p(yes) of its model card's prompt, as transformers computes it."""
    import transformers

    snap = next((hf_home / "hub").glob("models--Qwen*/snapshots/*"))
    query, docs = "What is the capital of France?", SENTENCES[:5]
    tags = {m["name"]: m for m in httpx.get(server.base + "/api/tags", timeout=30).json()["models"]}
    assert tags["qwen3-reranker-0.6b"]["capabilities"] == ["rerank"]
    hf = transformers.Qwen3ForCausalLM.from_pretrained(snap).eval()
    ref = qwen3_rerank_reference(hf, snap, query, docs, 8192)
    for path in ("/v1/rerank", "/rerank"):
        r = httpx.post(server.base + path, json={"model": "qwen3-reranker", "query": query, "documents": docs},
                       timeout=120)
        assert r.status_code == 200, r.text
        res = r.json()["results"]
        assert [x["index"] for x in res] == sorted(range(len(docs)), key=lambda i: -ref[i])
        assert max(abs(x["relevance_score"] - ref[x["index"]]) for x in res) < 1e-5
    s = httpx.post(server.base + "/score", json={"model": "qwen3-reranker", "text_1": query, "text_2": docs},
                   timeout=60).json()
    assert max(abs(d["score"] - ref[d["index"]]) for d in s["data"]) < 1e-5


def test_serve_quant_fp32_serves_the_exact_encoder(minilm_dir):
    """`localllm serve --quant fp32` applies to encoders too: /api/embed answers the float32 path's
    vectors (auto may round the linears to bf16 where the CPU has bf16 dot products)."""
    from localllm.engine.embedder import Embedder
    from localllm.model.encoder_loader import load_encoder

    emb = Embedder(load_encoder(minilm_dir, precision="float32"))
    want = emb.embed(emb.tokenize(TEXTS[:3]))
    s = ServerProc("--quant", "fp32")
    try:
        s.wait_ready()
        r = httpx.post(s.base + "/api/embed", json={"model": "all-minilm", "input": TEXTS[:3]}, timeout=120)
        assert r.status_code == 200, r.text
        assert torch.allclose(torch.tensor(r.json()["embeddings"]), want, atol=1e-6, rtol=0)
    finally:
        s.stop()
