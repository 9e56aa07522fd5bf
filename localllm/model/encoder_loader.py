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

import numpy as np
import torch
from tokenizers import Tokenizer

from .bert import BertConfig, BertEncoder, ClassifierHead, EncoderLayer, LayerNorm
from .errors import ModelLoadError
from .layers import DenseLinear
from .pooling import Pooling

# config.json architectures this loader runs, and what each is for
ENCODER_ARCHS = {"BertModel": "embedding", "BertForMaskedLM": "embedding", "BertForPreTraining": "embedding",
                 "BertForSequenceClassification": "rerank", "XLMRobertaModel": "embedding",
                 "XLMRobertaForMaskedLM": "embedding", "RobertaModel": "embedding",
                 "XLMRobertaForSequenceClassification": "rerank", "RobertaForSequenceClassification": "rerank"}


# llama.cpp's `bert` tensor names (its converter's) -> HF's, without the `bert.` prefix; {i} the layer
GGUF_BERT_NAMES = {
    "token_embd.weight": "embeddings.word_embeddings.weight",
    "token_types.weight": "embeddings.token_type_embeddings.weight",
    "position_embd.weight": "embeddings.position_embeddings.weight",
    "token_embd_norm.weight": "embeddings.LayerNorm.weight",
    "token_embd_norm.bias": "embeddings.LayerNorm.bias",
}
GGUF_BERT_LAYER = {
    "attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
    "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
    "ffn_up": "intermediate.dense", "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm",
}
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}  # llama.cpp's llama_pooling_type
GGUF_ENCODER_ARCHS = {"bert": "embedding"}


def _gguf_arch(path: Path) -> str | None:
    from .gguf import GGUFError, read_gguf

    try:
        return read_gguf(path).metadata.get("general.architecture")
    except (GGUFError, OSError):
        return None


def encoder_kind(path: str | os.PathLike | None) -> str | None:
    """"embedding" or "rerank" for a directory holding an encoder checkpoint we run (or a GGUF of
    llama.cpp's `bert` architecture), else None (a decoder, no model). Reads config.json (or the
    GGUF's header) only."""
    if path is None:
        return None
    if str(path).endswith(".gguf") and Path(path).is_file():
        return GGUF_ENCODER_ARCHS.get(_gguf_arch(Path(path)) or "")
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
    limit -= cfg.position_offset  # RoBERTa's first positions are the padding's
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
        self.prefix = next((p for p in ("bert.", "roberta.") if p + "embeddings.word_embeddings.weight" in self.tensors),
                           "")

    def get(self, name: str, encoder: bool = True) -> torch.Tensor:
        key = (self.prefix if encoder else "") + name
        t = self.tensors.get(key)
        if t is None:
            raise ModelLoadError(f"{self.path}: tensor {key} is missing")
        return t.float()

    def has(self, name: str) -> bool:
        return name in self.tensors


class _GGUFTensors:
    """A llama.cpp `bert` GGUF's tensors under HF's names, dequantized to fp32."""

    def __init__(self, path: Path):
        from .gguf import GGUFError, read_gguf

        try:
            self.file = read_gguf(path)
        except GGUFError as e:
            raise ModelLoadError(str(e)) from None
        self.path, self.prefix = path, ""
        self.names = {hf: g for g, hf in GGUF_BERT_NAMES.items()}
        for g in self.file.tensors:
            parts = g.split(".")
            if parts[0] == "blk" and len(parts) == 4 and parts[2] in GGUF_BERT_LAYER:
                self.names[f"encoder.layer.{parts[1]}.{GGUF_BERT_LAYER[parts[2]]}.{parts[3]}"] = g

    def get(self, name: str, encoder: bool = True) -> torch.Tensor:
        from .gguf import dequantize

        g = self.names.get(name)
        t = self.file.tensors.get(g) if g else None
        if t is None:
            raise ModelLoadError(f"{self.path}: tensor {g or name} is missing")
        return torch.from_numpy(np.array(dequantize(t, self.file.read(t)), dtype=np.float32))


def _gguf_config(path: Path) -> tuple[BertConfig, dict]:
    from .gguf import GGUFError, read_gguf

    try:
        meta = read_gguf(path).metadata
    except GGUFError as e:
        raise ModelLoadError(str(e)) from None
    arch = meta.get("general.architecture")
    if arch not in GGUF_ENCODER_ARCHS:
        raise ModelLoadError(f"{path}: architecture {arch!r} is not an encoder this loader runs "
                             f"(supported: {', '.join(GGUF_ENCODER_ARCHS)})")

    def m(key, default=None):
        return meta.get(f"{arch}.{key}", default)
    try:
        cfg = BertConfig(vocab_size=len(meta["tokenizer.ggml.tokens"]), hidden_size=int(m("embedding_length")),
                         num_layers=int(m("block_count")), num_heads=int(m("attention.head_count")),
                         intermediate_size=int(m("feed_forward_length")),
                         max_position_embeddings=int(m("context_length", 512)),
                         type_vocab_size=int(meta.get("tokenizer.ggml.token_type_count", 2)),
                         layer_norm_eps=float(m("attention.layer_norm_epsilon", 1e-12)))
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: GGUF metadata is missing a required key ({e})") from None
    return cfg, meta


def _load_gguf_encoder(path: Path, device: str) -> LoadedEncoder:
    """A llama.cpp `bert` GGUF: its pooling_type decides the pooling; vectors are normalised (what
    Ollama's and llama.cpp's servers return: the file does not say)."""
    from ..tokenizer import wordpiece_from_gguf

    cfg, meta = _gguf_config(path)
    pooling_type = int(meta.get("bert.pooling_type", 1))
    if pooling_type not in GGUF_POOLING:
        raise ModelLoadError(f"{path}: pooling_type {pooling_type} is not supported (1 mean, 2 cls, 3 last)")
    model = _build(cfg, _GGUFTensors(path), "embedding", device)
    try:
        tok = wordpiece_from_gguf(meta)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{path}: GGUF tokenizer metadata: {e}") from None
    params = sum(p.numel() for p in model.parameters())
    return LoadedEncoder(model, tok, cfg, Pooling(GGUF_POOLING[pooling_type], True), cfg.max_position_embeddings,
                         "embedding", str(path), params)


def load_encoder(path: str | os.PathLike, device: str = "cpu") -> LoadedEncoder:
    """A BERT-family checkpoint directory (or a llama.cpp `bert` GGUF) -> LoadedEncoder (fp32
    weights: the reference's numbers)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf_encoder(path, device)
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
    model = _build(cfg, _Tensors(path), kind, device)
    pooling, max_len = sentence_transformers_settings(path, cfg)
    params = sum(p.numel() for p in model.parameters())
    return LoadedEncoder(model, load_tokenizer(path), cfg, pooling, max_len, kind, str(path), params)


def _build(cfg: BertConfig, w, kind: str, device: str) -> BertEncoder:
    """The encoder from `w`'s tensors under HF's names (a checkpoint's or a GGUF's)."""

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
    if kind == "rerank" and w.has("classifier.out_proj.weight"):  # RoBERTa's head
        head = ClassifierHead(lin("classifier.dense", encoder=False), lin("classifier.out_proj", encoder=False))
    elif kind == "rerank":
        head = ClassifierHead(lin("pooler.dense"), lin("classifier", encoder=False))
    e = "embeddings."
    return BertEncoder(cfg, w.get(e + "word_embeddings.weight").to(device),
                        w.get(e + "position_embeddings.weight").to(device),
                        w.get(e + "token_type_embeddings.weight").to(device), norm(e + "LayerNorm"), layers, head,
                        device)


def describe_encoder(path: str | os.PathLike) -> dict:
    """What `localllm show` and /api/show say about an encoder, from its config and
    sentence-transformers files (no tensor is read)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        cfg, meta = _gguf_config(path)
        tensors = _GGUFTensors(path).file.tensors
        return {"format": "gguf", "architecture": "BertModel", "kind": "embedding",
                "parameters": sum(math.prod(t.shape) for t in tensors.values()),
                "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
                "layers": cfg.num_layers, "heads": cfg.num_heads, "kv_heads": cfg.num_heads,
                "vocab_size": cfg.vocab_size,
                "quantization": ", ".join(sorted({t.qtype.name for t in tensors.values() if len(t.shape) > 1})),
                "pooling": f"{GGUF_POOLING.get(int(meta.get('bert.pooling_type', 1)), '?')}, normalized",
                "chat_template": None, "stop_tokens": []}
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
