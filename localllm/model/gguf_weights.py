"""A GGUF file's weights under HF names (the reader of `.gguf` checkpoints).

Tensors come out in HF's layout (rotate_half q/k row order) so the model and the exporters see
one layout whatever the source; the file's metadata becomes a ModelConfig by
`ModelConfig.from_gguf`.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import numpy as np
import torch

from ..config import ModelConfig
from ..tokenizer import LLMTokenizer
from . import gguf_blocks
from .errors import ModelLoadError
from .gguf import GGUFError, GGUFFile, dequantize, read_gguf
from .int4 import Int4Weight
from .moe import EXPERT_NAME, EXPERT_PART

# HF module -> llama.cpp's tensor name. Phi-3's fused modules keep their fusion there: attn_qkv,
# and ffn_up holding gate then up (llama.cpp's SWIGLU takes silu of the first half)
_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",  # MoE routers
}
# gpt-oss: the norm before the MLP is llama.cpp's post_attention_norm; the sinks a tensor per layer
_GGUF_GPT_OSS_NAMES = {"post_attention_layernorm": "post_attention_norm", "self_attn.sinks": "attn_sinks"}
# Gemma's four norms per layer: HF's post_attention_layernorm is the norm on the attention output
# there (llama.cpp's post_attention_norm), pre_feedforward_layernorm the one before the MLP (ffn_norm)
_GGUF_SANDWICH_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                        "post_feedforward_layernorm": "post_ffw_norm"}


def _qk_row_perm(n_heads: int, head_dim: int) -> torch.Tensor:
    """GGUF (llama) stores q/k rows for interleaved-pair RoPE; this index turns them into HF's
    rotate_half order: new row (h, a, b) = old row (h, b, a)."""
    return torch.arange(n_heads * head_dim).view(n_heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)


def _mapped(t) -> torch.Tensor:
    """A GGUF tensor's bytes as a flat uint8 tensor viewing the mapped file (no copy)."""
    with warnings.catch_warnings():  # read-only map: nothing writes through this view
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(t.data).reshape(-1))


class GGUFWeights:
    """A GGUF file's tensors under HF names, q/k rows in HF's rotate_half order: dequantized
    (`dense`), as exact int4 (`int4`), or as the file's own blocks for our CPU kernels."""

    def __init__(self, path: Path):
        try:
            self.file: GGUFFile = read_gguf(path)
        except GGUFError as e:
            raise ModelLoadError(str(e)) from None
        self.path = path
        self.arch = self.file.metadata.get("general.architecture")
        try:
            self.config = ModelConfig.from_gguf(self.file.metadata, self.file.tensors, self._floats)
        except (KeyError, TypeError) as e:
            raise ModelLoadError(f"{path}: GGUF metadata is missing a required key ({e})") from None
        except ValueError as e:
            raise ModelLoadError(f"{path}: {e}") from None
        c = self.config
        self.perms = {}
        if self.arch == "llama":  # llama.cpp un-permutes q/k for llama only
            self.perms = {"q_proj": _qk_row_perm(c.num_heads, c.head_dim),
                          "k_proj": _qk_row_perm(c.num_kv_heads, c.head_dim)}

    def _floats(self, name: str) -> list[float]:
        """Tensor `name`'s values (LongRoPE's factor sets are F32 tensors)."""
        t = self.file.tensors[name]
        return np.array(dequantize(t, self.file.read(t))).reshape(-1).tolist()

    def tokenizer(self) -> LLMTokenizer:
        try:
            return LLMTokenizer.from_gguf(self.file.metadata, str(self.path))
        except KeyError as e:
            raise ModelLoadError(f"{self.path}: GGUF tokenizer metadata is missing {e}") from None
        except ValueError as e:
            raise ModelLoadError(str(e)) from None

    def _gguf_name(self, name: str) -> str:
        if name == "model.embed_tokens.weight":
            return "token_embd.weight"
        if name == "lm_head.weight":
            return "output.weight"
        if name == "model.norm.weight":
            return "output_norm.weight"
        _, _, i, rest = name.split(".", 3)  # model.layers.{i}.{module}.{weight|bias}
        module, kind = rest.rsplit(".", 1)
        names = _GGUF_NAMES | _GGUF_SANDWICH_NAMES if self.config.sandwich_norms else _GGUF_NAMES
        if self.arch == "gpt-oss":
            names = names | _GGUF_GPT_OSS_NAMES
        return f"blk.{i}.{names[module]}.{kind}"

    def _tensor(self, name: str):
        ex = EXPERT_NAME.fullmatch(name)
        if ex:
            return self._expert_tensor(int(ex[1]), int(ex[2]), EXPERT_PART[ex[3]], ex[4])
        g = self._gguf_name(name)
        t = self.file.tensors.get(g)
        if t is None:
            raise ModelLoadError(f"{self.path}: tensor {g} is missing")
        return t

    def _expert_tensor(self, layer: int, e: int, part: str, kind: str = "weight"):
        """Expert e's matrix of a 3-D ffn_{gate,up,down}_exps tensor [E, rows, cols] (its bias: a row
        of the 2-D [E, rows] one, gpt-oss), as a tensor of its own (a slice of the mapped file); files
        from before llama.cpp fused the experts (the first Mixtral GGUFs) hold one ffn_{part}.{e}
        tensor each."""
        g = _expert_stack(layer, part, kind)
        t = self.file.tensors.get(g)
        if t is None:
            t = self.file.tensors.get(f"blk.{layer}.ffn_{part}.{e}.{kind}")
            if t is not None:
                return t
            raise ModelLoadError(f"{self.path}: tensor {g} is missing")
        n_exp = t.shape[0]
        size, rows = t.nbytes // n_exp, t.data.shape[0] // n_exp
        return dataclasses.replace(t, name=f"{g}[{e}]", shape=t.shape[1:], offset=t.offset + e * size, nbytes=size,
                                   data=t.data[e * rows:(e + 1) * rows])

    def _perm(self, name: str) -> torch.Tensor | None:
        return next((p for k, p in self.perms.items() if f".{k}." in name), None)

    def dense(self, name: str) -> torch.Tensor:
        t = self._tensor(name)
        w = torch.from_numpy(np.array(dequantize(t, self.file.read(t))))
        perm = self._perm(name)
        return w[perm] if perm is not None else w

    def int4(self, name: str) -> Int4Weight | None:
        """Q4_0 / Q4_1 blocks of 32 as an exact Int4Weight (group 32), else None."""
        t = self._tensor(name)
        kind = t.qtype.name
        if kind not in ("Q4_0", "Q4_1"):
            return None
        n, k = t.shape
        bsz = 18 if kind == "Q4_0" else 20
        raw = torch.from_numpy(self.file.read(t)).view(n, k // 32, bsz)
        d = raw[..., 0:2].contiguous().view(torch.float16).float().squeeze(-1)
        qs = raw[..., bsz - 16:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, k)
        if kind == "Q4_1":  # w = d*q + m = (q - 8)*d + (m + 8d)
            m = raw[..., 2:4].contiguous().view(torch.float16).float().squeeze(-1)
            zeros = m + 8 * d
        else:  # w = d*(q - 8)
            zeros = torch.zeros_like(d)
        w = Int4Weight(q, d.t().contiguous(), zeros.t().contiguous(), 32)
        perm = self._perm(name)
        return w.permute_rows(perm) if perm is not None else w

    def stacked_blocks(self, names: list[str], kinds: tuple[str, ...]
                       ) -> tuple[torch.Tensor, torch.Tensor | None, None] | None:
        """The file's own blocks of the parts `names` of a fused layer if their type is one of
        `kinds`, read side by side into one buffer (uint8 [N_1 + N_2 + ..., K / block values, block
        bytes]; read, not viewed through the map: they are repacked, and mapped pages would stay in
        our RSS, a whole MoE file's), and the row order `int4` applies over the stack (q/k into
        rotate_half order; None: as stored), and None (scales apart: HFWeights'); None where a part's
        type is not one of `kinds` or the parts differ in type or width."""
        ts = [self._tensor(n) for n in names]
        kind = ts[0].qtype.name
        if (kind not in kinds or not gguf_blocks.supported(kind) or any(len(t.shape) != 2 for t in ts)
                or any(t.qtype.name != kind or t.shape[1] != ts[0].shape[1] for t in ts)):
            return None
        k = ts[0].shape[1]
        buf = np.empty(sum(t.nbytes for t in ts), dtype=np.uint8)
        off, order, perms = 0, [], False
        for name, t in zip(names, ts):
            self.file.read(t, buf[off:off + t.nbytes])
            perm = self._perm(name)
            perms |= perm is not None
            first = sum(len(o) for o in order)
            order.append((torch.arange(t.shape[0]) if perm is None else perm) + first)
            off += t.nbytes
        blocks = torch.from_numpy(buf).view(-1, k // gguf_blocks.BLOCK_VALUES[kind], gguf_blocks.BLOCK_BYTES[kind])
        return blocks, torch.cat(order) if perms else None, None

    def shape(self, name: str) -> tuple[int, ...]:
        """`name`'s shape ([N, K] for a matrix)."""
        return tuple(self._tensor(name).shape)

    def kind(self, name: str) -> str:
        """The GGUF type `name` is stored in ("Q4_K", "F16", ...)."""
        ex = EXPERT_NAME.fullmatch(name)
        stack = ex and self.file.tensors.get(_expert_stack(int(ex[1]), EXPERT_PART[ex[3]]))
        return (stack or self._tensor(name)).qtype.name  # (an expert's type is its stack's: no slice taken)

    def blocks(self, name: str) -> gguf_blocks.Blocks:
        """`name`'s values as integers and per-group scales (exactly the file's; see gguf_blocks), in
        the row order `int4` gives (q/k into rotate_half order). ValueError for other types."""
        t = self._tensor(name)
        kind = t.qtype.name
        n, k = t.shape
        raw = torch.from_numpy(self.file.read(t)).view(n, k // gguf_blocks.BLOCK_VALUES[kind], -1)
        b = gguf_blocks.decode(kind, raw)
        perm = self._perm(name)
        return b if perm is None else b.rows(perm)

    def mapped_blocks(self, name: str) -> tuple[str, torch.Tensor] | None:
        """(type, the file's own blocks of `name`, uint8 [N, K / block values, block bytes], a view
        of the mapped file) for the block types gguf_blocks decodes; None for other types or a
        permuted tensor."""
        t = self._tensor(name)
        kind = t.qtype.name
        if not gguf_blocks.supported(kind) or self._perm(name) is not None or len(t.shape) != 2:
            return None
        n, k = t.shape
        return kind, _mapped(t).view(n, k // gguf_blocks.BLOCK_VALUES[kind], gguf_blocks.BLOCK_BYTES[kind])

    def has(self, name: str) -> bool:
        try:
            if EXPERT_NAME.fullmatch(name):
                self._tensor(name)
                return True
            return self._gguf_name(name) in self.file.tensors
        except (KeyError, ValueError, ModelLoadError):
            return False

    def extra_eos_ids(self) -> set[int]:
        return set()


def _expert_stack(layer: int, part: str, kind: str = "weight") -> str:
    """llama.cpp's name of a layer's experts' matrices stacked [E, rows, cols] (kind "bias": their
    biases [E, rows])."""
    return f"blk.{layer}.ffn_{part}_exps.{kind}"
