"""Embedding and reranking routes: OpenAI's /v1/embeddings, Ollama's /api/embed and legacy
/api/embeddings, and the Cohere/Jina-shaped /v1/rerank (/rerank) and vLLM's /score that
llama.cpp's and vLLM's servers answer.

The models are encoders loaded on demand by the pool like chat models (pool.py); each has an
EncoderLoop thread that runs the forwards. Text is tokenized off the event loop (the tokenizer
releases the GIL). Choices where the APIs differ:
- Inputs longer than the model takes are cut by default (as Ollama does on all its routes);
  `truncate: false` (Ollama's field, also taken on /v1) refuses them: a 400 "input exceeds
  maximum context length", as Ollama answers. Ollama's `options.num_ctx` lowers that maximum.
- Ollama's /api/embed returns unit vectors whatever the model (Ollama normalises them); /v1 and
  the legacy /api/embeddings return what the model's sentence-transformers files ask for.
- `dimensions`: the first N components, scaled to unit length again (Matryoshka).
- A chat model asked for embeddings, or an embedding model asked to chat, is a 400 naming the
  model and what it does not support (Ollama's wording for chat/generate).
- Rerank scores are the cross-encoder's sigmoid (0..1, as vLLM and sentence-transformers);
  `return_documents` defaults to true (Jina's and vLLM's default).
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any, Union

from fastapi import APIRouter, Request

from . import openai_schema as oai
from .openai_schema import APIError

_api = APIRouter()

MAX_INPUTS = 2048  # inputs per request (OpenAI's limit for /v1/embeddings)
TOO_LONG = "input exceeds maximum context length"  # Ollama's message for truncate=false


# ---- requests ---------------------------------------------------------------------------------
class EmbeddingRequest(oai._Request):
    model: str | None = None
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate: bool = True  # not OpenAI's: Ollama's, for clients that want long inputs refused


class OllamaEmbedRequest(oai._Request):
    model: str = ""
    input: Union[str, list[str]] = []
    truncate: bool = True
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: Union[float, str, None] = None


class OllamaEmbeddingsRequest(oai._Request):
    model: str = ""
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: Union[float, str, None] = None


class RerankDocument(oai._Model):
    text: str


class RerankRequest(oai._Request):
    model: str | None = None
    query: str
    documents: list[Union[str, RerankDocument]]
    top_n: int | None = None
    return_documents: bool = True
    truncate: bool = True


class ScoreRequest(oai._Request):
    model: str | None = None
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]
    truncate: bool = True


# ---- helpers ----------------------------------------------------------------------------------
def _state(request: Request):
    return request.app.state.server


def _embedding_model(state, name: str | None) -> str | None:
    """A request without `model` on a server of every local model: the default embedding model
    (all-minilm), not the default chat model."""
    if name or state.pool.pinned is not None:
        return name
    from ..registry import load_registry

    return load_registry().default_embedding


def _num_ctx(options: dict[str, Any] | None) -> int | None:
    """Ollama's options, checked as its chat routes check them; num_ctx caps the input length."""
    if not options:
        return None
    from pydantic import ValidationError

    from .ollama import Options

    try:
        o = Options.model_validate(options)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise APIError(400, f"options.{where}: {err.get('msg')}", param=f"options.{where}") from None
    if o.num_ctx is not None and o.num_ctx < 1:
        raise APIError(400, f"options.num_ctx must be >= 1, got {o.num_ctx}", param="options.num_ctx")
    return o.num_ctx


def _check_dimensions(dimensions: int | None, width: int) -> None:
    if dimensions is not None and not 1 <= dimensions <= width:
        raise APIError(400, f"dimensions must be between 1 and the model's {width}, got {dimensions}",
                       param="dimensions")


def _count(n: int, param: str) -> None:
    if n > MAX_INPUTS:
        raise APIError(400, f"{param}: at most {MAX_INPUTS} inputs per request, got {n}", param=param)


async def _encode(embedder, texts=None, ids=None, pairs=None, truncate: bool = True, limit: int | None = None,
                  param: str = "input"):
    """Tokenized inputs (in a worker thread), or a 400 naming `param`."""
    from ..engine.embedder import InputTooLong

    try:
        if ids is not None:
            return await asyncio.to_thread(embedder.check_ids, ids, truncate, limit)
        if pairs is not None:
            return await asyncio.to_thread(embedder.tokenize_pairs, pairs, truncate)
        return await asyncio.to_thread(embedder.tokenize, texts, truncate, limit)
    except InputTooLong as e:
        raise APIError(400, f"{TOO_LONG} ({e}; send truncate: true to cut it)", param=param,
                       code="context_length_exceeded") from None
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param) from None


async def _run(target, kind: str, enc, dimensions: int | None = None):
    try:
        return await target.loop.run_job(kind, enc, dimensions)
    except RuntimeError as e:  # unloaded under the request (shutdown)
        raise APIError(503, str(e), "service_unavailable", code="model_unloaded") from None


def _b64(vector) -> str:
    """OpenAI's base64 encoding: the float32 values' little-endian bytes."""
    return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()


def _vectors(t) -> list[list[float]]:
    return t.tolist()


# ---- OpenAI -----------------------------------------------------------------------------------
@_api.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    state = _state(request)
    state.metrics.http_requests += 1
    if body.encoding_format not in ("float", "base64"):
        raise APIError(400, f"encoding_format must be 'float' or 'base64', got {body.encoding_format!r}",
                       param="encoding_format")
    inp = body.input
    texts = ids = None
    if isinstance(inp, str):
        texts = [inp]
    elif inp and all(isinstance(x, int) for x in inp):
        ids = [inp]
    elif inp and all(isinstance(x, list) for x in inp):
        ids = inp
    elif inp:
        texts = inp
    if not inp or (ids is not None and any(not x for x in ids)):
        raise APIError(400, "input must not be empty", param="input")
    _count(len(texts or ids), "input")
    target, release = await state.acquire(_embedding_model(state, body.model), task="embed")
    try:
        emb = target.engine
        _check_dimensions(body.dimensions, emb.dimensions)
        enc = await _encode(emb, texts, ids, truncate=body.truncate)
        vectors = await _run(target, "embed", enc, body.dimensions)
    finally:
        release()
    data = [{"object": "embedding", "index": i,
             "embedding": _b64(v) if body.encoding_format == "base64" else v.tolist()} for i, v in enumerate(vectors)]
    n = enc.num_tokens
    return {"object": "list", "data": data, "model": target.name, "usage": {"prompt_tokens": n, "total_tokens": n}}


# ---- Ollama -----------------------------------------------------------------------------------
@_api.post("/api/embed")
async def ollama_embed(body: OllamaEmbedRequest, request: Request):
    import torch.nn.functional as F

    from .ollama import parse_keep_alive

    state = _state(request)
    state.metrics.http_requests += 1
    t0 = time.perf_counter()
    if not body.model:
        raise APIError(400, "model is required", param="model")
    keep_alive = parse_keep_alive(body.keep_alive)
    num_ctx = _num_ctx(body.options)
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    texts = [t for t in texts if t] if isinstance(body.input, str) else texts  # "" only loads, as Ollama
    _count(len(texts), "input")
    target, release = await state.acquire(body.model, keep_alive, task="embed")
    loaded = time.perf_counter()
    try:
        emb = target.engine
        _check_dimensions(body.dimensions, emb.dimensions)
        enc = await _encode(emb, texts, truncate=body.truncate, limit=num_ctx) if texts else None
        vectors = F.normalize(await _run(target, "embed", enc, body.dimensions), dim=-1) if texts else None
    finally:
        release()
    end = time.perf_counter()
    return {"model": body.model, "embeddings": _vectors(vectors) if texts else [],
            "total_duration": int((end - t0) * 1e9), "load_duration": int((loaded - t0) * 1e9),
            "prompt_eval_count": enc.num_tokens if texts else 0}


@_api.post("/api/embeddings")
async def ollama_embeddings(body: OllamaEmbeddingsRequest, request: Request):
    """The legacy route: one `prompt`, one `embedding` (the model's own vector, as Ollama's)."""
    from .ollama import parse_keep_alive

    state = _state(request)
    state.metrics.http_requests += 1
    if not body.model:
        raise APIError(400, "model is required", param="model")
    keep_alive = parse_keep_alive(body.keep_alive)
    num_ctx = _num_ctx(body.options)
    target, release = await state.acquire(body.model, keep_alive, task="embed")
    try:
        if not body.prompt:  # as Ollama: loads the model, answers an empty embedding
            return {"embedding": []}
        enc = await _encode(target.engine, [body.prompt], limit=num_ctx, param="prompt")
        vectors = await _run(target, "embed", enc)
    finally:
        release()
    return {"embedding": vectors[0].tolist()}


# ---- rerank / score -----------------------------------------------------------------------------
async def _rerank(body: RerankRequest, request: Request):
    state = _state(request)
    state.metrics.http_requests += 1
    docs = [d if isinstance(d, str) else d.text for d in body.documents]
    if not docs:
        raise APIError(400, "documents must not be empty", param="documents")
    _count(len(docs), "documents")
    if body.top_n is not None and body.top_n < 1:
        raise APIError(400, f"top_n must be >= 1, got {body.top_n}", param="top_n")
    target, release = await state.acquire(body.model, task="rerank")
    try:
        enc = await _encode(target.engine, pairs=[(body.query, d) for d in docs], truncate=body.truncate,
                            param="documents")
        scores = (await _run(target, "score", enc)).tolist()
    finally:
        release()
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[:body.top_n or len(docs)]
    results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": docs[i]}}
                                                             if body.return_documents else {})} for i in order]
    n = enc.num_tokens
    return {"id": oai.new_id("rerank"), "model": target.name, "results": results,
            "usage": {"prompt_tokens": n, "total_tokens": n}}


@_api.post("/v1/rerank")
async def rerank_v1(body: RerankRequest, request: Request):
    return await _rerank(body, request)


@_api.post("/rerank")
async def rerank(body: RerankRequest, request: Request):
    return await _rerank(body, request)


@_api.post("/score")
async def score(body: ScoreRequest, request: Request):
    """vLLM's /score: text_1 against each text_2 (one text_1), or pairwise (lists of one length)."""
    state = _state(request)
    state.metrics.http_requests += 1
    a = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
    b = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
    if not a or not b:
        raise APIError(400, "text_1 and text_2 must not be empty", param="text_1" if not a else "text_2")
    if len(a) == 1:
        a = a * len(b)
    if len(a) != len(b):
        raise APIError(400, f"text_1 has {len(a)} texts and text_2 {len(b)}: send one text_1, or as many as "
                            "text_2", param="text_2")
    _count(len(b), "text_2")
    target, release = await state.acquire(body.model, task="rerank")
    try:
        enc = await _encode(target.engine, pairs=list(zip(a, b)), truncate=body.truncate, param="text_2")
        scores = (await _run(target, "score", enc)).tolist()
    finally:
        release()
    n = enc.num_tokens
    return {"id": oai.new_id("score"), "object": "list", "created": oai.now(), "model": target.name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": n, "total_tokens": n}}


def router(state) -> APIRouter:
    """This API's routes (they reach the server state through request.app.state.server)."""
    return _api
