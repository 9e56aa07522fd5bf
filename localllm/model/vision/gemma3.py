"""Gemma 3's vision side: its image preprocessing (Gemma3ImageProcessor's, the Pillow backend:
resize to the tower's square, rescale, normalise; pan-and-scan not done), the SigLIP tower, and
the projector (average-pool the patch grid to mm_tokens_per_image tokens, Gemma's RMSNorm with
(1 + w), one matmul into the language model's width). Image tokens attend bidirectionally within
their image (transformers' token_type_ids mask)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import PixelInputs
from .siglip import SiglipConfig, SiglipTower


@dataclass(frozen=True)
class ImageProcessing:
    """What transformers' image processors (Pillow backend) do to an RGB image: resize to (height,
    width) with a Pillow filter, x * rescale_factor (in float64, then float32), (x - mean) / std."""

    height: int
    width: int
    resample: int = 2  # PIL.Image.BILINEAR
    rescale_factor: float = 1 / 255
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)

    @classmethod
    def from_hf(cls, cfg: dict, default_size: int) -> ImageProcessing:
        size = cfg.get("size") or {}
        return cls(int(size.get("height", default_size)), int(size.get("width", default_size)),
                   int(cfg.get("resample", 2)), float(cfg.get("rescale_factor", 1 / 255)),
                   tuple(cfg.get("image_mean", (0.5, 0.5, 0.5))), tuple(cfg.get("image_std", (0.5, 0.5, 0.5))))

    def __call__(self, image) -> torch.Tensor:
        """-> [3, height, width] float32."""
        img = image.resize((self.width, self.height), resample=self.resample)
        return normalize(img, self.rescale_factor, self.mean, self.std)


def normalize(image, rescale_factor: float, mean, std) -> torch.Tensor:
    """An RGB Pillow image -> [3, H, W] float32, rescaled then normalised as transformers' numpy
    helpers do (rescale in float64 cast to float32, normalise in float32)."""
    x = (np.asarray(image, dtype=np.uint8).astype(np.float64) * rescale_factor).astype(np.float32)
    x = (x - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))


class Gemma3Vision:
    """The `VisionModel` of Gemma3ForConditionalGeneration (see localllm.model.vision)."""

    family = "gemma3"
    bidirectional = True

    def __init__(self, config: dict, processor: dict, get: Callable[[str], torch.Tensor], prefix: str,
                 token_text: Callable[[int], str], device: str, dtype: torch.dtype, norm_offset: float = 1.0):
        """norm_offset: what the stored soft-embedding norm weight lacks of its scale (HF: 1;
        llama.cpp's mmproj stores 1 + w)."""
        vcfg = SiglipConfig.from_hf(config.get("vision_config") or {})
        self.device, self.dtype = device, dtype

        def load(name: str) -> torch.Tensor:
            return get(name).to(device, dtype)

        self.tower = SiglipTower(load, prefix, vcfg)
        self.proj = load("multi_modal_projector.mm_input_projection_weight")  # [vision hidden, text hidden]
        # Gemma3RMSNorm: x / rms(x) * (1 + w), in fp32
        self.norm_w = get("multi_modal_projector.mm_soft_emb_norm.weight").float().to(device) + norm_offset
        self.eps = vcfg.layer_norm_eps
        self.n_tokens = int(config.get("mm_tokens_per_image", 256))
        side = int(self.n_tokens ** 0.5)
        self.grid, self.pool = vcfg.patches_per_side, vcfg.patches_per_side // side
        self.image_token_id = int(config.get("image_token_index", config.get("image_token_id", 262144)))
        boi = int(config.get("boi_token_index", 255999))
        eoi = int(config.get("eoi_token_index", 256000))
        self.placeholder = token_text(boi)
        image = token_text(self.image_token_id)
        self._expanded = f"\n\n{self.placeholder}{image * self.n_tokens}{token_text(eoi)}\n\n"
        self.processing = ImageProcessing.from_hf(processor, vcfg.image_size)

    def prepare(self, image) -> PixelInputs:
        return PixelInputs(self.processing(image)[None], self.n_tokens)

    def expand(self, pixels: PixelInputs) -> str:
        return self._expanded

    @torch.inference_mode()
    def encode(self, batch: list[PixelInputs]) -> list[torch.Tensor]:
        pixels = torch.cat([p.pixel_values for p in batch]).to(self.device, self.dtype)
        x = self.tower(pixels)  # [B, grid^2, C]
        B, _, C = x.shape
        x = x.transpose(1, 2).reshape(B, C, self.grid, self.grid)
        x = F.avg_pool2d(x, self.pool, self.pool).flatten(2).transpose(1, 2)  # [B, n_tokens, C]
        xf = x.float()
        x = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_w).to(x.dtype)
        return list((x @ self.proj).unbind(0))
