"""The SigLIP vision tower (Gemma 3's; Idefics3's is the same encoder): patch embedding, learned
positions, pre-norm encoder layers, the final LayerNorm. Weights under HF's names, read once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float = 1e-6
    num_channels: int = 3

    @classmethod
    def from_hf(cls, cfg: dict) -> SiglipConfig:
        # SiglipVisionConfig's defaults for what hub configs leave out
        return cls(hidden_size=cfg.get("hidden_size", 768), intermediate_size=cfg.get("intermediate_size", 3072),
                   num_layers=cfg.get("num_hidden_layers", 12), num_heads=cfg.get("num_attention_heads", 12),
                   image_size=cfg.get("image_size", 224), patch_size=cfg.get("patch_size", 16),
                   layer_norm_eps=cfg.get("layer_norm_eps", 1e-6), num_channels=cfg.get("num_channels", 3))

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class SiglipLayer(nn.Module):
    def __init__(self, get: Callable[[str], torch.Tensor], p: str, cfg: SiglipConfig):
        super().__init__()
        self.heads, self.eps = cfg.num_heads, cfg.layer_norm_eps
        w = {n: get(p + n) for n in ("layer_norm1.weight", "layer_norm1.bias", "layer_norm2.weight",
                                     "layer_norm2.bias", "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight",
                                     "mlp.fc2.bias", "self_attn.out_proj.weight", "self_attn.out_proj.bias")}
        self.w = w
        # q, k, v as one matmul
        self.qkv_w = torch.cat([get(f"{p}self_attn.{x}_proj.weight") for x in "qkv"])
        self.qkv_b = torch.cat([get(f"{p}self_attn.{x}_proj.bias") for x in "qkv"])

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, N, C]; mask: [B, 1, N, N] bool (True: attend), for padded patches (Idefics3)."""
        w, B, N, C = self.w, *x.shape
        h = F.layer_norm(x, (C,), w["layer_norm1.weight"], w["layer_norm1.bias"], self.eps)
        q, k, v = F.linear(h, self.qkv_w, self.qkv_b).view(B, N, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, N, C)
        x = x + F.linear(a, w["self_attn.out_proj.weight"], w["self_attn.out_proj.bias"])
        h = F.layer_norm(x, (C,), w["layer_norm2.weight"], w["layer_norm2.bias"], self.eps)
        h = F.gelu(F.linear(h, w["mlp.fc1.weight"], w["mlp.fc1.bias"]), approximate="tanh")
        return x + F.linear(h, w["mlp.fc2.weight"], w["mlp.fc2.bias"])


class SiglipTower(nn.Module):
    """pixel_values [B, 3, S, S] -> last hidden states [B, (S / patch)^2, hidden] (post-LayerNorm)."""

    def __init__(self, get: Callable[[str], torch.Tensor], prefix: str, cfg: SiglipConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_w = get(prefix + "embeddings.patch_embedding.weight")
        self.patch_b = get(prefix + "embeddings.patch_embedding.bias")
        self.pos = get(prefix + "embeddings.position_embedding.weight")
        self.layers = [SiglipLayer(get, f"{prefix}encoder.layers.{i}.", cfg) for i in range(cfg.num_layers)]
        self.post_w, self.post_b = get(prefix + "post_layernorm.weight"), get(prefix + "post_layernorm.bias")

    def embed(self, pixel_values: torch.Tensor) -> torch.Tensor:
        p = self.cfg.patch_size
        x = F.conv2d(pixel_values.to(self.patch_w.dtype), self.patch_w, self.patch_b, stride=p)
        return x.flatten(2).transpose(1, 2)

    def forward(self, pixel_values: torch.Tensor, position_ids: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """position_ids [B, N]: each patch's row of the position table (default: 0..N-1)."""
        x = self.embed(pixel_values)
        x = x + (self.pos[: x.shape[1]] if position_ids is None else self.pos[position_ids])
        for layer in self.layers:
            x = layer(x, mask)
        return F.layer_norm(x, (x.shape[-1],), self.post_w, self.post_b, self.cfg.layer_norm_eps)
