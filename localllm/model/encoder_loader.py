"""HF directories of encoder checkpoints -> a ready BertEncoder, its tokenizer, and how its outputs
become embeddings (sentence-transformers' files) or relevance scores (a cross-encoder's head).

Pooling and normalisation come from the sentence-transformers files the checkpoint ships:
modules.json (a Normalize module means unit vectors), 1_Pooling/config.json (CLS / mean / last
token) and sentence_bert_config.json (max_seq_length: where inputs are cut, as
sentence-transformers cuts them). Without them: mean pooling, no normalisation, the model's
position limit (transformers' AutoModel plus the usual mean pooling).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from .bert import BertConfig, BertEncoder, ClassifierHead, EncoderLayer, LayerNorm
from .errors import ModelLoadError
from .layers import DenseLinear
from .pooling import Pooling

# config.json architectures this loader runs, and what each is for
ENCODER_ARCHS = {"BertModel": "embedding", "BertForMaskedLM": "embedding", "BertForPreTraining": "embedding",
                 "BertForSequenceClassification": "rerank"}


def encoder_kind(path: str | os.PathLike | None) -> str | None:
    """"embedding" or "rerank" for a directory holding an encoder checkpoint we run, else None
    (a decoder, a GGUF file, no model). Reads config.json only."""
    if path is None:
        return None
    cfg = Path(path) / "config.json"
    try:
        archs = json.loads(cfg.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    return ENCODER_ARCHS.get(archs[0]) if archs and isinstance(archs[0], str) else None


@dataclass
class LoadedEncoder:
    model: BertEncoder
    tokenizer: Tokenizer  # no truncation or padding set: the embedder cuts to max_len itself
    config: BertConfig
    pooling: Pooling
    max_len: int  # tokens per input, special tokens included
    kind: str  # "embedding" | "rerank"
    source: str
    params: int = 0


def _json(path: Path) -> dict | list | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from None


def sentence_transformers_settings(path: Path, cfg: BertConfig) -> tuple[Pooling, int]:
    """(pooling, max input tokens) from the sentence-transformers files of `path`."""
    modules = _json(path / "modules.json") or []
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    mode, normalize = "mean", "Normalize" in types
    if "Pooling" in types:
        pc = _json(path / str(types["Pooling"].get("path", "")) / "config.json") or {}
        if pc.get("pooling_mode_cls_token"):
            mode = "cls"
        elif pc.get("pooling_mode_lasttoken"):
            mode = "last"
        elif pc.get("pooling_mode_mean_tokens", True):
            mode = "mean"
        else:
            chosen = [k for k, v in pc.items() if k.startswith("pooling_mode") and v]
            raise ModelLoadError(f"{path}: pooling {', '.join(chosen) or 'none'} is not supported (cls, mean, "
                                 "lasttoken)")
    st = _json(path / "sentence_bert_config.json") or {}
    tc = _json(path / "tokenizer_config.json") or {}
    limit = cfg.max_position_embeddings
    max_len = st.get("max_seq_length") or min(int(tc.get("model_max_length") or limit), limit)
    return Pooling(mode, normalize), min(int(max_len), limit)


def load_tokenizer(path: Path) -> Tokenizer:
    tj = path / "tokenizer.json"
    if not tj.is_file():
        raise ModelLoadError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
    try:
        tok = Tokenizer.from_file(str(tj))
    except Exception as e:
        raise ModelLoadError(f"{tj}: cannot parse tokenizer ({e})") from None
    tok.no_truncation()  # the file's own settings (all-MiniLM's: cut at 128, pad to 128) are not ours
    tok.no_padding()
    return tok


class _Tensors:
    """The checkpoint's safetensors by name, with or without the `bert.` prefix HF's task models
    put in front of the encoder's tensors."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors"))
        if not files:
            pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pth")]
            hint = f" (found {', '.join(pickles)}: pickle checkpoints are never loaded)" if pickles else ""
            raise ModelLoadError(f"{path}: no *.safetensors weights{hint}")
        self.path, self.tensors = path, {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as h:
                    for k in h.keys():
                        self.tensors[k] = h.get_tensor(k)
            except Exception as e:
                raise ModelLoadError(f"{f}: corrupt safetensors file ({e})") from None
        self.prefix = "bert." if "bert.embeddings.word_embeddings.weight" in self.tensors else ""

    def get(self, name: str, encoder: bool = True) -> torch.Tensor:
        key = (self.prefix if encoder else "") + name
        t = self.tensors.get(key)
        if t is None:
            raise ModelLoadError(f"{self.path}: tensor {key} is missing")
        return t.float()

    def has(self, name: str) -> bool:
        return name in self.tensors


def load_encoder(path: str | os.PathLike, device: str = "cpu") -> LoadedEncoder:
    """A BERT-family checkpoint directory -> LoadedEncoder (fp32 weights: the reference's numbers)."""
    path = Path(path)
    raw = _json(path / "config.json")
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: no config.json (not a Hugging Face model directory)")
    kind = encoder_kind(path)
    if kind is None:
        raise ModelLoadError(f"{path}: architecture {(raw.get('architectures') or ['?'])[0]!r} is not an encoder "
                             f"this loader runs (supported: {', '.join(ENCODER_ARCHS)})")
    try:
        cfg = BertConfig.from_hf(raw)
    except (KeyError, ValueError, TypeError) as e:
        raise ModelLoadError(f"{path / 'config.json'}: {e}") from None
    w = _Tensors(path)

    def lin(name: str, encoder: bool = True) -> DenseLinear:
        return DenseLinear(w.get(name + ".weight", encoder).to(device), w.get(name + ".bias", encoder).to(device))

    def norm(name: str) -> LayerNorm:
        return LayerNorm(w.get(name + ".weight").to(device), w.get(name + ".bias").to(device), cfg.layer_norm_eps)

    layers = []
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}."
        a = p + "attention.self."
        # q, k and v as one linear: one GEMM instead of three
        qkv = DenseLinear(torch.cat([w.get(a + m + ".weight") for m in ("query", "key", "value")]).to(device),
                          torch.cat([w.get(a + m + ".bias") for m in ("query", "key", "value")]).to(device))
        layers.append(EncoderLayer(cfg, qkv, lin(p + "attention.output.dense"), norm(p + "attention.output.LayerNorm"),
                                   lin(p + "intermediate.dense"), lin(p + "output.dense"), norm(p + "output.LayerNorm")))
    head = None
    if kind == "rerank":
        head = ClassifierHead(lin("pooler.dense"), lin("classifier", encoder=False))
    e = "embeddings."
    model = BertEncoder(cfg, w.get(e + "word_embeddings.weight").to(device),
                        w.get(e + "position_embeddings.weight").to(device),
                        w.get(e + "token_type_embeddings.weight").to(device), norm(e + "LayerNorm"), layers, head,
                        device)
    pooling, max_len = sentence_transformers_settings(path, cfg)
    params = sum(p.numel() for p in model.parameters())
    return LoadedEncoder(model, load_tokenizer(path), cfg, pooling, max_len, kind, str(path), params)


def describe_encoder(path: str | os.PathLike) -> dict:
    """What `localllm show` and /api/show say about an encoder, from its config and
    sentence-transformers files (no tensor is read)."""
    path = Path(path)
    raw = _json(path / "config.json") or {}
    try:
        cfg = BertConfig.from_hf(raw)
    except (KeyError, ValueError, TypeError) as e:
        raise ModelLoadError(f"{path / 'config.json'}: {e}") from None
    pooling, max_len = sentence_transformers_settings(path, cfg)
    params = 0
    for f in sorted(path.glob("*.safetensors")):  # the headers' shapes: no tensor is read
        try:
            with open(f, "rb") as fh:
                header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{f}: corrupt safetensors header ({e})") from None
        params += sum(math.prod(v["shape"]) for k, v in header.items()
                      if k != "__metadata__" and not k.endswith("position_ids"))
    h, L = cfg.hidden_size, cfg.num_layers
    return {"format": "safetensors", "architecture": cfg.architecture, "kind": encoder_kind(path),
            "parameters": params, "context_length": max_len, "embedding_length": h, "layers": L,
            "heads": cfg.num_heads, "kv_heads": cfg.num_heads, "vocab_size": cfg.vocab_size,
            "quantization": str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            "pooling": f"{pooling.mode}{', normalized' if pooling.normalize else ''}",
            "chat_template": None, "stop_tokens": []}
