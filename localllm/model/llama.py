"""One config-driven Llama-family decoder: Llama 2/3, Mistral, Qwen2 (qkv bias), SmolLM (tied head)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .attention import AttnMeta, default_backend, make_attention
from .layers import LMHead, RMSNorm, RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, qkv: nn.Module, o: nn.Module, gate_up: nn.Module, down: nn.Module,
                 input_norm: RMSNorm, post_norm: RMSNorm):
        super().__init__()
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.input_norm, self.post_norm = input_norm, post_norm
        self.H, self.KVH, self.D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.split = [self.H * self.D, self.KVH * self.D, self.KVH * self.D]
        self.inter = cfg.intermediate_size


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, layers: list[DecoderLayer], norm: RMSNorm,
                 head: LMHead, act_dtype: torch.dtype, max_positions: int, device: str = "cpu"):
        super().__init__()
        self.cfg, self.act_dtype, self.device = cfg, act_dtype, device
        self.embed = nn.Parameter(embed, requires_grad=False)  # [V, H]
        self.layers = nn.ModuleList(layers)
        self.norm, self.head = norm, head
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, act_dtype).to(device)
        self.scale = cfg.head_dim ** -0.5
        self.use_attention(default_backend(device))
        self.compiled = None  # a captured decode step (localllm.model.compiled), opt-in
        self.fingerprint: str | None = None  # identity of the weights (set by the loader)

    def use_attention(self, backend: str) -> None:
        """Pick the attention backend ("torch" | "triton"); the runner builds the matching metadata.
        With "triton" the layers also run fused kernels for add+RMSNorm, RoPE and SiLU*up: ~10
        launches per layer instead of ~37, which at small batch on a GPU is most of a step."""
        self.attention, self.attention_backend = make_attention(backend), backend
        self.fused = backend == "triton"

    def new_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
        c = self.cfg
        shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
        # one tensor per layer: a single big tensor makes compiled graphs copy all of it. Every
        # slot is written before it is read, so the memory needs no zeroing.
        return [(torch.empty(shape, dtype=dtype, device=self.device),
                 torch.empty(shape, dtype=dtype, device=self.device)) for _ in range(c.num_layers)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Hidden states [T, hidden] of a flattened batch of new tokens."""
        if self.fused:
            return self._forward_fused(input_ids, positions, meta, kv_caches)
        x = self.embed[input_ids].to(self.act_dtype)
        T = x.shape[0]
        attend, scale, rope = self.attention, self.scale, self.rope
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            h = layer.input_norm(x)
            q, k, v = layer.qkv(h).split(layer.split, dim=-1)
            q, k = rope(positions, q.view(T, layer.H, layer.D), k.view(T, layer.KVH, layer.D))
            a = attend(q, k, v.view(T, layer.KVH, layer.D), kc, vc, meta, scale)
            x = x + layer.o(a)
            g, u = layer.gate_up(layer.post_norm(x)).split(layer.inter, dim=-1)
            x = x + layer.down(F.silu(g) * u)
        return self.norm(x)

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """forward() with our fused kernels; the same math (the residual stream is kept in the
        activation dtype and each add rounds to it, as in forward)."""
        from localllm_kernels import apply_rope, rms_norm, silu_and_mul

        x = self.embed[input_ids].to(self.act_dtype)
        T = x.shape[0]
        cos, sin, scale = self.rope.cos, self.rope.sin, self.scale
        residual = None
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            if residual is None:
                h, residual = rms_norm(x, layer.input_norm.weight, layer.input_norm.eps), x
            else:  # x is the previous layer's MLP output
                h, residual = rms_norm(x, layer.input_norm.weight, layer.input_norm.eps, residual)
            q, k, v = layer.qkv(h).split(layer.split, dim=-1)
            q, k = apply_rope(positions, q.view(T, layer.H, layer.D), k.view(T, layer.KVH, layer.D), cos, sin,
                              inplace=True)
            a = self.attention(q, k, v.view(T, layer.KVH, layer.D), kc, vc, meta, scale)
            h, residual = rms_norm(layer.o(a), layer.post_norm.weight, layer.post_norm.eps, residual)
            x = layer.down(silu_and_mul(layer.gate_up(h)))
        return rms_norm(x, self.norm.weight, self.norm.eps, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)
