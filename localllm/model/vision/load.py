"""A checkpoint's vision side, when it has one: which family, its weights and its processor config."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import ModelLoadError

# architectures whose checkpoints carry a vision tower we run
# architecture -> the tensor that says its checkpoint holds the vision side
VISION_ARCHS = {"Gemma3ForConditionalGeneration": "multi_modal_projector.mm_input_projection_weight",
                "Idefics3ForConditionalGeneration": "model.connector.modality_projection.proj.weight"}
QWEN_VL_ARCHS = ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration")
QWEN_VL_PREFIXES = ("visual.", "model.visual.")  # Qwen2.5-VL's hub files, transformers 5 / Qwen3-VL


def processor_config(path: Path, full: bool = False) -> dict:
    """The image processor's settings: transformers 5 nests them in processor_config.json, older
    checkpoints (the hub's Gemma 3, SmolVLM) have preprocessor_config.json. full: the whole
    processor config (its image_processor inside; Idefics3 reads image_seq_len beside it)."""
    for name, key in (("processor_config.json", "image_processor"), ("preprocessor_config.json", None)):
        f = path / name
        if f.is_file():
            try:
                cfg = json.loads(f.read_text())
            except json.JSONDecodeError as e:
                raise ModelLoadError(f"{f}: invalid JSON ({e})") from None
            cfg = cfg if full or not key else cfg.get(key)
            if cfg:
                return cfg
    return {}


def has_vision(config: dict, has: Callable[[str], bool]) -> bool:
    """The checkpoint holds a vision tower we run (what `localllm show` and /api/show report)."""
    arch = (config.get("architectures") or [""])[0]
    if arch in QWEN_VL_ARCHS:
        return any(has(p + "patch_embed.proj.weight") for p in QWEN_VL_PREFIXES)
    return arch in VISION_ARCHS and has(VISION_ARCHS[arch])


def vision_params(config: dict, names: list[str], numel: Callable[[str], int]) -> int:
    """Parameters of the vision tower and projector an HF checkpoint holds (what load_vision
    reads: every tensor under the family's prefixes); 0 for a text-only checkpoint."""
    arch = (config.get("architectures") or [""])[0]
    prefixes = {"Gemma3ForConditionalGeneration": ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                                                   "model.multi_modal_projector."),
                "Idefics3ForConditionalGeneration": ("model.vision_model.", "model.connector.")}.get(
        arch, QWEN_VL_PREFIXES if arch in QWEN_VL_ARCHS else ())
    return sum(numel(n) for n in names if n.startswith(prefixes)) if prefixes else 0


def load_vision(path: Path, config: dict, has: Callable[[str], bool], get: Callable[[str], torch.Tensor],
                tokenizer, device: str, dtype: torch.dtype):
    """-> the checkpoint's VisionModel, or None (a text-only checkpoint, or a multimodal one
    without its tower). `has` / `get`: the checkpoint's tensors by HF name; `tokenizer`: the
    model's (LLMTokenizer), for the image tokens' texts and ids."""
    if not has_vision(config, has):
        return None
    arch = config["architectures"][0]
    if arch in QWEN_VL_ARCHS:
        return _qwen_vl(path, config, has, get, tokenizer.tok.id_to_token, device, dtype)
    prefixes = ("model.vision_model.",) if arch == "Idefics3ForConditionalGeneration" else \
        ("vision_tower.vision_model.", "vision_tower.")
    prefix = next((p for p in prefixes if has(p + "embeddings.patch_embedding.weight")), None)
    if prefix is None:
        raise ModelLoadError(f"{path}: the vision tower's patch embedding is missing")
    try:
        if arch == "Idefics3ForConditionalGeneration":
            from .idefics3 import Idefics3Vision

            return Idefics3Vision(config, processor_config(path, full=True), get, prefix, tokenizer.tok.token_to_id,
                                  device, dtype)
        from .gemma3 import Gemma3Vision

        return Gemma3Vision(config, processor_config(path), get, prefix, tokenizer.tok.id_to_token, device, dtype)
    except KeyError as e:
        raise ModelLoadError(f"{path}: vision tensor {e} is missing") from None
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None


def _qwen_vl(path: Path, config: dict, has: Callable[[str], bool], get: Callable[[str], torch.Tensor],
             token_text: Callable[[int], str], device: str, dtype: torch.dtype):
    """Qwen2.5-VL's / Qwen3-VL's tower, under one of QWEN_VL_PREFIXES."""
    from .qwen_vl import QwenVLVision

    prefix = next(p for p in QWEN_VL_PREFIXES if has(p + "patch_embed.proj.weight"))
    try:
        return QwenVLVision(config, processor_config(path), get, prefix, token_text, device, dtype)
    except KeyError as e:
        raise ModelLoadError(f"{path}: vision tensor {e} is missing") from None
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
