"""A vision tower from llama.cpp's mmproj GGUF (its clip / mtmd layout), beside a GGUF text model.

What users download from Ollama or the hub's *-GGUF repos is the text model's GGUF plus an
`mmproj-*.gguf`: the vision tower and projector under llama.cpp's names (v.patch_embd,
v.blk.N.attn_q, v.post_ln, mm.*), with clip.vision.* metadata (sizes, image mean/std) and
clip.projector_type naming the family. This module reads one into the settings and HF-named
tensors the families' own classes take (gemma3.py, idefics3.py, qwen_vl.py): the same
VisionModel objects as from an HF checkpoint, no second copy of their math. Tensors are
dequantized exactly (F32/F16/BF16 as stored, Q8_0 blocks by gguf-py's dequantizer), undoing what
llama.cpp's converter did to them: Gemma's (1 + w) norm kept as written, Qwen's split q/k/v and
two-frame patch embedding put back together.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ..errors import ModelLoadError
from ..gguf import GGUFError, GGUFFile, dequantize, read_gguf

# clip.projector_type -> (family, the text model's GGUF architecture it goes with)
PROJECTORS = {"gemma3": ("gemma3", "gemma3"), "idefics3": ("idefics3", "llama"),
              "qwen2.5vl_merger": ("qwen2_5_vl", "qwen2vl"), "qwen3vl_merger": ("qwen3_vl", "qwen3vl")}

# SigLIP (Gemma 3's and Idefics3's tower): HF module under the tower's prefix -> llama.cpp's name
_SIGLIP = {"embeddings.patch_embedding": "v.patch_embd", "embeddings.position_embedding": "v.position_embd",
           "post_layernorm": "v.post_ln"}
_SIGLIP_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.out_proj": "attn_out", "layer_norm1": "ln1", "layer_norm2": "ln2", "mlp.fc1": "ffn_up",
                 "mlp.fc2": "ffn_down"}
# Qwen2.5-VL / Qwen3-VL blocks and mergers (under visual.)
_QWEN_LAYER = {"attn.proj": "attn_out", "norm1": "ln1", "norm2": "ln2", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.linear_fc1": "ffn_up",
               "mlp.linear_fc2": "ffn_down"}
_QWEN_MERGER = {"ln_q": "v.post_ln", "norm": "v.post_ln", "mlp.0": "mm.0", "mlp.2": "mm.2", "linear_fc1": "mm.0",
                "linear_fc2": "mm.2"}
_DEEPSTACK = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}


def find_mmproj(model: str | os.PathLike) -> Path | None:
    """The mmproj of a .gguf model file found without asking: the one `mmproj*.gguf` in its
    folder (llama.cpp's and the hub's GGUF repos name them so; a pulled repo's snapshot holds it
    beside the model). None when there is none or the model is not a GGUF file; ModelLoadError
    when there are several (which one is meant is --mmproj's to say)."""
    model = Path(model)
    if not (model.is_file() and model.suffix.lower() == ".gguf"):
        return None
    found = sorted(p for p in model.parent.glob("*.gguf") if p.name.lower().startswith("mmproj") and p != model)
    if len(found) > 1:
        raise ModelLoadError(f"{model.parent} holds {len(found)} mmproj files ({', '.join(p.name for p in found)}); "
                             "name the one to use with --mmproj FILE")
    return found[0] if found else None


class Mmproj:
    """An mmproj GGUF: its metadata and its tensors by llama.cpp's name, dequantized to fp32."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self.file: GGUFFile = read_gguf(self.path)
        except (GGUFError, OSError) as e:
            raise ModelLoadError(f"mmproj {self.path}: {e}") from None
        meta = self.file.metadata
        kind = meta.get("clip.vision.projector_type") or meta.get("clip.projector_type")
        if meta.get("general.architecture") != "clip" or kind is None:
            raise ModelLoadError(f"{self.path} is not an mmproj file (no clip.projector_type: a text model's GGUF?); "
                                 "--mmproj takes llama.cpp's mmproj-*.gguf of the model")
        if kind not in PROJECTORS:
            raise ModelLoadError(f"mmproj {self.path}: projector type {kind!r} is not supported "
                                 f"(supported: {', '.join(PROJECTORS)})")
        self.projector = kind
        self.family, self.text_arch = PROJECTORS[kind]

    def meta(self, key: str, default=None):
        """clip.vision.<key> (KeyError when it is required and missing)."""
        v = self.file.metadata.get(f"clip.vision.{key}", default)
        if v is None:
            raise KeyError(f"clip.vision.{key}")
        return v

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def tensor(self, name: str) -> torch.Tensor:
        t = self.file.tensors.get(name)
        if t is None:
            raise KeyError(name)
        try:
            return torch.from_numpy(np.array(dequantize(t, self.file.read(t)), dtype=np.float32))
        except GGUFError as e:
            raise ModelLoadError(f"mmproj {self.path}: {e}") from None

    def params(self) -> int:
        """The values of its tensors (the tower holds each once, in the activation dtype)."""
        return sum(int(np.prod(t.shape)) for t in self.file.tensors.values())


def _siglip_name(name: str, prefix: str, extra: dict[str, str]) -> str:
    """An HF SigLIP tensor name (under `prefix`) or a projector's (`extra`) -> llama.cpp's."""
    if name in extra:
        return extra[name]
    rest = name.removeprefix(prefix)
    module, _, kind = rest.rpartition(".")
    if module in _SIGLIP:
        return f"{_SIGLIP[module]}.{kind}"
    m = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)", module)
    if m and m[2] in _SIGLIP_LAYER:
        return f"v.blk.{m[1]}.{_SIGLIP_LAYER[m[2]]}.{kind}"
    raise KeyError(name)


def _qwen_get(mm: Mmproj, deepstack: list[int]) -> Callable[[str], torch.Tensor]:
    """The Qwen tower's tensors by HF name (under visual.): q/k/v joined back into qkv where the
    converter split them (Qwen2.5-VL), the Conv3d patch embedding restacked from its two frames,
    deepstack merger j at its layer's index."""
    def get(name: str) -> torch.Tensor:
        rest = name.removeprefix("visual.")
        module, _, kind = rest.rpartition(".")
        if module == "patch_embed.proj":
            if kind == "bias":
                return mm.tensor("v.patch_embd.bias")
            return torch.stack([mm.tensor("v.patch_embd.weight"), mm.tensor("v.patch_embd.weight.1")], dim=2)
        if module == "pos_embed":
            return mm.tensor("v.position_embd.weight")
        m = re.fullmatch(r"blocks\.(\d+)\.(.+)", module)
        if m:
            p = f"v.blk.{m[1]}."
            if m[2] == "attn.qkv":
                if mm.has(f"{p}attn_qkv.{kind}"):
                    return mm.tensor(f"{p}attn_qkv.{kind}")
                return torch.cat([mm.tensor(f"{p}attn_{x}.{kind}") for x in "qkv"])
            return mm.tensor(f"{p}{_QWEN_LAYER[m[2]]}.{kind}")
        m = re.fullmatch(r"deepstack_merger_list\.(\d+)\.(.+)", module)
        if m:
            return mm.tensor(f"v.deepstack.{deepstack[int(m[1])]}.{_DEEPSTACK[m[2]]}.{kind}")
        if module.startswith("merger."):
            return mm.tensor(f"{_QWEN_MERGER[module.removeprefix('merger.')]}.{kind}")
        raise KeyError(name)
    return get


def load_mmproj(path: str | os.PathLike, text_arch: str, hidden_size: int, tokenizer, device: str,
                dtype: torch.dtype):
    """-> the VisionModel of an mmproj file for a GGUF text model of architecture `text_arch`
    and width `hidden_size`; `tokenizer`: the text model's (the image tokens are found by name).
    ModelLoadError names what does not fit."""
    mm = Mmproj(path)
    if text_arch != mm.text_arch:
        raise ModelLoadError(f"mmproj {mm.path} ({mm.projector}) is not for a {text_arch!r} text model "
                             f"(it goes with {mm.text_arch!r})")
    try:
        width = int(mm.meta("projection_dim"))
        if width != hidden_size:
            raise ModelLoadError(f"mmproj {mm.path} projects to width {width}; this text model's is {hidden_size} "
                                 "(the mmproj of another model size?)")
        ids = tokenizer.tok.token_to_id
        texts = tokenizer.tok.id_to_token
        return _build(mm, ids, texts, device, dtype)
    except KeyError as e:
        raise ModelLoadError(f"mmproj {mm.path}: {e.args[0]} is missing") from None
    except ValueError as e:
        raise ModelLoadError(f"mmproj {mm.path}: {e}") from None


def _token(ids: Callable[[str], int | None], text: str, mm: Mmproj) -> int:
    i = ids(text)
    if i is None:
        raise ValueError(f"the text model's tokenizer has no {text} token (is this the model's own mmproj?)")
    return i


def _vision_config(mm: Mmproj) -> dict:
    """clip.vision.* as HF's vision_config keys (SigLIP's names)."""
    return {"hidden_size": int(mm.meta("embedding_length")), "intermediate_size": int(mm.meta("feed_forward_length")),
            "num_hidden_layers": int(mm.meta("block_count")), "num_attention_heads": int(mm.meta("attention.head_count")),
            "image_size": int(mm.meta("image_size")), "patch_size": int(mm.meta("patch_size")),
            "layer_norm_eps": float(mm.meta("attention.layer_norm_epsilon", 1e-6))}


def _norm(mm: Mmproj) -> dict:
    return {"image_mean": [float(x) for x in mm.meta("image_mean")], "image_std": [float(x) for x in mm.meta("image_std")]}


def _build(mm: Mmproj, ids: Callable[[str], int | None], texts: Callable[[int], str], device: str, dtype: torch.dtype):
    v = _vision_config(mm)
    if mm.family == "gemma3":
        from .gemma3 import Gemma3Vision

        # llama.cpp's default pooling is 4x4 (64x64 patches -> 256 tokens); test models write theirs
        scale = int(mm.meta("projector.scale_factor", 4))
        side = v["image_size"] // v["patch_size"] // scale
        config = {"vision_config": v, "mm_tokens_per_image": side * side,
                  "image_token_index": _token(ids, "<image_soft_token>", mm),
                  "boi_token_index": _token(ids, "<start_of_image>", mm),
                  "eoi_token_index": _token(ids, "<end_of_image>", mm)}
        processor = {"size": {"height": v["image_size"], "width": v["image_size"]}, **_norm(mm)}
        prefix = "vision_tower.vision_model."
        extra = {"multi_modal_projector.mm_input_projection_weight": "mm.input_projection.weight",
                 "multi_modal_projector.mm_soft_emb_norm.weight": "mm.soft_emb_norm.weight"}
        # the converter stored the soft-embedding norm as (1 + w) already
        return Gemma3Vision(config, processor, lambda n: mm.tensor(_siglip_name(n, prefix, extra)), prefix, texts,
                            device, dtype, norm_offset=0.0)
    if mm.family == "idefics3":
        from .idefics3 import Idefics3Vision

        config = {"vision_config": v, "scale_factor": int(mm.meta("projector.scale_factor", 2)),
                  "image_token_id": _token(ids, "<image>", mm)}
        processor = {"image_processor": {"size": {"longest_edge": int(mm.meta("preproc_image_size", v["image_size"]))},
                                         "max_image_size": {"longest_edge": v["image_size"]}, **_norm(mm)}}
        prefix = "model.vision_model."
        extra = {"model.connector.modality_projection.proj.weight": "mm.model.fc.weight"}
        return Idefics3Vision(config, processor, lambda n: mm.tensor(_siglip_name(n, prefix, extra)), prefix, ids,
                              device, dtype)
    return _qwen(mm, v, ids, texts, device, dtype)


# transformers' image processors' pixel bounds when the mmproj names none (llama.cpp keeps its own)
QWEN_PIXELS = {"qwen2_5_vl": (56 * 56, 28 * 28 * 1280), "qwen3_vl": (65536, 16777216)}


def _qwen(mm: Mmproj, v: dict, ids, texts, device: str, dtype: torch.dtype):
    from .qwen_vl import QwenVLVision

    qwen3 = mm.family == "qwen3_vl"
    depth = v["num_hidden_layers"]
    if qwen3:
        flags = mm.meta("is_deepstack_layers", [False] * depth)
        deepstack = [i for i, f in enumerate(flags) if f]
        full = list(range(depth))
        extra = {"num_position_embeddings": int(mm.file.tensors["v.position_embd.weight"].shape[0]),
                 "deepstack_visual_indexes": deepstack}
    else:
        deepstack = []
        n_wa = int(mm.meta("n_wa_pattern"))  # llama.cpp: block i attends fully when (i + 1) % n_wa == 0
        full = [i for i in range(depth) if n_wa and (i + 1) % n_wa == 0]
        extra = {}
    merge = int(mm.meta("spatial_merge_size", 2))
    vision = {"depth": depth, "hidden_size": v["hidden_size"], "intermediate_size": v["intermediate_size"],
              "num_heads": v["num_attention_heads"], "patch_size": v["patch_size"], "spatial_merge_size": merge,
              "temporal_patch_size": 2, "window_size": int(mm.meta("window_size", 112)),
              "out_hidden_size": int(mm.meta("projection_dim")), "fullatt_block_indexes": full, **extra}
    lo, hi = QWEN_PIXELS[mm.family]
    processor = {"min_pixels": int(mm.meta("image_min_pixels", lo)), "max_pixels": int(mm.meta("image_max_pixels", hi)),
                 "patch_size": v["patch_size"], "merge_size": merge, "temporal_patch_size": 2, **_norm(mm)}
    arch = "Qwen3VLForConditionalGeneration" if qwen3 else "Qwen2_5_VLForConditionalGeneration"
    config = {"architectures": [arch], "vision_config": vision, "image_token_id": _token(ids, "<|image_pad|>", mm),
              "vision_start_token_id": _token(ids, "<|vision_start|>", mm),
              "vision_end_token_id": _token(ids, "<|vision_end|>", mm)}
    return QwenVLVision(config, processor, _qwen_get(mm, deepstack), "visual.", texts, device, dtype)
