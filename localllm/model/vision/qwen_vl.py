"""Qwen2.5-VL's vision tower: a ViT over dynamic-resolution images (patches of 14 px, 2D RoPE,
window attention with full attention at the configured layers, RMSNorm, SwiGLU MLPs) and the
patch merger that turns each 2x2 block of patches into one language-model token; and the
M-RoPE text positions (temporal, height, width) the language model rotates image and text
tokens with. The math is transformers' Qwen2_5_VisionTransformerPretrainedModel and
Qwen2_5_VLModel.get_rope_index."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import ImageSpan, PixelInputs
from .qwen_vl_processor import QwenImageProcessing, preprocess


@dataclass(frozen=True)
class QwenVisionConfig:
    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112  # pixels per side of an attention window
    out_hidden_size: int = 2048  # the language model's hidden size
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, v: dict) -> QwenVisionConfig:
        """From config.json's vision_config (the hub's spells in_channels in_chans)."""
        d = cls()
        rope = v.get("rope_parameters") or {}
        if v.get("hidden_act", "silu") != "silu":
            raise ValueError(f"vision_config.hidden_act {v['hidden_act']!r} is not supported (Qwen2.5-VL: silu)")
        return cls(depth=int(v.get("depth", d.depth)), hidden_size=int(v.get("hidden_size", d.hidden_size)),
                   intermediate_size=int(v.get("intermediate_size", d.intermediate_size)),
                   num_heads=int(v.get("num_heads", d.num_heads)),
                   in_channels=int(v.get("in_channels") or v.get("in_chans") or d.in_channels),
                   patch_size=int(v.get("patch_size", d.patch_size)),
                   spatial_merge_size=int(v.get("spatial_merge_size", d.spatial_merge_size)),
                   temporal_patch_size=int(v.get("temporal_patch_size", d.temporal_patch_size)),
                   window_size=int(v.get("window_size", d.window_size)),
                   out_hidden_size=int(v.get("out_hidden_size", d.out_hidden_size)),
                   fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes", d.fullatt_block_indexes)),
                   rope_theta=float(rope.get("rope_theta", d.rope_theta)))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


def patch_positions(grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """(row, col) of each patch [t * h * w, 2] in the processor's order: merge blocks row-major,
    the patches of a block row-major inside it, repeated per frame."""
    t, h, w = grid
    rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
    cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
    pos = torch.stack([rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)], dim=-1)
    return pos.repeat(t, 1)


def window_order(grid: tuple[int, int, int], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """-> (merged tokens reordered window by window, tokens per window): windows of `window`
    merged tokens per side tile the image from its top-left corner (the last row and column of
    windows may be smaller)."""
    t, h, w = grid
    gh, gw = h // merge, w // merge
    idx = torch.arange(t * gh * gw).view(t, gh, gw)
    order, sizes = [], []
    for f in range(t):
        for r in range(0, gh, window):
            for c in range(0, gw, window):
                block = idx[f, r:r + window, c:c + window].reshape(-1)
                order.append(block)
                sizes.append(block.numel())
    return torch.cat(order), sizes


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sizes: list[int],
                      scale: float) -> torch.Tensor:
    """Bidirectional attention within consecutive segments of the rows. q/k/v [S, H, D] -> [S, H, D].
    Segments of one length run as one batched SDPA call."""
    out = torch.empty_like(q)
    starts = torch.tensor([0, *sizes[:-1]]).cumsum(0)
    lengths = torch.tensor(sizes)
    for n in sorted(set(sizes)):
        idx = (starts[lengths == n].unsqueeze(1) + torch.arange(n)).to(q.device)  # [B, n]
        qq, kk, vv = (x[idx].transpose(1, 2) for x in (q, k, v))  # [B, H, n, D]
        out[idx] = F.scaled_dot_product_attention(qq, kk, vv, scale=scale).transpose(1, 2)
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' Qwen2RMSNorm: normalised in fp32, cast back, then scaled."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class VisionBlock(nn.Module):
    def __init__(self, cfg: QwenVisionConfig, t: dict[str, torch.Tensor]):
        super().__init__()
        self.H, self.D = cfg.num_heads, cfg.head_dim
        self.norm1, self.norm2 = nn.Parameter(t["norm1.weight"]), nn.Parameter(t["norm2.weight"])
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        # gate and up as one matrix: one GEMM
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        with torch.no_grad():
            for lin, names in ((self.qkv, ["attn.qkv"]), (self.proj, ["attn.proj"]),
                               (self.gate_up, ["mlp.gate_proj", "mlp.up_proj"]), (self.down, ["mlp.down_proj"])):
                lin.weight.copy_(torch.cat([t[n + ".weight"] for n in names]))
                lin.bias.copy_(torch.cat([t[n + ".bias"] for n in names]))
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        S = x.shape[0]
        q, k, v = self.qkv(rms_norm(x, self.norm1)).view(S, 3, self.H, self.D).unbind(1)
        # RoPE in fp32 as transformers' apply_rotary_pos_emb_vision
        qf, kf = q.float(), k.float()
        q = (qf * cos + rotate_half(qf) * sin).to(x.dtype)
        k = (kf * cos + rotate_half(kf) * sin).to(x.dtype)
        x = x + self.proj(segment_attention(q, k, v, sizes, self.D ** -0.5).reshape(S, -1))
        g, u = self.gate_up(rms_norm(x, self.norm2)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class QwenVisionTower(nn.Module):
    """Pixel values (the processor's flattened patches, images concatenated) and each image's
    (t, h, w) patch grid -> one embedding per merged 2x2 block [tokens, out_hidden_size], in
    the order of the image's placeholder tokens."""

    def __init__(self, cfg: QwenVisionConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
        """tensors: the checkpoint's visual.* tensors, the prefix removed."""
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        t = {k: v.float() for k, v in tensors.items()}
        # the Conv3d with kernel = stride = one patch is a linear over the flattened patch
        self.patch_embed = nn.Parameter(t["patch_embed.proj.weight"].reshape(cfg.hidden_size, cfg.patch_dim))
        self.blocks = nn.ModuleList(
            VisionBlock(cfg, {k[len(f"blocks.{i}."):]: v for k, v in t.items() if k.startswith(f"blocks.{i}.")})
            for i in range(cfg.depth))
        self.merge_norm = nn.Parameter(t["merger.ln_q.weight"])
        merged = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.merge_fc1, self.merge_fc2 = nn.Linear(merged, merged), nn.Linear(merged, cfg.out_hidden_size)
        with torch.no_grad():
            for lin, n in ((self.merge_fc1, "merger.mlp.0"), (self.merge_fc2, "merger.mlp.2")):
                lin.weight.copy_(t[n + ".weight"])
                lin.bias.copy_(t[n + ".bias"])
        half = cfg.head_dim // 2  # h and w rotate half of each head each
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half),
                             persistent=False)
        self.requires_grad_(False)
        self.to(dtype)
        self.inv_freq = self.inv_freq.float()

    @staticmethod
    def tensor_names(cfg: QwenVisionConfig) -> list[str]:
        """The checkpoint's tensors the tower reads, under visual.*, the prefix removed."""
        per = [f"{m}.{p}" for m in ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
               for p in ("weight", "bias")] + ["norm1.weight", "norm2.weight"]
        return (["patch_embed.proj.weight", "merger.ln_q.weight"] +
                [f"merger.mlp.{i}.{p}" for i in (0, 2) for p in ("weight", "bias")] +
                [f"blocks.{i}.{n}" for i in range(cfg.depth) for n in per])

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // self.cfg.spatial_merge_size ** 2

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        c = self.cfg
        m, unit = c.spatial_merge_size, c.spatial_merge_size ** 2
        window = c.window_size // m // c.patch_size
        # the tokens reordered window by window (each merge block's patches stay together), the
        # windows' and the whole images' lengths in patches
        order, windows, images, offset = [], [], [], 0
        for g in grids:
            o, sizes = window_order(g, m, window)
            order.append(o + offset)
            windows += [s * unit for s in sizes if s]
            images += [g[1] * g[2]] * g[0]  # each frame attends to itself
            offset += self.num_tokens(g)
        order = torch.cat(order).to(self.patch_embed.device)
        pos = torch.cat([patch_positions(g, m) for g in grids]).to(self.patch_embed.device)
        freqs = pos.unsqueeze(-1).float() * self.inv_freq  # [S, 2, D/4]: rows, cols
        emb = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([emb, emb], dim=-1).unsqueeze(1)  # [S, 1, D]

        def by_window(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(-1, unit, *x.shape[1:])[order].reshape(x.shape)

        x = by_window(F.linear(pixel_values.to(self.dtype), self.patch_embed))
        cos, sin = by_window(emb.cos()), by_window(emb.sin())
        full = set(c.fullatt_block_indexes)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, images if i in full else windows)
        x = rms_norm(x, self.merge_norm).reshape(-1, c.hidden_size * unit)
        x = self.merge_fc2(F.gelu(self.merge_fc1(x)))
        return x[torch.argsort(order)]


def mrope_positions(num_tokens: int, images: list[tuple[int, tuple[int, int, int]]], merge: int
                    ) -> tuple[torch.Tensor, int]:
    """M-RoPE positions of a prompt of `num_tokens` tokens whose images' placeholder runs start
    at images[i][0] (in order) with patch grids images[i][1]: [3, num_tokens] (temporal, height,
    width) and the rope delta. Text tokens count on from the last position + 1 on all three rows;
    an image's merged tokens (t, row, col) get (p + t, p + row, p + col) with p the position after
    the text before it, and the text after it continues at p + max(rows, cols). Tokens past the
    prompt (generated ones) are at their index + delta on every row (transformers' get_rope_index
    and rope_deltas)."""
    pos = torch.empty(3, num_tokens, dtype=torch.long)
    at = nxt = 0  # token index, next position
    for start, (t, h, w) in images:
        if start < at:
            raise ValueError(f"image placeholder runs overlap or are out of order (one starts at {start})")
        pos[:, at:start] = torch.arange(nxt, nxt + start - at)
        nxt += start - at
        gh, gw = h // merge, w // merge
        n = t * gh * gw
        if start + n > num_tokens:
            raise ValueError(f"an image of {n} tokens at {start} runs past the prompt's {num_tokens} tokens")
        pos[0, start:start + n] = nxt + torch.arange(t).repeat_interleave(gh * gw)
        pos[1, start:start + n] = nxt + torch.arange(gh).repeat_interleave(gw).repeat(t)
        pos[2, start:start + n] = nxt + torch.arange(gw).repeat(t * gh)
        nxt += max(gh, gw)  # (transformers' advance, also for a grid of several frames)
        at = start + n
    pos[:, at:] = torch.arange(nxt, nxt + num_tokens - at)
    nxt += num_tokens - at
    return pos, nxt - num_tokens


def mrope_range(images: list[tuple[int, tuple[int, int, int]]], start: int, n: int, merge: int) -> torch.Tensor:
    """The positions of tokens [start, start + n) of a sequence whose images are `images` (as in
    mrope_positions): [3, n] when an image's tokens lie in the range, else [n] (text rotates the
    same on the three rows; a [T] step keeps the plain RoPE path, captured decode steps included):
    the index plus the delta of the images before it."""
    if not any(o < start + n and o + _tokens(g, merge) > start for o, g in images):
        return torch.arange(start, start + n) + sum(max(g[1], g[2]) // merge - _tokens(g, merge)
                                                    for o, g in images if o + _tokens(g, merge) <= start)
    seen = [(o, g) for o, g in images if o < start + n]
    end = max(start + n, *(o + _tokens(g, merge) for o, g in seen))
    return mrope_positions(end, seen, merge)[0][:, start:start + n]


def _tokens(grid: tuple[int, int, int], merge: int) -> int:
    t, h, w = grid
    return t * h * w // merge ** 2


class QwenVLVision:
    """The `VisionModel` of Qwen2_5_VLForConditionalGeneration (see localllm.model.vision): the
    processor, the tower, and the M-RoPE positions the runner asks for (`mrope`, `positions`)."""

    family = "qwen2_5_vl"
    bidirectional = False  # image tokens attend causally, as the text
    mrope = True

    def __init__(self, config: dict, processor: dict, get: Callable[[str], torch.Tensor], prefix: str,
                 token_text: Callable[[int], str], device: str, dtype: torch.dtype):
        """get: the checkpoint's tensors by name; prefix: the tower's (visual. or model.visual.)."""
        cfg = QwenVisionConfig.from_hf(config.get("vision_config") or {})
        tensors = {n: get(prefix + n) for n in QwenVisionTower.tensor_names(cfg)}
        self.tower = QwenVisionTower(cfg, tensors, dtype).to(device)
        self.device, self.dtype, self.merge = device, dtype, cfg.spatial_merge_size
        self.processing = QwenImageProcessing.from_hf(processor)
        if (self.processing.patch_size, self.processing.merge_size, self.processing.temporal_patch_size) != \
                (cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size):
            raise ValueError(f"the image processor's patch/merge/temporal sizes {self.processing} do not match "
                             f"the vision tower's {cfg}")
        self.image_token_id = int(config.get("image_token_id", 151655))
        start = token_text(int(config.get("vision_start_token_id", 151652)))
        end = token_text(int(config.get("vision_end_token_id", 151653)))
        self.image_text = token_text(self.image_token_id)
        self._start_end = start, end
        self.placeholder = f"{start}{self.image_text}{end}"  # what Qwen's chat template writes per image

    def prepare(self, image) -> PixelInputs:
        pixels, grid = preprocess(image, self.processing)
        return PixelInputs(pixels, _tokens(grid, self.merge), {"grid": grid})

    def expand(self, pixels: PixelInputs) -> str:
        start, end = self._start_end
        return f"{start}{self.image_text * pixels.n_tokens}{end}"

    @torch.inference_mode()
    def encode(self, batch: list[PixelInputs]) -> list[torch.Tensor]:
        out = self.tower(torch.cat([p.pixel_values for p in batch]).to(self.device),
                         [p.extra["grid"] for p in batch])
        return list(out.to(self.dtype).split([p.n_tokens for p in batch]))

    def positions(self, images: tuple[ImageSpan, ...], start: int, n: int) -> torch.Tensor:
        """M-RoPE positions of tokens [start, start + n) of a sequence with these images."""
        return mrope_range([(im.offset, im.pixels.extra["grid"]) for im in images], start, n, self.merge)
