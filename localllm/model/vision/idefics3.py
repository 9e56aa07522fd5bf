"""Idefics3 / SmolVLM's vision side: the image processor's splitting (Idefics3ImageProcessor's,
the Pillow backend: longest edge to `size`, then to multiples of the tile size, row-major tiles
and a global image, LANCZOS throughout), the SigLIP tower (patch positions bucketed as
Idefics3VisionEmbeddings does) and the connector (pixel shuffle by scale_factor, one linear).
The prompt names each tile (<row_i_col_j>) around its image tokens, as Idefics3Processor writes it."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from . import PixelInputs
from .gemma3 import normalize
from .siglip import SiglipConfig, SiglipTower

MAX_IMAGE_SIZE = 4096  # transformers' bound on a resized image's longest edge


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    """The longest edge to max_len, the other kept in ratio and made even (transformers'
    _resize_output_size_rescale_to_max_len)."""
    aspect = width / height
    if width >= height:
        width, height = max_len, int(max_len / aspect)
        height += height % 2
    else:
        height, width = max_len, int(max_len * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def _below_upper_bound(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height and width > max_len:
        width, height = max_len, int(max_len / aspect)
    elif height > width and height > max_len:
        height, width = max_len, int(max_len * aspect)
    return max(height, 1), max(width, 1)


def _to_tiles(height: int, width: int, tile: int) -> tuple[int, int]:
    """Both edges up to multiples of the tile size (resize_for_vision_encoder)."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


class Idefics3Vision:
    """The `VisionModel` of Idefics3ForConditionalGeneration (SmolVLM; see localllm.model.vision)."""

    family = "idefics3"
    bidirectional = False

    def __init__(self, config: dict, processor: dict, get: Callable[[str], torch.Tensor], prefix: str,
                 token_id: Callable[[str], int | None], device: str, dtype: torch.dtype):
        vcfg = SiglipConfig.from_hf({"image_size": 224, "patch_size": 32, **(config.get("vision_config") or {})})
        self.cfg, self.device, self.dtype = vcfg, device, dtype

        def load(name: str) -> torch.Tensor:
            return get(name).to(device, dtype)

        self.tower = SiglipTower(load, prefix, vcfg)
        self.proj = load("model.connector.modality_projection.proj.weight")  # [text hidden, vision hidden * s^2]
        self.scale = int(config.get("scale_factor", 2))
        side = vcfg.patches_per_side
        self.tile_tokens = int(processor.get("image_seq_len") or side * side // self.scale ** 2)
        self.image_token_id = int(config.get("image_token_id", 128257))
        self.placeholder = "<image>"
        ip = processor.get("image_processor", processor)
        self.size = int((ip.get("size") or {}).get("longest_edge", 4 * 364))
        self.tile = int((ip.get("max_image_size") or {}).get("longest_edge", 364))
        self.split = bool(ip.get("do_image_splitting", True))
        self.resample = int(ip.get("resample", 1))  # PIL.Image.LANCZOS
        self.rescale = float(ip.get("rescale_factor", 1 / 255))
        self.mean, self.std = tuple(ip.get("image_mean", (0.5,) * 3)), tuple(ip.get("image_std", (0.5,) * 3))
        if token_id(self.placeholder) != self.image_token_id:
            raise ValueError(f"the tokenizer's {self.placeholder} is not the config's image_token_id")

    def _resize(self, image, height: int, width: int):
        return image.resize((width, height), resample=self.resample)

    def prepare(self, image) -> PixelInputs:
        h, w = _below_upper_bound(*_rescale_to_max_len(image.height, image.width, self.size), MAX_IMAGE_SIZE)
        image = self._resize(image, h, w)
        t = self.tile
        if not self.split:
            tiles, rows, cols = [self._resize(image, t, t)], 0, 0
        else:
            image = self._resize(image, *_to_tiles(image.height, image.width, t))
            if image.height > t or image.width > t:
                rows, cols = image.height // t, image.width // t
                tiles = [image.crop((c * t, r * t, (c + 1) * t, (r + 1) * t)) for r in range(rows) for c in range(cols)]
                tiles.append(self._resize(image, t, t))  # the global image
            else:
                tiles, rows, cols = [image], 0, 0
        pixels = torch.stack([normalize(x, self.rescale, self.mean, self.std) for x in tiles])
        return PixelInputs(pixels, len(tiles) * self.tile_tokens, {"rows": rows, "cols": cols})

    def expand(self, pixels: PixelInputs) -> str:
        img = self.placeholder * self.tile_tokens
        glob = f"<fake_token_around_image><global-img>{img}<fake_token_around_image>"
        rows, cols = pixels.extra["rows"], pixels.extra["cols"]
        if not rows and not cols:
            return glob
        grid = "".join("".join(f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>{img}" for c in range(cols)) + "\n"
                       for r in range(rows))
        return grid + "\n" + glob

    def positions(self, n: int) -> torch.Tensor:
        """Idefics3VisionEmbeddings' bucketed position ids of a full n x n patch grid."""
        side = self.cfg.patches_per_side
        boundaries = torch.arange(1 / side, 1.0, 1 / side)
        frac = torch.clamp(torch.arange(n, dtype=torch.float32) * (1.0 / torch.tensor(float(n))), max=1.0 - 1e-6)
        b = torch.bucketize(frac, boundaries, right=True)
        return (b[:, None] * side + b[None, :]).reshape(-1)

    @torch.inference_mode()
    def encode(self, batch: list[PixelInputs]) -> list[torch.Tensor]:
        pixels = torch.cat([p.pixel_values for p in batch]).to(self.device, self.dtype)
        n = pixels.shape[-1] // self.cfg.patch_size
        x = self.tower(pixels, self.positions(n).to(self.device)[None].expand(pixels.shape[0], -1))
        B, seq, C = x.shape
        s, side = self.scale, int(seq ** 0.5)
        # the connector's pixel shuffle: each s x s block of patches -> one token of s^2 * C features
        x = x.view(B, side, side // s, C * s).permute(0, 2, 1, 3).reshape(B, side // s, side // s, C * s * s)
        x = x.permute(0, 2, 1, 3).reshape(B, seq // (s * s), C * s * s)
        x = (x @ self.proj.T).reshape(-1, self.proj.shape[0])
        return list(x.split([p.n_tokens for p in batch]))
