"""Checkpoints -> a ready LlamaModel: GGUF files and HF directories (safetensors only).

Both sources expose tensors under HF names with HF's rotate_half q/k row order, so the model
and the exporters see one layout. Linear layers are built in the precision the caller asks
for. A GGUF on CPU keeps the file's values, each matrix on the kernel of its type (exact
repacks): Q4_0/Q4_1/Q4_K on the int4 kernel, the other block types (Q8_0, Q6_K, Q5_*, IQ4_*,
Q3_K, Q2_K) on the int8-lane one, float and other types dequantized to fp32; nothing is
re-quantized. Elsewhere GGUF Q4_0/Q4_1 stay int4 and the rest is dequantized.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..config import ModelConfig, sliding_layers
from ..paths import safe_relative_name
from ..tokenizer import LLMTokenizer
from . import cache_file, gguf_blocks, quant_formats, w16  # quant_formats: AWQ / GPTQ
from .errors import ModelLoadError
from .gguf import GGUFError, GGUFFile, dequantize, read_gguf
from .int4 import Int4Weight, quantize_rtn
from .layers import (
    ConcatLinear,
    DenseLinear,
    DenseMatrix,
    Int4Linear,
    Int8Linear,
    Int8wLinear,
    LMHead,
    Q8Matrix,
    RMSNorm,
    W16Linear,
)
from .llama import DecoderLayer, LlamaModel
from .moe import Int4Experts, LoopExperts, MoE, expert_tensor_names, make_experts

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PRECISIONS = ("auto", "float32", "bfloat16", "float16", "int8", "int4")


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
# Gemma's four norms per layer: HF's post_attention_layernorm is the norm on the attention output
# there (llama.cpp's post_attention_norm), pre_feedforward_layernorm the one before the MLP (ffn_norm)
_GGUF_SANDWICH_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                        "post_feedforward_layernorm": "post_ffw_norm"}
# GGUF general.architecture -> the HF architecture it holds
_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
               "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
               "gemma3": "Gemma3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
# llama.cpp sizes Gemma's attention scale by the model: 1/sqrt(hidden / heads) for the 27B models
# (query_pre_attn_scalar 144 / 168, known by their layer counts), 1/sqrt(head_dim) otherwise
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# one expert's matrix of an MoE layer (HF names: Mixtral's w1/w3/w2, Qwen3-MoE's gate/up/down_proj)
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


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
    def __init__(self, path: Path):
        try:
            self.file: GGUFFile = read_gguf(path)
        except GGUFError as e:
            raise ModelLoadError(str(e)) from None
        self.path = path
        meta = self.file.metadata
        arch = meta.get("general.architecture")
        if arch not in _GGUF_ARCHS:
            raise ModelLoadError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(_GGUF_ARCHS)})")
        self.arch = arch

        def m(key, default=None):
            return meta.get(f"{arch}.{key}", default)

        try:
            heads = m("attention.head_count")
            hidden = m("embedding_length")
            head_dim = m("attention.key_length") or hidden // heads
            self.config = ModelConfig(**{**dict(
                vocab_size=m("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
                hidden_size=hidden, intermediate_size=m("feed_forward_length"),
                num_layers=m("block_count"), num_heads=heads,
                num_kv_heads=m("attention.head_count_kv") or heads,
                head_dim=head_dim,
                rms_norm_eps=float(m("attention.layer_norm_rms_epsilon", 1e-5)),
                rope_theta=float(m("rope.freq_base", 10000.0)),
                max_position_embeddings=int(m("context_length", 4096)),
                tie_word_embeddings="output.weight" not in self.file.tensors,
                qkv_bias="blk.0.attn_q.bias" in self.file.tensors,
                qk_norm="blk.0.attn_q_norm.weight" in self.file.tensors,
                partial_rotary_factor=m("rope.dimension_count", head_dim) / head_dim,
                # Phi-3 only, as from_hf (llama.cpp writes 0 for "none")
                sliding_window=(m("attention.sliding_window") or None) if arch == "phi3" else None,
                rope_scaling=self._longrope(m),
                architecture=_GGUF_ARCHS[arch],
                model_type=arch,
            ), **(self._gemma(m, arch, heads, hidden, head_dim) if arch.startswith("gemma") else {})})
        except (KeyError, TypeError) as e:
            raise ModelLoadError(f"{path}: GGUF metadata is missing a required key ({e})") from None
        if "rope_freqs.weight" in self.file.tensors:
            raise ModelLoadError(f"{path}: GGUF rope_freqs (Llama-3.1 rope scaling) is not supported yet; "
                                 "use the HF checkpoint of this model")
        self.config = dataclasses.replace(self.config, **self._moe_fields(m))
        c = self.config
        self.perms = {}
        if arch == "llama":  # llama.cpp un-permutes q/k for llama only
            self.perms = {"q_proj": _qk_row_perm(c.num_heads, c.head_dim),
                          "k_proj": _qk_row_perm(c.num_kv_heads, c.head_dim)}

    def _moe_fields(self, m) -> dict:
        """llama.cpp's MoE metadata: Mixtral is arch 'llama' with experts (their width is
        feed_forward_length); qwen3moe has expert_feed_forward_length. A layer is sparse where
        it has a router (ffn_gate_inp); top-k weights renormalised unless expert_weights_norm
        says otherwise (llama.cpp renormalises for both)."""
        n = int(m("expert_count", 0) or 0)
        if not n:
            return {}
        L = self.config.num_layers
        inter = m("expert_feed_forward_length") or m("feed_forward_length")
        fields = {"num_experts": n, "num_experts_per_tok": int(m("expert_used_count")),
                  "moe_intermediate_size": int(inter), "norm_topk_prob": bool(m("expert_weights_norm", True)),
                  "moe_layers": tuple(f"blk.{i}.ffn_gate_inp.weight" in self.file.tensors for i in range(L)),
                  "intermediate_size": int(m("feed_forward_length") or inter)}
        # HF's names for the model type (to_hf writes it)
        fields["model_type"] = "mixtral" if self.arch == "llama" else "qwen3_moe"
        if self.arch == "llama":
            fields["architecture"] = "MixtralForCausalLM"
        return fields

    def _gemma(self, m, arch: str, heads: int, hidden: int, head_dim: int) -> dict:
        """Gemma 2/3 as llama.cpp (0.3.36's) reads them, with its values for absent keys: the
        window (Gemma 2: 4096; Gemma 3: none, every layer global); which layers slide (the file's
        attention.sliding_window_pattern, a period or a flag per layer, else every other for
        Gemma 2, five in six for Gemma 3); the local RoPE base (rope.freq_base_swa, else Gemma
        2's global one, Gemma 3's 10000); soft-caps (Gemma 2: attention 50, final 30; Gemma 3
        none on attention, a final one only when the file has it)."""
        n = m("block_count")
        gemma2 = arch == "gemma2"
        window = int(m("attention.sliding_window") or (4096 if gemma2 else 0)) or None
        pattern = m("attention.sliding_window_pattern") or (2 if gemma2 else 6)
        slides = pattern if isinstance(pattern, list) else sliding_layers(n, pattern)
        local_theta = m("rope.freq_base_swa") or (None if gemma2 else 10000.0)
        kind, factor = m("rope.scaling.type"), m("rope.scaling.factor")
        return dict(
            layer_windows=tuple(window if s else None for s in slides),
            rope_scaling={"rope_type": "linear", "factor": float(factor)} if kind == "linear" and factor else None,
            rope_local_theta=None if local_theta is None else float(local_theta),
            query_pre_attn_scalar=float(hidden // heads if n == _GEMMA_27B_LAYERS[arch] else head_dim),
            attn_logit_softcap=float(m("attn_logit_softcapping", 50.0)) if gemma2 else None,
            final_logit_softcap=float(m("final_logit_softcapping", 30.0 if gemma2 else 0.0)) or None,
            hidden_act="gelu_tanh", scale_embeddings=True, sandwich_norms=True,
        )

    def _longrope(self, m) -> dict | None:
        """LongRoPE as llama.cpp's converter stores it: the factor sets as F32 tensors, the
        original context and the cos/sin factor as metadata."""
        if "rope_factors_long.weight" not in self.file.tensors:
            return None
        long, short = (self.file.tensors[f"rope_factors_{k}.weight"] for k in ("long", "short"))
        ctx, orig = int(m("context_length", 4096)), int(m("rope.scaling.original_context_length", 4096))
        attn = m("rope.scaling.attn_factor")
        if attn is None:  # the converter's (and transformers') default
            attn = math.sqrt(1 + math.log(ctx / orig) / math.log(orig)) if ctx > orig else 1.0
        return {"rope_type": "longrope", "original_max_position_embeddings": orig, "attention_factor": float(attn),
                "long_factor": np.array(dequantize(long, self.file.read(long))).reshape(-1).tolist(),
                "short_factor": np.array(dequantize(short, self.file.read(short))).reshape(-1).tolist()}

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
        return f"blk.{i}.{names[module]}.{kind}"

    def _tensor(self, name: str):
        ex = _EXPERT.fullmatch(name)
        if ex:
            return self._expert_tensor(int(ex[1]), int(ex[2]), _EXPERT_PART[ex[3]])
        g = self._gguf_name(name)
        t = self.file.tensors.get(g)
        if t is None:
            raise ModelLoadError(f"{self.path}: tensor {g} is missing")
        return t

    def _expert_tensor(self, layer: int, e: int, part: str):
        """Expert e's matrix of a 3-D ffn_{gate,up,down}_exps tensor [E, rows, cols], as a tensor
        of its own (a slice of the mapped file); files from before llama.cpp fused the experts
        (the first Mixtral GGUFs) hold one ffn_{part}.{e} tensor each."""
        g = f"blk.{layer}.ffn_{part}_exps.weight"
        t = self.file.tensors.get(g)
        if t is None:
            t = self.file.tensors.get(f"blk.{layer}.ffn_{part}.{e}.weight")
            if t is not None:
                return t
            raise ModelLoadError(f"{self.path}: tensor {g} is missing")
        n_exp, n = t.shape[0], t.shape[1]
        size = t.nbytes // n_exp
        return dataclasses.replace(t, name=f"{g}[{e}]", shape=t.shape[1:], offset=t.offset + e * size, nbytes=size,
                                   data=t.data[e * n:(e + 1) * n])

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

    def q4_blocks(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The file's own Q4_0 / Q4_1 blocks of `name`, uint8 [N, K/32, 18 | 20] (read, not viewed
        through the map: they are repacked, and mapped pages would stay in our RSS, a whole MoE
        file's), with the row order `int4` applies (q/k into rotate_half order; None: as
        stored); None for other types."""
        t = self._tensor(name)
        if t.qtype.name not in ("Q4_0", "Q4_1"):
            return None
        n, k = t.shape
        blocks = torch.from_numpy(self.file.read(t)).view(n, k // 32, 18 if t.qtype.name == "Q4_0" else 20)
        return blocks, self._perm(name)

    def kind(self, name: str) -> str:
        """The GGUF type `name` is stored in ("Q4_K", "F16", ...)."""
        return self._tensor(name).qtype.name

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

    def q8_blocks(self, name: str) -> torch.Tensor | None:
        """The file's own Q8_0 blocks of `name`, uint8 [N, K/32, 34] (a view of the mapped file);
        None for other types or a permuted tensor."""
        t = self._tensor(name)
        if t.qtype.name != "Q8_0" or self._perm(name) is not None:
            return None
        n, k = t.shape
        return _mapped(t).view(n, k // 32, 34)

    def has(self, name: str) -> bool:
        try:
            return self._gguf_name(name) in self.file.tensors
        except (KeyError, ValueError):
            return False

    def extra_eos_ids(self) -> set[int]:
        return set()


class HFWeights:
    def __init__(self, path: Path):
        self.path = path
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelLoadError(f"{path}: no config.json (not a Hugging Face model directory)")
        try:
            self.raw_config = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{cfg_file}: invalid JSON ({e})") from None
        try:
            self.config = ModelConfig.from_hf(self.raw_config)
        except (KeyError, ValueError) as e:
            raise ModelLoadError(f"{cfg_file}: {e}") from None
        self.quant = quant_formats.read_quant_config(path, self.raw_config)
        self.files = self._weight_files()
        self.index = self._index()

    def _weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError) as e:
                raise ModelLoadError(f"{index}: invalid index ({e})") from None
            bad = [n for n in names if not safe_relative_name(n)]
            if bad:  # the index comes from the hub too: a shard is a file in this folder, never ../x
                raise ModelLoadError(f"{index}: shard name {bad[0]!r} is not a file name inside {self.path}")
            files = [self.path / n for n in names]
            missing = [str(f) for f in files if not f.is_file()]
            if missing:
                raise ModelLoadError(f"{self.path}: shard(s) listed in the index are missing: {', '.join(missing)}")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            pickles = [p.name for p in self.path.glob("*.bin")] + [p.name for p in self.path.glob("*.pth")]
            hint = f" (found {', '.join(pickles)}: pickle checkpoints are never loaded)" if pickles else ""
            raise ModelLoadError(f"{self.path}: no *.safetensors weights{hint}")
        return files

    def _index(self) -> dict:
        from safetensors import safe_open

        index = {}
        for f in self.files:
            try:
                end = _safetensors_data_end(f)
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ModelLoadError(f"{f}: corrupt safetensors header ({e})") from None
            if end > f.stat().st_size:
                raise ModelLoadError(f"{f}: truncated safetensors file (needs {end} bytes, has {f.stat().st_size})")
            try:
                with safe_open(str(f), framework="pt") as h:
                    index.update(dict.fromkeys(h.keys(), f))
            except Exception as e:
                raise ModelLoadError(f"{f}: corrupt safetensors file ({e})") from None
        # a multimodal checkpoint (Gemma 3 4B+) holds the text model under a prefix: older
        # transformers wrote language_model.model.*, newer model.language_model.*
        self.stored = {}
        for prefix in ("model.language_model.", "language_model.model."):
            if "model.embed_tokens.weight" not in index and prefix + "embed_tokens.weight" in index:
                self.stored = {"model." + k[len(prefix):]: k for k in index if k.startswith(prefix)}
                index.update({ours: index[k] for ours, k in self.stored.items()})
        return index

    def has(self, name: str) -> bool:
        return name in self.index

    def _fused_expert(self, name: str) -> torch.Tensor | None:
        """Expert layouts as transformers 5 holds them in memory (and writes them when its
        conversion is off): the experts fused per layer under mlp.experts, gate_up_proj
        [E, 2I, H] (gate rows, then up) and down_proj [E, H, I]; the router as mlp.gate."""
        from safetensors import safe_open

        ex = _EXPERT.fullmatch(name)
        router = re.fullmatch(r"(model\.layers\.\d+)\.block_sparse_moe\.gate\.weight", name)
        if router:
            return self.dense(f"{router[1]}.mlp.gate.weight") if self.has(f"{router[1]}.mlp.gate.weight") else None
        if not ex:
            return None
        part = _EXPERT_PART[ex[3]]
        fused = f"model.layers.{ex[1]}.mlp.experts.{'down_proj' if part == 'down' else 'gate_up_proj'}"
        if fused not in self.index:
            return None
        with safe_open(str(self.index[fused]), framework="pt") as h:
            w = h.get_slice(fused)[int(ex[2])]  # this expert's rows only
        half = w.shape[0] // 2
        return w if part == "down" else w[:half] if part == "gate" else w[half:]

    def dense(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        f = self.index.get(name)
        if f is None:
            fused = self._fused_expert(name)
            if fused is not None:
                return fused
        if f is None and self.quant is not None and name.endswith(".weight") and \
                self.has(name[: -len("weight")] + "qweight"):
            return quant_formats.load_dense(self, name)  # a packed int4 module, dequantized
        if f is None:
            raise ModelLoadError(f"{self.path}: tensor {name} is missing")
        with safe_open(str(f), framework="pt") as h:
            return h.get_tensor(self.stored.get(name, name))

    def int4(self, name: str) -> Int4Weight | None:
        if self.quant is None:
            return None
        return quant_formats.load_int4(self, name)

    def tokenizer(self) -> LLMTokenizer:
        try:
            return LLMTokenizer.from_dir(self.path, self.extra_eos_ids())
        except (FileNotFoundError, ValueError) as e:
            raise ModelLoadError(str(e)) from None

    def extra_eos_ids(self) -> set[int]:
        gen = self.path / "generation_config.json"
        ids = set()
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        eos = self.raw_config.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return {int(i) for i in ids}


def _safetensors_data_end(f: Path) -> int:
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        if n > f.stat().st_size:
            raise ValueError(f"header length {n} exceeds the file")
        header = json.loads(fh.read(n))
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    return 8 + n + (max(ends) if ends else 0)


def open_weights(path: str | os.PathLike):
    path = Path(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: unsupported model file (expected a .gguf file or a model directory)")
        return GGUFWeights(path)
    if path.is_dir():
        return HFWeights(path)
    raise ModelLoadError(f"{path}: no such file or directory")


@dataclass
class LoadedModel:
    model: LlamaModel
    tokenizer: LLMTokenizer
    config: ModelConfig
    eos_ids: set[int]
    precision: str  # what the weights run in, for display
    kv_dtype: torch.dtype
    source: str
    extra: dict = field(default_factory=dict)


def _resolve_precision(precision: str, weights, device: str) -> tuple[str, torch.dtype]:
    """-> (linear mode, activation dtype). On CPU the int4/int8 kernels take bf16 inputs but the
    residual stream, attention and KV cache stay fp32: that keeps results independent of how
    requests are batched (bf16 attention flipped greedy tokens between batch shapes)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    cfg = weights.config
    # the first layer's MLP (an MoE layer: its first expert's), as stored
    first = ("model.layers.0." + cfg.checkpoint_linears()["gate_up"][0] + ".weight" if not cfg.is_moe_layer(0)
             else expert_tensor_names(cfg, 0)[1][0][0])
    native_int4 = isinstance(weights, GGUFWeights) and (
        weights.int4(first) is not None or (device == "cpu" and (gguf_blocks.supported(weights.kind(first)) or
                                                               weights.kind(first) in w16.GGUF_KINDS)))
    quantized = isinstance(weights, HFWeights) and weights.quant is not None
    if precision == "auto":
        if native_int4 or quantized:
            return "int4", (torch.float32 if device == "cpu" else torch.float16)
        # a bf16/fp16 checkpoint on CPU: its own values on our 16-bit kernel, fp32 math (as "float32"
        # up to summation order, half the bytes; BENCHMARKS.md); --quant fp32 keeps an fp32 copy
        if device == "cpu" and w16.stored_dtype(weights, first) is not None and w16.kernel_available():
            return "w16", torch.float32
        return ("float32", torch.float32) if device == "cpu" else ("bfloat16", torch.bfloat16)
    if precision in DTYPES:
        return precision, DTYPES[precision]
    return precision, (torch.float32 if device == "cpu" else torch.float16)


def _keep_dense(cfg: ModelConfig, mode: str, device: str, cpu_kernel: bool) -> bool:
    """Keep fp32 copies of int4 weights for prefill GEMMs (Int4Linear.dense) only where they pay:
    with torch's int4 kernel (2.3x faster at 512 rows) on a small model (8x the int4 bytes of RAM).
    Our kernel prefills as fast without them (SmolLM2-135M, 2 threads, 160-1000 tokens:
    502-656 tok/s either way, measured 2026-12-01) and they cost 425 MB there."""
    if mode != "int4" or device != "cpu":
        return False
    from localllm_kernels import cpu_int4

    if cpu_kernel and cpu_int4.load():
        return False
    from ..hardware import available_memory

    need = 4 * (cfg.num_params - cfg.vocab_size * cfg.hidden_size)
    return need <= min(2 << 30, available_memory("cpu") // 8)


def _gguf_q4_linear(weights: GGUFWeights, names: list[str], bias: torch.Tensor | None) -> Int4Linear | None:
    """GGUF Q4_0 / Q4_1 parts straight into our int4 kernel's layout by one C++ shuffle (no
    unpacked or fp32 copy of the weights on the way: first loads ~7x faster); None when the
    parts or this CPU do not allow it."""
    from localllm_kernels import cpu_int4

    parts = [weights.q4_blocks(n) for n in names]
    if any(p is None for p in parts):
        return None
    raws = [r for r, _ in parts]
    if len({r.shape[2] for r in raws}) != 1:
        return None
    n, k = sum(r.shape[0] for r in raws), raws[0].shape[1] * 32
    if not (cpu_int4.fits(n, k, 32) and cpu_int4.load()):
        return None
    rows, off = [], 0
    for r, perm in parts:  # each part's rows in the order `int4` gives them, offset in the stack
        rows.append((torch.arange(r.shape[0]) if perm is None else perm) + off)
        off += r.shape[0]
    packed = cpu_int4.pack_gguf(raws, torch.cat(rows), k)
    if packed is None:
        return None
    return Int4Linear.from_kernel_tensors({"qw": packed[0], "qsc": packed[1]}, n, 32, bias)


_INT4_KINDS = ("Q4_0", "Q4_1", "Q4_K")  # affine 4-bit groups of 32: the int4 kernel's layout


def _gguf_kernel(kind: str, n: int, k: int) -> str:
    """Which CPU kernel runs a GGUF matrix of this type: "int4" (cpu_int4), "int8" (cpu_int8, every
    other type with an exact integer decoding) or "dense" (fp32 values: float types, the rest)."""
    from localllm_kernels import cpu_int4, cpu_int8

    if kind in w16.GGUF_KINDS:
        return "w16" if w16.kernel_available() else "dense"
    if not gguf_blocks.supported(kind):
        return "dense"
    if kind in _INT4_KINDS and cpu_int4.fits(n, k, 32) and cpu_int4.load():
        return "int4"
    return "int8" if cpu_int8.fits(n, k, gguf_blocks.GROUP[kind]) and cpu_int8.load() else "dense"


def _gguf_run_linear(weights: GGUFWeights, names: list[str], kernel: str, bias: torch.Tensor | None) -> nn.Module:
    """One kernel's linear over consecutive parts of a fused layer (their rows stacked)."""
    if kernel == "dense":
        return DenseLinear(torch.cat([weights.dense(n).float() for n in names]), bias)
    if kernel == "w16":
        return w16.linear(weights, names, bias)
    parts = [weights.blocks(n) for n in names]
    n = sum(p.q.shape[0] for p in parts)
    if kernel == "int4":
        from localllm_kernels import cpu_int4

        d = torch.cat([p.d for p in parts])
        m = torch.cat([p.m if p.m is not None else -p.zero * p.d for p in parts])  # Q4_0: -8d, exact
        qw, qsc = cpu_int4.pack_dm(torch.cat([p.q for p in parts]), d, m)
        return Int4Linear.from_kernel_tensors({"qw": qw, "qsc": qsc}, n, 32, bias)
    from localllm_kernels import cpu_int8

    # one group size, zero point and scale form for the stack: 32-groups split into 16s, and parts
    # of different zero points (or with offsets) all with offsets m = -zero * d: exact
    group = min(p.group for p in parts)
    zero = max(p.zero for p in parts)
    sym = all(p.m is None and p.zero == zero for p in parts)

    def per(t: torch.Tensor, g: int) -> torch.Tensor:
        return t.repeat_interleave(g // group, dim=1)

    d = torch.cat([per(p.d, p.group) for p in parts])
    m = None if sym else torch.cat([per(p.m if p.m is not None else -p.zero * p.d, p.group) for p in parts])
    bits = cpu_int8.preferred_bits(max(p.bits for p in parts))
    qw, qsc = cpu_int8.pack(torch.cat([p.q for p in parts]), d, m, zero, bits)
    return Int8wLinear(qw, qsc, n, group, zero, bias)


def _gguf_kernel_linear(weights: GGUFWeights, names: list[str], bias: torch.Tensor | None) -> nn.Module:
    """A GGUF linear on our CPU kernels, each part on the kernel of its type (a K-quant mix stores
    the parts of one fused layer in different types): runs of parts sharing a kernel become one
    matrix, several runs a ConcatLinear. The weights are exactly the file's values."""
    kernels = []
    for name in names:
        n, k = weights._tensor(name).shape
        kernels.append(_gguf_kernel(weights.kind(name), n, k))
    runs: list[tuple[str, list[str]]] = []
    for name, kern in zip(names, kernels):
        if runs and runs[-1][0] == kern:
            runs[-1][1].append(name)
        else:
            runs.append((kern, [name]))
    sizes = [sum(weights._tensor(n).shape[0] for n in run) for _, run in runs]
    biases = [None] * len(runs) if bias is None else list(bias.split(sizes))
    linears = [_gguf_run_linear(weights, run, kern, b) for (kern, run), b in zip(runs, biases)]
    return linears[0] if len(linears) == 1 else ConcatLinear(linears)


def _linear(weights, names: list[str], mode: str, act_dtype: torch.dtype, device: str, dense: bool = False,
            cpu_kernel: bool = True):
    biases = [n.replace(".weight", ".bias") for n in names]
    bias = torch.cat([weights.dense(b).float() for b in biases]) if all(weights.has(b) for b in biases) else None
    if mode == "w16":
        return w16.linear(weights, names, bias)
    if mode == "int4" and device == "cpu" and cpu_kernel and not dense and isinstance(weights, GGUFWeights):
        fast = _gguf_q4_linear(weights, names, bias)
        if fast is not None:
            return fast
        return _gguf_kernel_linear(weights, names, bias)
    if mode == "int4":
        parts = [weights.int4(n) for n in names]
        if all(p is not None for p in parts):
            if Int4Weight.can_cat(parts):
                return Int4Linear(Int4Weight.cat(parts), act_dtype, bias, device, dense, cpu_kernel=cpu_kernel)
            # act-order parts with different input permutations: one int4 matmul each
            sizes = [p.shape[0] for p in parts]
            bs = [None] * len(parts) if bias is None else list(bias.split(sizes))
            return ConcatLinear([Int4Linear(p, act_dtype, b, device, cpu_kernel=cpu_kernel) for p, b in zip(parts, bs)])
    w = torch.cat([weights.dense(n).float() for n in names])
    # a GGUF's values are used as stored: a type without a kernel here stays exact (dense)
    prequantized = isinstance(weights, GGUFWeights) or (isinstance(weights, HFWeights) and weights.quant is not None)
    if mode == "int4" and not prequantized:  # quantize on load: largest group that divides K
        group = next((g for g in (128, 64, 32) if w.shape[1] % g == 0), None)
        if group is not None:
            return Int4Linear(quantize_rtn(w, group), act_dtype, bias, device, dense, cpu_kernel=cpu_kernel)
    if mode == "int8" and device == "cpu":
        return Int8Linear(w, act_dtype, bias)
    return DenseLinear(w.to(device, act_dtype), None if bias is None else bias.to(device, act_dtype))


def _trim_heap() -> None:
    """Give the C heap's free pages back to the OS. glibc keeps them: repacking an MoE layer's
    experts one by one on torch's int4 path (each a few short-lived copies) left ~2.5x the
    experts' size in RSS, 18.7 GB of peak for a 4.3 GB OLMoE-shaped GGUF."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _moe_block(weights, cfg: ModelConfig, layer: int, mode: str, act_dtype: torch.dtype, device: str,
               cpu_kernel: bool, cache: ConvertCache | None) -> MoE:
    """One MoE layer: the router exact in fp32, each expert's gate/up (one fused linear) and down
    in the layer precision (GGUF Q4 experts repacked, HF weights RTN-quantized for int4), stacked
    for our int4 MoE op where the kernel takes them; from the conversion cache when it has them."""
    router, names = expert_tensor_names(cfg, layer)

    def expert(e: int) -> tuple:
        g, u, d = names[e]
        return (_linear(weights, [g, u], mode, act_dtype, device, cpu_kernel=cpu_kernel),
                _linear(weights, [d], mode, act_dtype, device, cpu_kernel=cpu_kernel))

    def build_experts():
        experts = make_experts(expert, cfg.num_experts, cfg.moe_intermediate_size)
        _trim_heap()
        return experts

    def build_router():
        return weights.dense(router).float().to(device)

    if cache:
        experts = cache.experts(f"{layer}.experts", cfg.num_experts, cfg.moe_intermediate_size, build_experts)
        router_w = cache.tensor(router, build_router)
    else:
        experts, router_w = build_experts(), build_router()
    return MoE(router_w, experts, cfg.num_experts_per_tok, cfg.norm_topk_prob)


def weights_fingerprint(path: str | os.PathLike, *how) -> str:
    """Identity of a checkpoint on disk (path, size and mtime of each file) plus how it was loaded:
    the key of everything derived from the weights and cached between processes."""
    import hashlib

    path = Path(path).resolve()
    files = [path] if path.is_file() else sorted(f for f in path.iterdir() if f.is_file())
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update("|".join(map(str, how)).encode())
    return h.hexdigest()


class ConvertCache:
    """What loading a GGUF on CPU computes (int4pack repacks, MoE layers' stacked experts, the fp32
    embedding, the int4 copy of the head) saved once per file as safetensors under ~/.cache/localllm/converted, keyed by the
    file's path, size and mtime: a later `localllm run` skips the conversion (see BENCHMARKS.md).
    Written durably with a crc32 of every tensor (cache_file); a file that does not match is
    converted again, never used."""

    # 5: MoE experts (Int4Experts' stacks or each looped expert) and routers; 6: crc32s; 7: GGUF types
    # beyond Q4_0/Q4_1 on our kernels (Int8wLinear, ConcatLinear of mixed parts), none re-quantized
    VERSION = 7

    def __init__(self, file: Path, dense: bool = False, cpu_kernel: bool = True):
        from localllm_kernels import cpu_int4

        from ..paths import cache_home

        # the buffers differ by int4 kernel (ours or torch's), so does the cache
        key = weights_fingerprint(file, torch.__version__, f"v{self.VERSION}", f"dense={dense}",
                                  f"vnni={cpu_kernel and cpu_int4.load()}")
        self.stem = file.stem
        self.path = cache_home() / "converted" / f"{self.stem}-{key[:16]}.safetensors"
        self.tensors: dict[str, torch.Tensor] = {}
        self.hit = False
        self._check: cache_file.Check | None = None
        if self.path.is_file():
            try:  # the tensors' crc32s are checked in threads while the loader builds from them
                self.tensors, self._check = cache_file.open_checked(self.path, torch.get_num_threads())
                self.hit = True
            except cache_file.DamagedFile as e:  # truncated, or from before checksums: convert, overwrite
                log.warning("the conversion cache %s is damaged (%s): converting again", self.path, e)

    @staticmethod
    def open(path, weights, mode: str, device: str, dense: bool, cpu_kernel: bool) -> ConvertCache | None:
        if not (isinstance(weights, GGUFWeights) and mode == "int4" and device == "cpu"):
            return None
        return ConvertCache(Path(path), dense, cpu_kernel)

    def linear(self, key: str, build):
        """The cached Int4Linear `key`, or build() (remembered when it is a plain Int4Linear)."""
        m = self._cached_linear(key)
        if m is None:
            m = build()
            if self._keepable(m):
                self._keep_linear(key, m)
        return m

    def experts(self, key: str, n: int, inter: int, build) -> nn.Module:
        """The cached experts `key` of an MoE layer (Int4Experts from its stacks, or LoopExperts from
        each expert's Int4Linears), or build() (remembered when all of it is int4)."""
        t = self.tensors
        if self.hit and f"{key}.w1" in t:
            return Int4Experts(*(t[f"{key}.{b}"] for b in ("w1", "s1", "w2", "s2")), int(t[f"{key}.group1"]),
                               int(t[f"{key}.group2"]), inter)
        keys = [f"{key}.{e}.{part}" for e in range(n) for part in ("gate_up", "down")]
        linears = [self._cached_linear(k) for k in keys] if self.hit else [None]
        if all(x is not None for x in linears):
            return LoopExperts(linears[0::2], linears[1::2])
        m = build()
        if isinstance(m, Int4Experts):
            t.update({f"{key}.{b}": getattr(m, b) for b in ("w1", "s1", "w2", "s2")})
            t.update({f"{key}.group1": torch.tensor(m.group1), f"{key}.group2": torch.tensor(m.group2)})
        elif isinstance(m, LoopExperts):
            linears = [x for pair in zip(m.gate_up, m.down) for x in pair]
            if all(self._keepable(x) for x in linears):
                for k, x in zip(keys, linears):
                    self._keep_linear(k, x)
        return m

    def _cached_linear(self, key: str) -> nn.Module | None:
        t = self.tensors
        if self.hit and f"{key}.parts" in t:  # a ConcatLinear
            parts = [self._cached_linear(f"{key}.part{i}") for i in range(int(t[f"{key}.parts"]))]
            return None if any(p is None for p in parts) else ConcatLinear(parts)
        if not (self.hit and f"{key}.group" in t):
            return None
        if f"{key}.qw8" in t:
            return Int8wLinear(t[f"{key}.qw8"], t[f"{key}.qsc8"], int(t[f"{key}.n"]), int(t[f"{key}.group"]),
                               int(t[f"{key}.zero"]), t.get(f"{key}.bias"))
        names = ("qw", "qsc") if f"{key}.qw" in t else ("packed", "scales_zeros")
        return Int4Linear.from_kernel_tensors({n: t[f"{key}.{n}"] for n in names}, int(t[f"{key}.n"]),
                                              int(t[f"{key}.group"]), t.get(f"{key}.bias"), t.get(f"{key}.dense"))

    @staticmethod
    def _keepable(m) -> bool:
        if isinstance(m, ConcatLinear):
            return all(ConvertCache._keepable(p) for p in m.parts)
        return isinstance(m, Int8wLinear) or (isinstance(m, Int4Linear) and m.in_perm is None and not m.cuda_path)

    def _keep_linear(self, key: str, m: nn.Module) -> None:
        t = self.tensors
        if isinstance(m, ConcatLinear):
            t[f"{key}.parts"] = torch.tensor(len(m.parts))
            for i, p in enumerate(m.parts):
                self._keep_linear(f"{key}.part{i}", p)
            return
        t.update({f"{key}.{n}": v for n, v in m.kernel_tensors().items()})
        t.update({f"{key}.group": torch.tensor(m.group_size), f"{key}.n": torch.tensor(m.out_features)})
        if isinstance(m, Int8wLinear):
            t[f"{key}.zero"] = torch.tensor(m.zero)
        if m.bias is not None:
            t[f"{key}.bias"] = m.bias.data
        if getattr(m, "dense", None) is not None:
            t[f"{key}.dense"] = m.dense

    def tensor(self, key: str, build) -> torch.Tensor:
        if self.hit and key in self.tensors:
            return self.tensors[key]
        self.tensors[key] = t = build()
        return t

    def intact(self) -> bool:
        """Waits for the check of a cached file: False when it is damaged (then removed, so that
        loading again converts the weights anew), True otherwise."""
        if self._check is None:
            return True
        why, self._check = self._check.wait(), None
        if why is None:
            return True
        log.warning("the conversion cache %s is damaged (%s): converting again", self.path, why)
        self.tensors, self.hit = {}, False
        try:
            self.path.unlink(missing_ok=True)
        except OSError as e:  # else loading again would read it again
            raise ModelLoadError(f"the conversion cache {self.path} is damaged ({why}) and cannot be "
                                 f"removed: {e}") from None
        return False

    def save(self) -> None:
        if self.hit:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            cache_file.save(self.tensors, self.path, torch.get_num_threads())
            for old in self.path.parent.glob(f"{self.stem}-*.safetensors"):  # stale versions of this file
                if old != self.path:
                    old.unlink(missing_ok=True)
        except OSError:  # a read-only home: convert every time
            pass


def _linear_names(cfg: ModelConfig) -> list[str]:
    """The checkpoint names of the dense layers' linears (MoE experts aside)."""
    mods = cfg.checkpoint_linears()
    return [f"model.layers.{i}.{m}.weight" for i in range(cfg.num_layers) for f in ("qkv", "o", "gate_up", "down")
            for m in mods[f] if not (cfg.is_moe_layer(i) and f in ("gate_up", "down"))]


def _context_length(cfg: ModelConfig, max_model_len: int | None) -> int:
    return min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)


def load_model(path: str | os.PathLike, precision: str = "auto", device: str = "cpu",
               max_model_len: int | None = None, fast_head: bool = True, cpu_kernels: bool = True) -> LoadedModel:
    """cpu_kernels=False: torch's own int4 kernel on CPU instead of ours (what a CPU without
    AVX-512 VNNI runs; for comparisons)."""
    origin = {"path": str(Path(path).resolve()), "precision": precision, "device": device,
              "max_model_len": max_model_len, "fast_head": fast_head, "cpu_kernels": cpu_kernels}
    weights = open_weights(path)
    cfg = weights.config
    mode, act_dtype = _resolve_precision(precision, weights, device)
    tokenizer = weights.tokenizer()
    dense = _keep_dense(cfg, mode, device, cpu_kernels)
    cache = ConvertCache.open(path, weights, mode, device, dense, cpu_kernels)

    def linear(key: str, names: list[str]):
        def build():
            return _linear(weights, names, mode, act_dtype, device, dense, cpu_kernels)
        return cache.linear(key, build) if cache else build()

    def norm(name: str) -> RMSNorm:
        w = weights.dense(name + ".weight")
        if cfg.norm_weight_offset:  # Gemma: (1 + w), the 1 added once here, kept in fp32 (as transformers)
            return RMSNorm(w.float().to(device) + cfg.norm_weight_offset, cfg.rms_norm_eps, scale_in_fp32=True)
        return RMSNorm(w.to(device, act_dtype), cfg.rms_norm_eps)

    max_len = _context_length(cfg, max_model_len)
    modules = cfg.checkpoint_linears()  # separate q/k/v, gate/up or (Phi-3) already fused
    layers = []
    try:
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            moe = (_moe_block(weights, cfg, i, mode, act_dtype, device, cpu_kernels, cache) if cfg.is_moe_layer(i)
                   else None)
            qkv, o, gate_up, down = (None if moe and f in ("gate_up", "down") else
                                     linear(f"{i}.{f}", [p + m + ".weight" for m in modules[f]])
                                     for f in ("qkv", "o", "gate_up", "down"))
            layers.append(DecoderLayer(cfg, qkv, o, gate_up, down, moe=moe, window=cfg.window(i),
                                       **{n: norm(p + m) for n, m in cfg.checkpoint_norms().items()}))
        # the embedding and head stay exact (fp32 on CPU, or the file's Q8_0 blocks read in place):
        # they are where rounding flips tokens
        head_dtype = torch.float32 if device == "cpu" else act_dtype

        def exact(name: str) -> DenseMatrix | Q8Matrix:
            from localllm_kernels import cpu_q8

            if device == "cpu" and isinstance(weights, GGUFWeights) and cpu_q8.load():
                blocks = weights.q8_blocks(name)
                if blocks is not None:
                    return Q8Matrix(blocks)

            def build():
                return weights.dense(name).to(device, head_dtype)
            return DenseMatrix(cache.tensor(name, build) if cache else build())

        embed = exact("model.embed_tokens.weight")
        head_w = embed if cfg.tie_word_embeddings or not weights.has("lm_head.weight") else exact("lm_head.weight")
        final_norm = norm("model.norm")
    except (GGUFError, KeyError) as e:
        raise ModelLoadError(f"{path}: {e}") from None
    fast_greedy = fast_head and mode in ("int4", "int8", "w16") and device == "cpu"
    fast = None
    if fast_greedy and cache:
        fast = cache.linear("head_int4", lambda: LMHead(head_w, True, device=device, cpu_kernel=cpu_kernels).fast)
    head = LMHead(head_w, fast_greedy=fast_greedy, device=device, fast=fast, cpu_kernel=cpu_kernels,
                  softcap=cfg.final_logit_softcap)
    if cache and not cache.intact():  # the layers hold a damaged file's tensors: convert anew
        return load_model(path, precision, device, max_model_len, fast_head, cpu_kernels)
    if cache:
        cache.save()
    # which int4 kernel(s) the layers call (also inside ConcatLinear): a compiled graph bakes it in
    kinds = {m.kind for part in (*layers, head) for m in part.modules()
             if isinstance(m, (Int4Linear, Int8wLinear, W16Linear))}
    kernel = "+".join(sorted(kinds)) or None
    fingerprint = weights_fingerprint(path, mode, act_dtype, max_len, dense, fast_greedy, device, kernel,
                                      type(head_w).__name__)
    model = LlamaModel(cfg, embed, layers, final_norm, head, act_dtype, max_len, device, fingerprint, origin)
    eos = set(tokenizer.eos_ids) | weights.extra_eos_ids()
    desc = mode
    if mode == "int4" and device == "cpu":
        from localllm_kernels import cpu_int4

        isa = cpu_int4.isa_name() if kernel == "vnni" else ""
        desc = {"vnni": f"int4 weights (our kernel, {isa}, 16-bit matmul inputs), fp32 activations",
                "aten": "int4 weights, bf16 matmul inputs, fp32 activations"}.get(kernel, mode)
        if kinds - {"vnni", "aten"}:  # a GGUF of wider or mixed types, each tensor on its type's kernel
            from localllm_kernels import cpu_int8

            types = "/".join(sorted({weights.kind(n) for n in _linear_names(cfg)}))
            int4 = any(isinstance(m, Int4Linear) and m.kind == "vnni" for layer in layers for m in layer.modules())
            ours = "/".join(n for n, k in (("int4", int4), ("int8-lane", "int8w" in kinds), ("16-bit", "w16" in kinds))
                            if k)  # (the head's int4 copy aside)
            inputs = "16-bit matmul inputs" if int4 or "int8w" in kinds else "fp32 matmul inputs"
            isa = cpu_int8.isa() if "int8w" in kinds else w16.isa()
            desc = f"GGUF {types} weights as stored (our {ours} kernels, {isa}, {inputs}), fp32 activations"
    if mode == "w16":
        desc = w16.describe(layers)
    # CPU, int4/int8 weights: a 16-bit KV cache reads half the bytes per decode step; measured on
    # the real model against the fp32 cache (bench/check_kv.py): perplexity +0.001%, greedy tokens
    # 599/599 equal. fp16, not bf16 (+0.02%, 3 flips). --quant float32 keeps the exact fp32 cache.
    kv_dtype = torch.float16 if device == "cpu" and mode in ("int4", "int8", "w16") else act_dtype
    return LoadedModel(model, tokenizer, cfg, eos, desc, kv_dtype, str(path), {"max_model_len": max_len})
