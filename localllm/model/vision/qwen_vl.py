"""Qwen2.5-VL's and Qwen3-VL's vision towers: ViTs over dynamic-resolution images (2D RoPE over
patch rows and columns) and the patch merger that turns each 2x2 block of patches into one
language-model token; and the M-RoPE text positions (temporal, height, width) the language model
rotates image and text tokens with.

Qwen2.5-VL (transformers' Qwen2_5_VisionTransformerPretrainedModel): 14 px patches, window
attention with full attention at the configured layers, RMSNorm, SwiGLU MLPs. Qwen3-VL
(Qwen3VLVisionModel): 16 px patches, a learned position table resampled to each image's grid,
full attention, LayerNorm, GELU MLPs, and "deepstack": the features after some layers, merged by
their own mergers, join the language model's residual stream at the image tokens after its
first layers. Positions: Qwen2_5_VLModel.get_rope_index (the same for Qwen3-VL's images).
"""

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
    window_size: int = 112  # pixels per side of an attention window (Qwen2.5-VL)
    out_hidden_size: int = 2048  # the language model's hidden size
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    qwen3: bool = False  # Qwen3-VL's tower (LayerNorm, GELU MLP, position table, deepstack)
    num_position_embeddings: int = 0  # Qwen3-VL: the learned position table (a square grid)
    deepstack_visual_indexes: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, v: dict, qwen3: bool = False) -> QwenVisionConfig:
        """From config.json's vision_config (Qwen2.5-VL's hub files spell in_channels in_chans),
        transformers' defaults for what it leaves out."""
        d = QWEN3_VISION_DEFAULTS if qwen3 else cls()
        rope = v.get("rope_parameters") or {}
        act = v.get("hidden_act", d.hidden_act)
        if act != d.hidden_act:
            raise ValueError(f"vision_config.hidden_act {act!r} is not supported (expected {d.hidden_act!r})")
        depth = int(v.get("depth", d.depth))
        full = v.get("fullatt_block_indexes", range(depth) if qwen3 else d.fullatt_block_indexes)
        return cls(depth=depth, hidden_size=int(v.get("hidden_size", d.hidden_size)),
                   intermediate_size=int(v.get("intermediate_size", d.intermediate_size)),
                   num_heads=int(v.get("num_heads", d.num_heads)),
                   in_channels=int(v.get("in_channels") or v.get("in_chans") or d.in_channels),
                   patch_size=int(v.get("patch_size", d.patch_size)),
                   spatial_merge_size=int(v.get("spatial_merge_size", d.spatial_merge_size)),
                   temporal_patch_size=int(v.get("temporal_patch_size", d.temporal_patch_size)),
                   window_size=int(v.get("window_size", d.window_size)),
                   out_hidden_size=int(v.get("out_hidden_size", d.out_hidden_size)),
                   fullatt_block_indexes=tuple(int(i) for i in full),
                   hidden_act=act, rope_theta=float(rope.get("rope_theta", d.rope_theta)), qwen3=qwen3,
                   num_position_embeddings=int(v.get("num_position_embeddings", d.num_position_embeddings)),
                   deepstack_visual_indexes=tuple(int(i) for i in v.get("deepstack_visual_indexes",
                                                                          d.deepstack_visual_indexes)))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


# transformers' Qwen3VLVisionConfig defaults (every layer attends to the whole image)
QWEN3_VISION_DEFAULTS = QwenVisionConfig(
    depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16, out_hidden_size=3584,
    fullatt_block_indexes=tuple(range(27)), hidden_act="gelu_pytorch_tanh", qwen3=True,
    num_position_embeddings=2304, deepstack_visual_indexes=(8, 16, 24))


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


def linear(t: dict[str, torch.Tensor], *names: str) -> nn.Linear:
    """The checkpoint's linears `names` (weights and biases) as one, their rows stacked."""
    w = torch.cat([t[n + ".weight"] for n in names])
    lin = nn.Linear(w.shape[1], w.shape[0])
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(torch.cat([t[n + ".bias"] for n in names]))
    return lin.requires_grad_(False)


class Norm(nn.Module):
    """Qwen2.5-VL's RMSNorm (weight only) or Qwen3-VL's LayerNorm (weight and bias), eps 1e-6."""

    def __init__(self, t: dict[str, torch.Tensor], name: str):
        super().__init__()
        self.weight = nn.Parameter(t[name + ".weight"], requires_grad=False)
        b = t.get(name + ".bias")
        self.bias = None if b is None else nn.Parameter(b, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return rms_norm(x, self.weight)
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-6)


class VisionBlock(nn.Module):
    def __init__(self, cfg: QwenVisionConfig, t: dict[str, torch.Tensor]):
        super().__init__()
        self.H, self.D, self.qwen3 = cfg.num_heads, cfg.head_dim, cfg.qwen3
        self.norm1, self.norm2 = Norm(t, "norm1"), Norm(t, "norm2")
        self.qkv, self.proj = linear(t, "attn.qkv"), linear(t, "attn.proj")
        if cfg.qwen3:
            self.fc1, self.fc2 = linear(t, "mlp.linear_fc1"), linear(t, "mlp.linear_fc2")
        else:  # gate and up as one matrix: one GEMM
            self.fc1, self.fc2 = linear(t, "mlp.gate_proj", "mlp.up_proj"), linear(t, "mlp.down_proj")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        S = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(S, 3, self.H, self.D).unbind(1)
        # RoPE in fp32 as transformers' apply_rotary_pos_emb_vision
        qf, kf = q.float(), k.float()
        q = (qf * cos + rotate_half(qf) * sin).to(x.dtype)
        k = (kf * cos + rotate_half(kf) * sin).to(x.dtype)
        x = x + self.proj(segment_attention(q, k, v, sizes, self.D ** -0.5).reshape(S, -1))
        h = self.fc1(self.norm2(x))
        if self.qwen3:
            return x + self.fc2(F.gelu(h, approximate="tanh"))
        g, u = h.chunk(2, dim=-1)
        return x + self.fc2(F.silu(g) * u)


class Merger(nn.Module):
    """Each 2x2 block of patches -> one language-model embedding: norm (per patch, or Qwen3-VL's
    deepstack mergers over the block), then fc, GELU, fc."""

    def __init__(self, cfg: QwenVisionConfig, t: dict[str, torch.Tensor], prefix: str, norm_after_merge: bool = False):
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.norm_after_merge = norm_after_merge
        if cfg.qwen3:
            self.norm, self.fc1, self.fc2 = (Norm(t, prefix + "norm"), linear(t, prefix + "linear_fc1"),
                                             linear(t, prefix + "linear_fc2"))
        else:
            self.norm, self.fc1, self.fc2 = Norm(t, prefix + "ln_q"), linear(t, prefix + "mlp.0"), linear(t, prefix + "mlp.2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.width)) if self.norm_after_merge else self.norm(x).reshape(-1, self.width)
        return self.fc2(F.gelu(self.fc1(x)))


class QwenVisionTower(nn.Module):
    """Pixel values (the processor's flattened patches, images concatenated) and each image's
    (t, h, w) patch grid -> one embedding per merged 2x2 block [tokens, out_hidden_size], in the
    order of the image's placeholder tokens; Qwen3-VL: [tokens, 1 + deepstack layers,
    out_hidden_size], the merger's output then each deepstack merger's."""

    def __init__(self, cfg: QwenVisionConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
        """tensors: the checkpoint's visual.* tensors, the prefix removed."""
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        t = {k: v.float() for k, v in tensors.items()}
        # the Conv3d with kernel = stride = one patch is a linear over the flattened patch
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias="patch_embed.proj.bias" in t)
        with torch.no_grad():
            self.patch_embed.weight.copy_(t["patch_embed.proj.weight"].reshape(cfg.hidden_size, cfg.patch_dim))
            if self.patch_embed.bias is not None:
                self.patch_embed.bias.copy_(t["patch_embed.proj.bias"])
        self.pos_embed = None if not cfg.num_position_embeddings else \
            nn.Parameter(t["pos_embed.weight"], requires_grad=False)
        self.blocks = nn.ModuleList(
            VisionBlock(cfg, {k[len(f"blocks.{i}."):]: v for k, v in t.items() if k.startswith(f"blocks.{i}.")})
            for i in range(cfg.depth))
        self.merger = Merger(cfg, t, "merger.")
        self.deepstack = nn.ModuleList(Merger(cfg, t, f"deepstack_merger_list.{j}.", norm_after_merge=True)
                                       for j in range(len(cfg.deepstack_visual_indexes)))
        half = cfg.head_dim // 2  # h and w rotate half of each head each
        self.register_buffer("inv_freq", 1.0 / cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half),
                             persistent=False)
        self.requires_grad_(False)
        self.to(dtype)
        self.inv_freq = self.inv_freq.float()

    @staticmethod
    def tensor_names(cfg: QwenVisionConfig) -> list[str]:
        """The checkpoint's tensors the tower reads, under visual.*, the prefix removed."""
        wb = ("weight", "bias")
        if cfg.qwen3:
            per = [f"{m}.{p}" for m in ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2", "norm1", "norm2")
                   for p in wb]
            merger = ["norm", "linear_fc1", "linear_fc2"]
            mergers = [f"{m}.{n}.{p}" for m in ["merger", *(f"deepstack_merger_list.{j}" for j in
                                                           range(len(cfg.deepstack_visual_indexes)))]
                       for n in merger for p in wb]
            head = ["patch_embed.proj.weight", "patch_embed.proj.bias", "pos_embed.weight"]
        else:
            per = [f"{m}.{p}" for m in ("attn.qkv", "attn.proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
                   for p in wb] + ["norm1.weight", "norm2.weight"]
            mergers = ["merger.ln_q.weight"] + [f"merger.mlp.{i}.{p}" for i in (0, 2) for p in wb]
            head = ["patch_embed.proj.weight"]
        return head + mergers + [f"blocks.{i}.{n}" for i in range(cfg.depth) for n in per]

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // self.cfg.spatial_merge_size ** 2

    def position_table(self, grids: list[tuple[int, int, int]], pos: torch.Tensor) -> torch.Tensor:
        """Qwen3-VL: the learned square position table resampled (bilinear, corners aligned) to
        each image's patch grid, at the patches' (row, col) -> [S, hidden]."""
        side = int(self.cfg.num_position_embeddings ** 0.5)
        table = self.pos_embed.float().t().reshape(1, -1, side, side)
        out, at = [], 0
        for t, h, w in grids:
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # [C, h, w]
            p = pos[at:at + t * h * w]
            out.append(grid[:, p[:, 0], p[:, 1]].t())
            at += t * h * w
        return torch.cat(out).to(self.dtype)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        c = self.cfg
        m, unit = c.spatial_merge_size, c.spatial_merge_size ** 2
        full = set(c.fullatt_block_indexes)
        windowed = any(i not in full for i in range(c.depth))
        window = c.window_size // m // c.patch_size
        # Qwen2.5-VL: the tokens reordered window by window (each merge block's patches stay
        # together); the windows' and the whole images' lengths in patches
        order, windows, images, offset = [], [], [], 0
        for g in grids:
            o, sizes = window_order(g, m, window) if windowed else (torch.arange(self.num_tokens(g)), [])
            order.append(o + offset)
            windows += [s * unit for s in sizes if s]
            images += [g[1] * g[2]] * g[0]  # each frame attends to itself
            offset += self.num_tokens(g)
        order = torch.cat(order).to(self.patch_embed.weight.device)
        pos = torch.cat([patch_positions(g, m) for g in grids]).to(self.patch_embed.weight.device)
        freqs = pos.unsqueeze(-1).float() * self.inv_freq  # [S, 2, D/4]: rows, cols
        emb = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([emb, emb], dim=-1).unsqueeze(1)  # [S, 1, D]

        def by_window(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(-1, unit, *x.shape[1:])[order].reshape(x.shape) if windowed else x

        x = self.patch_embed(pixel_values.to(self.dtype))
        if self.pos_embed is not None:
            x = x + self.position_table(grids, pos)
        x, cos, sin = by_window(x), by_window(emb.cos()), by_window(emb.sin())
        deep = []
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, images if i in full else windows)
            if i in c.deepstack_visual_indexes:
                deep.append(self.deepstack[c.deepstack_visual_indexes.index(i)](x))
        x = self.merger(x)
        if deep:
            x = torch.stack([x, *deep], dim=1)
        return x[torch.argsort(order)] if windowed else x


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
    """The `VisionModel` of Qwen2_5_VLForConditionalGeneration and Qwen3VLForConditionalGeneration
    (see localllm.model.vision): the processor, the tower, and the M-RoPE positions the runner
    asks for (`mrope`, `positions`). Qwen3-VL's embeddings carry its deepstack rows (QwenVisionTower)."""

    bidirectional = False  # image tokens attend causally, as the text
    mrope = True

    def __init__(self, config: dict, processor: dict, get: Callable[[str], torch.Tensor], prefix: str,
                 token_text: Callable[[int], str], device: str, dtype: torch.dtype):
        """get: the checkpoint's tensors by name; prefix: the tower's (visual. or model.visual.)."""
        qwen3 = (config.get("architectures") or [""])[0] == "Qwen3VLForConditionalGeneration"
        self.family = "qwen3_vl" if qwen3 else "qwen2_5_vl"
        cfg = QwenVisionConfig.from_hf(config.get("vision_config") or {}, qwen3)
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
