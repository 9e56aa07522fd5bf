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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from ..config import ModelConfig
from . import bf16x3
from .bert import BertConfig, BertEncoder, ClassifierHead, EncoderLayer, LayerNorm
from .decoder_encoder import DecoderEncoder, YesNoHead
from .errors import ModelLoadError
from .layers import DenseLinear
from .pooling import Pooling

# config.json architectures this loader runs, and what each is for
ENCODER_ARCHS = {"BertModel": "embedding", "BertForMaskedLM": "embedding", "BertForPreTraining": "embedding",
                 "BertForSequenceClassification": "rerank", "XLMRobertaModel": "embedding",
                 "XLMRobertaForMaskedLM": "embedding", "RobertaModel": "embedding",
                 "XLMRobertaForSequenceClassification": "rerank", "RobertaForSequenceClassification": "rerank",
                 "NomicBertModel": "embedding"}


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
GGUF_RANK = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK (a reranker's classifier output)
GGUF_ENCODER_ARCHS = {"bert": "embedding", "nomic-bert": "embedding"}
# nomic-bert under its original (remote code) names, which llama.cpp's converter maps from: the
# names _build_nomic reads; transformers' renamed ones (NomicBertModel) are mapped back to them
GGUF_NOMIC_NAMES = {"token_embd.weight": "embeddings.word_embeddings.weight",
                    "token_types.weight": "embeddings.token_type_embeddings.weight",
                    "token_embd_norm.weight": "emb_ln.weight", "token_embd_norm.bias": "emb_ln.bias"}
GGUF_NOMIC_LAYER = {"attn_qkv": "attn.Wqkv", "attn_output": "attn.out_proj", "ffn_up": "mlp.fc11",
                    "ffn_gate": "mlp.fc12", "ffn_down": "mlp.fc2", "attn_output_norm": "norm1",
                    "layer_output_norm": "norm2"}
HF_NOMIC_RENAMED = {"self_attn.o_proj": "attn.out_proj", "mlp.up_proj": "mlp.fc11", "mlp.gate_proj": "mlp.fc12",
                    "mlp.down_proj": "mlp.fc2", "post_attention_layernorm": "norm1", "post_mlp_layernorm": "norm2"}


def _gguf_meta(path: Path) -> dict:
    from .gguf import GGUFError, read_gguf

    try:
        return read_gguf(path).metadata
    except (GGUFError, OSError):
        return {}


def _has_st_pooling(path: Path) -> bool:
    """The directory ships sentence-transformers files with a Pooling module (an embedder)."""
    try:
        modules = json.loads((path / "modules.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(modules, list) and any(isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling")
                                             for m in modules)


def encoder_kind(path: str | os.PathLike | None) -> str | None:
    """"embedding" or "rerank" for an encoder checkpoint we run (a directory, or a GGUF of llama.cpp's
    `bert` architecture) or a decoder embedder (a decoder directory with sentence-transformers
    pooling files, or a decoder GGUF with a pooling_type, as llama.cpp's converter writes for
    Qwen3-Embedding), else None (a chat model, no model). Reads config.json (or the GGUF's
    header) only. A decoder reranker (Qwen3-Reranker) says nothing in its files: the registry's
    kind names it."""
    if path is None:
        return None
    if str(path).endswith(".gguf") and Path(path).is_file():
        meta = _gguf_meta(Path(path))
        arch = meta.get("general.architecture") or ""
        if arch in GGUF_ENCODER_ARCHS:
            return GGUF_ENCODER_ARCHS[arch]
        pooling = meta.get(f"{arch}.pooling_type")
        return None if pooling is None else "rerank" if int(pooling) == GGUF_RANK else "embedding"
    cfg = Path(path) / "config.json"
    try:
        archs = json.loads(cfg.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    if not archs or not isinstance(archs[0], str):
        return None
    if archs[0] in ENCODER_ARCHS:
        return ENCODER_ARCHS[archs[0]]
    return "embedding" if _has_st_pooling(Path(path)) else None


def is_decoder(path: str | os.PathLike) -> bool:
    """A decoder checkpoint (what localllm.model.loader loads), not a BERT-family encoder."""
    path = Path(path)
    if path.is_file():
        return (_gguf_meta(path).get("general.architecture") or "") not in GGUF_ENCODER_ARCHS
    raw = _json(path / "config.json")
    archs = (raw.get("architectures") or []) if isinstance(raw, dict) else []
    return bool(archs) and archs[0] not in ENCODER_ARCHS


@dataclass(frozen=True)
class PairPrompt:
    """How a decoder reranker reads a (query, document) pair: `prefix` ids, the pair written into
    `template` (its {instruction}, {query}, {document}) and tokenized, then `suffix` ids; the
    middle is what is cut when too long (Qwen3-Reranker's model card)."""

    prefix: list[int]
    template: str
    suffix: list[int]
    instruction: str


@dataclass
class LoadedEncoder:
    model: BertEncoder | DecoderEncoder
    tokenizer: Tokenizer  # no truncation or padding set: the embedder cuts to max_len itself
    config: BertConfig | ModelConfig
    pooling: Pooling
    max_len: int  # tokens per input, special tokens included
    kind: str  # "embedding" | "rerank"
    source: str
    params: int = 0
    # sentence-transformers' prompts (config_sentence_transformers.json): name -> text put before
    # each input, and the one applied when the request names none
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt: str | None = None
    pair_prompt: PairPrompt | None = None  # a decoder reranker's prompt (None: a cross-encoder's pairs)


def _json(path: Path) -> dict | list | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from None


def sentence_transformers_settings(path: Path, cfg: BertConfig | ModelConfig) -> tuple[Pooling, int]:
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
    limit -= getattr(cfg, "position_offset", 0)  # RoBERTa's first positions are the padding's
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
        if "layers.0.self_attn.q_proj.weight" in self.tensors:  # nomic-bert as transformers writes it
            self._nomic_original_names()

    def _nomic_original_names(self) -> None:
        t = self.tensors
        if "embeddings.LayerNorm.weight" in t:
            t["emb_ln.weight"], t["emb_ln.bias"] = t["embeddings.LayerNorm.weight"], t["embeddings.LayerNorm.bias"]
        i = 0
        while f"layers.{i}.self_attn.q_proj.weight" in t:
            p = f"layers.{i}."
            t[f"encoder.{p}attn.Wqkv.weight"] = torch.cat([t[f"{p}self_attn.{m}_proj.weight"] for m in "qkv"])
            for k in list(t):
                for new, old in ((v, k2) for k2, v in HF_NOMIC_RENAMED.items()):
                    if k.startswith(p + old + "."):
                        t[f"encoder.{p}{new}{k[len(p + old):]}"] = t[k]
            i += 1

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
        nomic = self.file.metadata.get("general.architecture") == "nomic-bert"
        names, layer = (GGUF_NOMIC_NAMES, GGUF_NOMIC_LAYER) if nomic else (GGUF_BERT_NAMES, GGUF_BERT_LAYER)
        stem = "encoder.layers" if nomic else "encoder.layer"
        self.names = {hf: g for g, hf in names.items()}
        for g in self.file.tensors:
            parts = g.split(".")
            if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer:
                self.names[f"{stem}.{parts[1]}.{layer[parts[2]]}.{parts[3]}"] = g

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
                         layer_norm_eps=float(m("attention.layer_norm_epsilon", 1e-12)),
                         **({"rope_theta": float(m("rope.freq_base", 1000.0)), "gated": True, "hidden_act": "silu",
                             "architecture": "NomicBertModel", "model_type": "nomic_bert"}
                            if arch == "nomic-bert" else {}))
    except (KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: GGUF metadata is missing a required key ({e})") from None
    return cfg, meta


def _load_gguf_encoder(path: Path, device: str, precision: str) -> LoadedEncoder:
    """A llama.cpp `bert` GGUF: its pooling_type decides the pooling; vectors are normalised (what
    Ollama's and llama.cpp's servers return: the file does not say)."""
    from ..tokenizer import wordpiece_from_gguf

    cfg, meta = _gguf_config(path)
    pooling_type = int(meta.get(f"{meta['general.architecture']}.pooling_type", 1))
    if pooling_type not in GGUF_POOLING:
        raise ModelLoadError(f"{path}: pooling_type {pooling_type} is not supported (1 mean, 2 cls, 3 last)")
    model = _build(cfg, _GGUFTensors(path), "embedding", device, precision)
    try:
        tok = wordpiece_from_gguf(meta)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"{path}: GGUF tokenizer metadata: {e}") from None
    params = bf16x3.count_parameters(model)
    return LoadedEncoder(model, tok, cfg, Pooling(GGUF_POOLING[pooling_type], True), cfg.max_position_embeddings,
                         "embedding", str(path), params)


# Qwen3-Reranker's prompt, from its model card: a system turn asking for "yes" or "no", the pair in
# the user turn, an empty thinking block, the answer's logits read at the next token
QWEN3_RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
                       "and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
                       "<|im_start|>user\n")
QWEN3_RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANK_TEMPLATE = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
QWEN3_RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
# the longest input a decoder embedder takes (its RoPE table and the per-forward KV cache are sized
# to it): Qwen3-Embedding's 32k positions would need a 4 GB fp32 cache for one input of 0.6B
DECODER_MAX_LEN = 8192
CHAT_MAX_LEN = 4096  # a chat model asked for embeddings: Ollama's default num_ctx


def _with_special_tokens(tok) -> Tokenizer:
    """A GGUF's tokenizer (LLMTokenizer) as a tokenizers.Tokenizer that adds the BOS / EOS the file
    asks for (add_bos_token / add_eos_token), as llama.cpp tokenizes an embedding input."""
    from tokenizers.processors import TemplateProcessing

    out = Tokenizer.from_str(tok.tok.to_str())
    bos = [tok.bos_token] if tok.add_bos and tok.bos_id is not None else []
    eos = [tok.eos_token] if tok.add_eos and tok.eos_id is not None else []
    specials = [(t, tok.tok.token_to_id(t)) for t in bos + eos]
    out.post_processor = TemplateProcessing(single=" ".join([*bos, "$A", *eos]),
                                            pair=" ".join([*bos, "$A", "$B", *eos]), special_tokens=specials)
    return out


def _st_prompts(path: Path) -> tuple[dict[str, str], str | None]:
    st = _json(path / "config_sentence_transformers.json") or {}
    prompts = st.get("prompts") if isinstance(st, dict) else None
    prompts = {str(k): str(v) for k, v in prompts.items()} if isinstance(prompts, dict) else {}
    default = st.get("default_prompt_name") if isinstance(st, dict) else None
    return prompts, default if default in prompts else None


def _load_decoder_encoder(path: Path, device: str, kind: str | None, precision: str) -> LoadedEncoder:
    """A decoder as an embedder (sentence-transformers files or a GGUF pooling_type say how it
    pools; a chat model without them: its last token, normalised, as Ollama's llama.cpp engine)
    or, kind "rerank", a yes/no reranker (Qwen3-Reranker's prompt)."""
    from .loader import load_model
    from .weights import open_weights

    gguf = path.is_file()
    meta = _gguf_meta(path) if gguf else {}
    cfg = open_weights(path).config
    kind = kind or encoder_kind(path) or "embedding"
    prompts, default_prompt = ({}, None) if gguf else _st_prompts(path)
    pooling_type = meta.get(f"{meta.get('general.architecture')}.pooling_type")
    if pooling_type is not None and int(pooling_type) == GGUF_RANK:
        raise ModelLoadError(f"{path}: a GGUF reranker (pooling_type rank: a classifier head) is not supported; "
                             "load its Hugging Face checkpoint")
    if pooling_type is not None and int(pooling_type) not in GGUF_POOLING:
        raise ModelLoadError(f"{path}: pooling_type {pooling_type} is not supported (1 mean, 2 cls, 3 last)")
    if pooling_type is not None:
        pooling, max_len = Pooling(GGUF_POOLING[int(pooling_type)], True), cfg.max_position_embeddings
    elif not gguf and _has_st_pooling(path):
        pooling, max_len = sentence_transformers_settings(path, cfg)
    else:  # a chat model (or a reranker): its last token; Ollama normalises what it returns
        pooling = Pooling("last", True)
        max_len = min(cfg.max_position_embeddings, DECODER_MAX_LEN if kind == "rerank" else CHAT_MAX_LEN)
    max_len = min(max_len, DECODER_MAX_LEN)
    handle = load_model(path, precision, device, max_model_len=max_len)
    tok = _with_special_tokens(handle.tokenizer) if gguf else load_tokenizer(path)
    head = pair = None
    if kind == "rerank":
        yes, no = tok.token_to_id("yes"), tok.token_to_id("no")
        if yes is None or no is None:
            raise ModelLoadError(f"{path}: a yes/no reranker needs the tokens 'yes' and 'no' in its vocabulary")
        head = YesNoHead(no, yes)
        enc = handle.tokenizer.encode
        pair = PairPrompt(enc(QWEN3_RERANK_PREFIX), QWEN3_RERANK_TEMPLATE, enc(QWEN3_RERANK_SUFFIX),
                          QWEN3_RERANK_INSTRUCTION)
    model = DecoderEncoder(handle.model, handle.model.act_dtype, head)
    params = sum(p.numel() for p in handle.model.parameters())
    return LoadedEncoder(model, tok, cfg, pooling, max_len, kind, str(path), params, prompts, default_prompt, pair)


def load_encoder(path: str | os.PathLike, device: str = "cpu", kind: str | None = None,
                 precision: str = "auto") -> LoadedEncoder:
    """A BERT-family checkpoint directory (or a llama.cpp `bert` GGUF) -> LoadedEncoder (precision
    one of ENCODER_PRECISIONS); a decoder checkpoint or GGUF -> its DecoderEncoder (kind:
    "embedding" or "rerank" where the files do not say; precision: load_model's, for decoders)."""
    path = Path(path)
    if is_decoder(path):
        return _load_decoder_encoder(path, device, kind, precision)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf_encoder(path, device, precision)
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
    model = _build(cfg, _Tensors(path), kind, device, precision)
    pooling, max_len = sentence_transformers_settings(path, cfg)
    params = bf16x3.count_parameters(model)
    return LoadedEncoder(model, load_tokenizer(path), cfg, pooling, max_len, kind, str(path), params,
                         *_st_prompts(path))


def _build_nomic(cfg: BertConfig, w, device: str, parts: int) -> BertEncoder:
    """nomic-bert from `w`'s tensors under its original names: fused Wqkv, fc12 (gate) and fc11 (up)
    as one gate/up linear, no linear biases; the linears as _build's (`parts`: bf16x3.linear's)."""
    def get(name: str) -> torch.Tensor:
        return w.get(name).to(device)

    def lin(*names: str) -> torch.nn.Module:
        return bf16x3.linear(torch.cat([get(n + ".weight") for n in names]), None, parts)

    def norm(name: str) -> LayerNorm:
        return LayerNorm(get(name + ".weight"), get(name + ".bias"), cfg.layer_norm_eps)

    layers = []
    for i in range(cfg.num_layers):
        p = f"encoder.layers.{i}."
        layers.append(EncoderLayer(cfg, lin(p + "attn.Wqkv"), lin(p + "attn.out_proj"), norm(p + "norm1"),
                                   lin(p + "mlp.fc12", p + "mlp.fc11"), lin(p + "mlp.fc2"), norm(p + "norm2")))
    return BertEncoder(cfg, get("embeddings.word_embeddings.weight"), None,
                       get("embeddings.token_type_embeddings.weight"), norm("emb_ln"), layers, None, device)


# BERT-family encoders' linears: "auto" (the weights rounded to bf16 on the CPU's bf16 dot
# products where it has them, AMX-BF16 or AVX512-BF16: on the real all-MiniLM, cosine >= 0.99997
# to fp32 on 300 held-out sentences, 1.9x MKL's fp32 GEMMs on Zen 4; torch's fp32 elsewhere),
# "float32" (torch's fp32), "bf16x3" (AMX, weights and activations in two bf16 parts:
# fp32-level), "bfloat16" (the weights rounded to bf16: activations in two parts on AMX, rounded
# too with AVX512-BF16)
ENCODER_PRECISIONS = ("auto", "float32", "bf16x3", "bfloat16")


def _build(cfg: BertConfig, w, kind: str, device: str, precision: str = "auto") -> BertEncoder:
    """The encoder from `w`'s tensors under HF's names (a checkpoint's or a GGUF's); precision as
    ENCODER_PRECISIONS says."""
    if precision not in ENCODER_PRECISIONS:
        raise ModelLoadError(f"precision {precision!r} is not supported for BERT-family encoders "
                             f"({', '.join(ENCODER_PRECISIONS)})")
    if precision == "bf16x3" and not bf16x3.available(device):
        raise ModelLoadError("precision 'bf16x3' needs a CPU with AMX-BF16 (this one has none: use auto)")
    dot = bf16x3.dot_available(device)
    if precision == "bfloat16" and not dot:
        raise ModelLoadError("precision 'bfloat16' needs a CPU with bf16 dot products, AMX-BF16 or AVX512-BF16 "
                             "(this one has neither: use auto)")
    parts = {"auto": 1 if dot else 0, "float32": 0, "bf16x3": 2, "bfloat16": 1}[precision]
    if cfg.model_type == "nomic_bert":
        return _build_nomic(cfg, w, device, parts)

    def lin(name: str, encoder: bool = True, act: str = "none") -> torch.nn.Module:
        return bf16x3.linear(w.get(name + ".weight", encoder).to(device), w.get(name + ".bias", encoder).to(device),
                             parts, act)

    def norm(name: str) -> LayerNorm:
        return LayerNorm(w.get(name + ".weight").to(device), w.get(name + ".bias").to(device), cfg.layer_norm_eps)

    layers = []
    for i in range(cfg.num_layers):
        p = f"encoder.layer.{i}."
        a = p + "attention.self."
        # q, k and v as one linear: one GEMM instead of three
        qkv = bf16x3.linear(torch.cat([w.get(a + m + ".weight") for m in ("query", "key", "value")]).to(device),
                            torch.cat([w.get(a + m + ".bias") for m in ("query", "key", "value")]).to(device), parts)
        up = lin(p + "intermediate.dense", act="gelu" if cfg.hidden_act == "gelu" else "none")
        layers.append(EncoderLayer(cfg, qkv, lin(p + "attention.output.dense"), norm(p + "attention.output.LayerNorm"),
                                   up, lin(p + "output.dense"), norm(p + "output.LayerNorm")))
    def dense(name: str, encoder: bool = True) -> DenseLinear:  # the head: one row an input, fp32
        return DenseLinear(w.get(name + ".weight", encoder).to(device), w.get(name + ".bias", encoder).to(device))

    head = None
    if kind == "rerank" and w.has("classifier.out_proj.weight"):  # RoBERTa's head
        head = ClassifierHead(dense("classifier.dense", encoder=False), dense("classifier.out_proj", encoder=False))
    elif kind == "rerank":
        head = ClassifierHead(dense("pooler.dense"), dense("classifier", encoder=False))
    e = "embeddings."
    return BertEncoder(cfg, w.get(e + "word_embeddings.weight").to(device),
                        w.get(e + "position_embeddings.weight").to(device),
                        w.get(e + "token_type_embeddings.weight").to(device), norm(e + "LayerNorm"), layers, head,
                        device)


def describe_encoder(path: str | os.PathLike) -> dict:
    """What `localllm show` and /api/show say about an encoder, from its config and
    sentence-transformers files (no tensor is read)."""
    path = Path(path)
    if is_decoder(path):
        return _describe_decoder(path)
    if path.is_file() and path.suffix == ".gguf":
        cfg, meta = _gguf_config(path)
        tensors = _GGUFTensors(path).file.tensors
        return {"format": "gguf", "architecture": cfg.architecture, "kind": "embedding",
                "parameters": sum(math.prod(t.shape) for t in tensors.values()),
                "context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
                "layers": cfg.num_layers, "heads": cfg.num_heads, "kv_heads": cfg.num_heads,
                "vocab_size": cfg.vocab_size,
                "quantization": ", ".join(sorted({t.qtype.name for t in tensors.values() if len(t.shape) > 1})),
                "pooling": f"{GGUF_POOLING.get(int(meta.get(meta['general.architecture'] + '.pooling_type', 1)), '?')}, "
                           "normalized",
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


def _describe_decoder(path: Path) -> dict:
    """describe_encoder for a decoder embedder or reranker: its config and weight shapes (the
    headers only)."""
    from .weights import open_weights

    w = open_weights(path)
    cfg, gguf = w.config, path.is_file()
    if gguf:
        tensors = w.file.tensors
        params = sum(math.prod(t.shape) for t in tensors.values())
        quant = ", ".join(sorted({t.qtype.name for t in tensors.values() if len(t.shape) > 1}))
        pooling_type = _gguf_meta(path).get(f"{_gguf_meta(path).get('general.architecture')}.pooling_type")
        pooling = f"{GGUF_POOLING.get(int(pooling_type), '?') if pooling_type is not None else 'last'}, normalized"
        max_len = min(cfg.max_position_embeddings, DECODER_MAX_LEN)
    else:
        params = 0
        for f in w.files:
            with open(f, "rb") as fh:
                header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
            params += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
        quant = str(w.raw_config.get("torch_dtype") or w.raw_config.get("dtype") or "float32")
        p, max_len = (sentence_transformers_settings(path, cfg) if _has_st_pooling(path)
                      else (Pooling("last", True), cfg.max_position_embeddings))
        pooling, max_len = f"{p.mode}{', normalized' if p.normalize else ''}", min(max_len, DECODER_MAX_LEN)
    return {"format": "gguf" if gguf else "safetensors", "architecture": cfg.architecture,
            "kind": encoder_kind(path) or "embedding", "parameters": params, "context_length": max_len,
            "embedding_length": cfg.hidden_size, "layers": cfg.num_layers, "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads, "vocab_size": cfg.vocab_size, "quantization": quant, "pooling": pooling,
            "chat_template": None, "stop_tokens": []}
