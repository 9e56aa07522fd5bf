"""One config-driven BERT-family encoder: BERT itself (all-MiniLM, bge, mxbai-embed-large,
snowflake-arctic-embed, ms-marco cross-encoders) and (XLM-)RoBERTa (bge-m3, multilingual-e5,
bge-reranker-v2-m3): the same layers, positions counted from pad_token_id + 1 and one token
type. Bidirectional attention, learned absolute positions, token types, post-LayerNorm
residuals, GELU MLP; optionally the sequence-classification head of a cross-encoder (BERT's
pooler + classifier, RoBERTa's dense + tanh + out_proj). nomic-bert (nomic-embed-text): the same
post-LN layers with RoPE on q/k instead of a position table (the decoder's RotaryEmbedding),
a SwiGLU MLP and no linear biases.

The forward takes a packed batch: the tokens of every input one after another ([T]) and the
length of each. The linears run on all T rows at once (no padding to the longest input);
attention is confined to each input by attending per group of equally long inputs (one SDPA
call per distinct length, inputs of one length batched together).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .layers import DenseLinear, RotaryEmbedding

# HF hidden_act -> the function; "gelu" is the exact (erf) GELU BERT was trained with
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swiglu": F.silu,  # nomic-bert's original config: silu(gate) * up
}


ROBERTA_TYPES = ("roberta", "xlm-roberta")


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    num_labels: int = 0  # > 0: a sequence-classification head (a cross-encoder)
    architecture: str = "BertModel"
    model_type: str = "bert"
    position_offset: int = 0  # RoBERTa: position ids start at pad_token_id + 1
    rope_theta: float | None = None  # nomic-bert: RoPE (NeoX halves) on q/k, no position table
    gated: bool = False  # nomic-bert: a SwiGLU MLP (the up linear holds gate rows, then up rows)

    @classmethod
    def from_hf(cls, d: dict) -> BertConfig:
        """A config.json of a BERT checkpoint; ValueError names what it cannot run."""
        if d.get("model_type") == "nomic_bert":
            return cls.nomic_from_hf(d)
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {d['position_embedding_type']!r} is not supported (absolute only)")
        act = d.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        arch = (d.get("architectures") or ["BertModel"])[0]
        labels = 0
        roberta = d.get("model_type") in ROBERTA_TYPES
        if arch.endswith("ForSequenceClassification"):
            labels = int(d.get("num_labels") or len(d.get("id2label") or {}) or 2)
        return cls(vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
                   num_layers=int(d["num_hidden_layers"]), num_heads=int(d["num_attention_heads"]),
                   intermediate_size=int(d["intermediate_size"]),
                   max_position_embeddings=int(d.get("max_position_embeddings", 512)),
                   type_vocab_size=int(d.get("type_vocab_size", 2)),
                   layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)), hidden_act=act, num_labels=labels,
                   architecture=arch, model_type=d.get("model_type", "bert"),
                   position_offset=int(d.get("pad_token_id", 1)) + 1 if roberta else 0)

    @classmethod
    def nomic_from_hf(cls, d: dict) -> BertConfig:
        """nomic-bert's config.json, in transformers' spelling (NomicBertConfig) or the original
        remote code's (GPT-2 style n_embd, n_layer, rotary_emb_base...)."""
        def get(*keys, default=None):
            return next((d[k] for k in keys if d.get(k) is not None), default)
        frac = float(d.get("rotary_emb_fraction", 1.0))
        if frac != 1.0 or d.get("rotary_emb_interleaved") or d.get("rotary_scaling_factor"):
            raise ValueError("nomic-bert with partial, interleaved or scaled rotary embeddings is not supported")
        rope = d.get("rope_parameters") or {}
        act = get("hidden_act", "activation_function", default="silu")
        if act not in ("silu", "swiglu"):
            raise ValueError(f"nomic-bert activation {act!r} is not supported (SwiGLU only)")
        return cls(vocab_size=int(d["vocab_size"]), hidden_size=int(get("hidden_size", "n_embd")),
                   num_layers=int(get("num_hidden_layers", "n_layer")),
                   num_heads=int(get("num_attention_heads", "n_head")),
                   intermediate_size=int(get("intermediate_size", "n_inner")),
                   max_position_embeddings=int(get("max_position_embeddings", "n_positions", default=2048)),
                   type_vocab_size=int(d.get("type_vocab_size", 2)),
                   layer_norm_eps=float(get("layer_norm_eps", "layer_norm_epsilon", default=1e-12)),
                   hidden_act="silu", architecture=(d.get("architectures") or ["NomicBertModel"])[0],
                   model_type="nomic_bert",
                   rope_theta=float(get("rotary_emb_base", default=rope.get("rope_theta", 1000.0))), gated=True)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class LayerNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


@dataclass
class Packed:
    """A batch of inputs laid end to end: what the forward needs besides the token ids."""

    lengths: list[int]
    positions: torch.Tensor  # [T] int64: position of each token in its input
    token_types: torch.Tensor  # [T] int64
    # (length, row indices [n, length], first row if the n inputs lie end to end else None) per
    # distinct length: the embedder sorts by length, so a group is usually one contiguous block
    groups: list[tuple[int, torch.Tensor, int | None]]

    @classmethod
    def of(cls, lengths: list[int], token_types: list[int] | None = None, device: str = "cpu") -> Packed:
        T = sum(lengths)
        positions = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        by_len: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            by_len.setdefault(n, []).append(starts[i])
        groups = [(n, (torch.tensor(s)[:, None] + torch.arange(n)[None]).to(device),
                   s[0] if all(b - a == n for a, b in zip(s, s[1:])) else None) for n, s in by_len.items()]
        types = torch.zeros(T, dtype=torch.long) if token_types is None else torch.tensor(token_types)
        return cls(lengths, positions.to(device), types.to(device), groups)

    @property
    def starts(self) -> list[int]:
        out, s = [], 0
        for n in self.lengths:
            out.append(s)
            s += n
        return out


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: Packed, scale: float) -> torch.Tensor:
    """q/k/v [T, H, D] -> [T, H*D]; each token attends to every token of its own input only."""
    T, H, D = q.shape
    out = q.new_empty(T, H, D)
    for L, rows, first in packed.groups:  # rows [n, L]: n inputs of length L
        if first is not None:  # one block of rows: views, no gather and scatter
            block = slice(first, first + rows.numel())
            qq, kk, vv = (t[block].view(-1, L, H, D).transpose(1, 2) for t in (q, k, v))
            out[block] = F.scaled_dot_product_attention(qq, kk, vv, scale=scale).transpose(1, 2).reshape(-1, H, D)
            continue
        qq, kk, vv = (t[rows].transpose(1, 2) for t in (q, k, v))  # [n, H, L, D]
        o = F.scaled_dot_product_attention(qq, kk, vv, scale=scale)
        out[rows] = o.transpose(1, 2)
    return out.reshape(T, H * D)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: BertConfig, qkv: nn.Module, o: nn.Module, attn_norm: LayerNorm, up: nn.Module,
                 down: nn.Module, mlp_norm: LayerNorm):
        super().__init__()
        self.qkv, self.o, self.attn_norm, self.up, self.down, self.mlp_norm = qkv, o, attn_norm, up, down, mlp_norm
        self.H, self.D = cfg.num_heads, cfg.head_dim
        # the up linear may apply the activation itself (fused into its GEMM: bf16x3.Bf16x3Linear)
        fused = not cfg.gated and getattr(up, "act", "none") == cfg.hidden_act
        self.act = (lambda h: h) if fused else ACTIVATIONS[cfg.hidden_act]
        self.gated = cfg.gated

    def forward(self, x: torch.Tensor, packed: Packed, scale: float, rope: RotaryEmbedding | None = None
                ) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(x).view(T, 3, self.H, self.D).unbind(1)
        if rope is not None:
            q, k = rope(packed.positions, q, k)
        x = self.attn_norm(x + self.o(varlen_attention(q, k, v, packed, scale)))  # post-LN, as BERT
        h = self.up(x)
        if self.gated:
            g, u = h.chunk(2, dim=-1)
            h = self.act(g) * u
        else:
            h = self.act(h)
        return self.mlp_norm(x + self.down(h))


class ClassifierHead(nn.Module):
    """A sequence-classification head on the first row: BertForSequenceClassification's pooler
    (dense + tanh) then classifier, or RobertaClassificationHead's dense + tanh then out_proj
    (the same arithmetic)."""

    def __init__(self, pooler: DenseLinear, classifier: DenseLinear):
        super().__init__()
        self.pooler, self.classifier = pooler, classifier

    def forward(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler(cls_rows)))


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig, word: torch.Tensor, position: torch.Tensor | None, token_type: torch.Tensor,
                 embed_norm: LayerNorm, layers: list[EncoderLayer], head: ClassifierHead | None = None,
                 device: str = "cpu"):
        super().__init__()
        self.cfg, self.device = cfg, device
        self.word = nn.Parameter(word, requires_grad=False)
        self.position = None if position is None else nn.Parameter(position, requires_grad=False)
        self.token_type = nn.Parameter(token_type, requires_grad=False)
        self.embed_norm = embed_norm
        self.layers = nn.ModuleList(layers)
        self.head = head
        self.scale = cfg.head_dim ** -0.5
        self.rope = None if cfg.rope_theta is None else RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, None, torch.float32).to(device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, packed: Packed) -> torch.Tensor:
        """Hidden states [T, hidden] of the packed inputs (the last layer's output)."""
        types = packed.token_types if self.cfg.type_vocab_size > 1 else torch.zeros_like(packed.token_types)
        x = self.word[input_ids]
        if self.position is not None:  # (BERT's order of the sums)
            x = x + self.position[packed.positions + self.cfg.position_offset]
        x = self.embed_norm(x + self.token_type[types])
        for layer in self.layers:
            x = layer(x, packed, self.scale, self.rope)
        return x

    @torch.inference_mode()
    def classify(self, hidden: torch.Tensor, packed: Packed) -> torch.Tensor:
        """The classification logits [B, num_labels] of each input (its first token: [CLS])."""
        if self.head is None:
            raise ValueError("this model has no classification head (not a cross-encoder)")
        return self.head(hidden[torch.tensor(packed.starts, device=hidden.device)])
