"""Qwen2-VL / Qwen2.5-VL image preprocessing, as transformers' Qwen2VLImageProcessor (its Pillow
backend, what transformers runs without torchvision) computes it: RGB (transparency composited
onto white), a bicubic resize to the nearest size whose sides are multiples of patch * merge and
whose area lies in [min_pixels, max_pixels] (`smart_resize`), rescale to [0, 1] and normalise,
then the flattened patches the vision tower's patch embedding reads, in its merge-block order."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class QwenImageProcessing:
    """The processor's settings (preprocessor_config.json); defaults are Qwen2-VL / 2.5-VL's."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD

    @classmethod
    def from_hf(cls, cfg: dict) -> QwenImageProcessing:
        """From a preprocessor_config.json: min/max_pixels on top (hub files) or as transformers 5
        writes them, size = {shortest_edge, longest_edge}."""
        size = cfg.get("size") or {}
        d = cls()
        return cls(min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge") or d.min_pixels),
                   max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge") or d.max_pixels),
                   patch_size=int(cfg.get("patch_size", d.patch_size)),
                   temporal_patch_size=int(cfg.get("temporal_patch_size", d.temporal_patch_size)),
                   merge_size=int(cfg.get("merge_size", d.merge_size)),
                   image_mean=tuple(float(x) for x in cfg.get("image_mean", d.image_mean)),
                   image_std=tuple(float(x) for x in cfg.get("image_std", d.image_std)))

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) in patches of an image of this size after resizing."""
        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def num_tokens(self, height: int, width: int) -> int:
        """The placeholder tokens (merged patches) an image of this size takes in the prompt."""
        t, h, w = self.grid(height, width)
        return t * h * w // self.merge_size ** 2


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize: sides multiples of `factor`, area within [min_pixels,
    max_pixels], aspect ratio kept as closely as possible."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio {max(height, width) / min(height, width):.0f}:1 is too extreme "
                         "(the Qwen-VL processor takes at most 200:1)")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image: Image.Image) -> Image.Image:
    """As transformers' convert_to_rgb: transparency composited onto a white background."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def preprocess(image: Image.Image, p: QwenImageProcessing) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """-> (pixel values fp32 [h * w, C * temporal * patch * patch], grid (1, h, w) in patches): one
    image's rows of transformers' pixel_values and image_grid_thw."""
    rgb = to_rgb(image)
    height, width = smart_resize(rgb.height, rgb.width, p.factor, p.min_pixels, p.max_pixels)
    resized = np.asarray(rgb.resize((width, height), resample=Image.Resampling.BICUBIC)).transpose(2, 0, 1)
    # the same roundings as transformers: the 1/255 rescale in float64 cast to float32, then
    # (x - mean) / std in float32
    x = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean, std = np.array(p.image_mean, dtype=np.float32), np.array(p.image_std, dtype=np.float32)
    x = ((x.T - mean) / std).T
    c, P, m, T = x.shape[0], p.patch_size, p.merge_size, p.temporal_patch_size
    gh, gw = height // P, width // P
    # [C, gh/m, m, P, gw/m, m, P] -> (gh/m, gw/m, m, m, C, P, P): merge blocks, then the patches in
    # each, each patch's pixels repeated over the temporal axis (a still image is T equal frames)
    patches = x.reshape(c, gh // m, m, P, gw // m, m, P).transpose(1, 4, 2, 5, 0, 3, 6)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], T, P, P))
    return torch.from_numpy(np.ascontiguousarray(patches).reshape(gh * gw, c * T * P * P)), (1, gh, gw)
