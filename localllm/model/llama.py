"""One config-driven Llama-family decoder: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norms),
SmolLM (tied head), Phi-3 / Phi-4-mini (partial rotary, LongRoPE; fused checkpoint linears are
the loader's business), Gemma 2/3 (sandwich norms, GeGLU, sliding-window layers with their own
RoPE table, soft-capping, scaled embeddings).

There is one layer loop (`LlamaModel.forward` over `DecoderLayer.forward`). What differs between
CPU and GPU is chosen per op once at load (`Ops`): the attention backend and, on the Triton
path, fused add+RMSNorm, in-place RoPE and SiLU*up kernels. The compiled CPU step
(localllm.model.compiled) and the CUDA graphs (localllm.engine.cuda_graphs) capture this same
forward; perplexity runs it too, and the quantizer runs its pieces (`embed_tokens`, `run_layer`,
`DecoderLayer.mlp`) one layer at a time. On CPU with fp32 activations the ops are our
fused C++ ops (localllm.model.cpu_ops) where they load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .attention import AttnMeta, default_backend, make_attention
from .layers import BlockMatrix, DenseMatrix, LMHead, Q8Matrix, RMSNorm, RotaryEmbedding, W16Matrix


def add_norm(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x), residual + x); the first layer has no residual yet."""
    r = x if residual is None else residual + x
    return norm(r), r


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g) * u


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma's GeGLU (gelu_pytorch_tanh); no fused kernel, on every backend."""
    g, u = gate_up.chunk(2, dim=-1)
    return F.gelu(g, approximate="tanh") * u


def rope_torch(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, rope: RotaryEmbedding):
    return rope(positions, q, k)


def add_norm_fused(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm):
    from localllm_kernels import rms_norm

    if residual is None:
        return rms_norm(x, norm.weight, norm.eps, scale_in_fp32=norm.scale_in_fp32), x
    return rms_norm(x, norm.weight, norm.eps, residual, scale_in_fp32=norm.scale_in_fp32)


def silu_mul_fused(gate_up: torch.Tensor) -> torch.Tensor:
    from localllm_kernels import silu_and_mul

    return silu_and_mul(gate_up)


def split_rope_attend(layer: DecoderLayer, qkv: torch.Tensor, positions: torch.Tensor, meta: AttnMeta,
                      kv: tuple[torch.Tensor, torch.Tensor], ops: Ops, rope: RotaryEmbedding, scale: float):
    """The attention block between the qkv and o projections: split, per-head q/k norms, RoPE,
    attention over the paged cache (which writes k and v into it). -> [T, H * D]."""
    T = qkv.shape[0]
    q, k, v = qkv.split(layer.split, dim=-1)
    q, k = q.view(T, layer.H, layer.D), k.view(T, layer.KVH, layer.D)
    if layer.q_norm is not None:
        q, k = layer.q_norm(q), layer.k_norm(k)
    q, k = ops.rope(positions, q, k, rope)
    return ops.attention(q, k, v.view(T, layer.KVH, layer.D), kv[0], kv[1], meta, scale, layer.window,
                         layer.softcap, layer.sinks)


def run_decoder_layer(layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                      meta: AttnMeta, kv: tuple[torch.Tensor, torch.Tensor], ops: Ops, rope: RotaryEmbedding,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return layer(x, residual, positions, meta, kv, ops, rope, scale)


def rope_fused(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, rope: RotaryEmbedding):
    from localllm_kernels import apply_rope

    if rope.partial:  # the kernel rotates the leading rotary_dim columns of each head in place
        r = rope.rotary_dim
        apply_rope(positions, q[..., :r], k[..., :r], rope.cos, rope.sin, inplace=True)
        return q, k
    return apply_rope(positions, q, k, rope.cos, rope.sin, inplace=True)


@dataclass(frozen=True)
class Ops:
    """The implementation of each op of the layer loop, chosen once at load."""

    attention: Callable
    add_norm: Callable  # (x, residual | None, norm) -> (normed, new residual)
    rope: Callable  # (positions, q, k, rope) -> (q, k)
    act: Callable  # gate_up -> silu(gate) * up
    gelu_act: Callable = gelu_tanh_mul  # gate_up -> gelu_tanh(gate) * up (Gemma)
    attend: Callable = split_rope_attend  # (layer, qkv, positions, meta, kv, ops, rope, scale) -> [T, H*D]
    # (layer, x, residual, positions, meta, kv, ops, rope, scale) -> DecoderLayer.forward's result
    layer: Callable = run_decoder_layer
    mlp_rows: int = 0  # a step's MLP takes its rows this many at a time, or more (0: all at once)

    @classmethod
    def for_backend(cls, backend: str, fused_cpu: bool = False) -> Ops:
        """"torch": plain torch ops (the CPU path); with `fused_cpu`, our fused C++ ops where they
        load (localllm.model.cpu_ops: at batch 1 the ~20 small torch calls per layer around the
        GEMMs cost more than the GEMMs). "triton": our kernels for attention and, since ~10
        launches per layer instead of ~37 is most of a small-batch GPU step, for add+RMSNorm,
        RoPE and SiLU*up too (same math; the residual is kept in the activation dtype)."""
        if backend == "triton":
            return cls(make_attention(backend), add_norm_fused, rope_fused, silu_mul_fused)
        plain = cls(make_attention(backend), add_norm, rope_torch, silu_mul)
        if fused_cpu:
            from .cpu_ops import fused_cpu_ops

            return fused_cpu_ops(plain)
        return plain


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, qkv: nn.Module, o: nn.Module, gate_up: nn.Module | None,
                 down: nn.Module | None, input_norm: RMSNorm, post_norm: RMSNorm, q_norm: RMSNorm | None = None,
                 k_norm: RMSNorm | None = None, attn_out_norm: RMSNorm | None = None,
                 mlp_out_norm: RMSNorm | None = None, moe: nn.Module | None = None, window: int | None = None,
                 sinks: torch.Tensor | None = None):
        """post_norm: the norm before the MLP. attn_out_norm / mlp_out_norm: Gemma's norms on the
        attention and MLP outputs before they join the residual. moe: a mixture-of-experts block
        in place of gate_up/down, called as moe(h, ops). window: this layer attends to the last
        `window` positions only (sliding-window layers). sinks: fp32 [H], gpt-oss's attention sinks."""
        super().__init__()
        self.qkv, self.o, self.gate_up, self.down, self.moe = qkv, o, gate_up, down, moe
        self.input_norm, self.post_norm = input_norm, post_norm
        self.q_norm, self.k_norm = q_norm, k_norm  # per head, before RoPE (Qwen3, Gemma 3)
        self.attn_out_norm, self.mlp_out_norm = attn_out_norm, mlp_out_norm
        self.H, self.KVH, self.D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.split = [self.H * self.D, self.KVH * self.D, self.KVH * self.D]
        self.window = window
        self.softcap = cfg.attn_logit_softcap
        self.register_buffer("sinks", sinks)
        self.gelu = cfg.hidden_act == "gelu_tanh"

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, meta: AttnMeta,
                kv: tuple[torch.Tensor, torch.Tensor], ops: Ops, rope: RotaryEmbedding, scale: float):
        """-> (MLP output, residual stream): the caller adds them in the next add_norm."""
        h, residual = ops.add_norm(x, residual, self.input_norm)
        a = self.o(ops.attend(self, self.qkv(h), positions, meta, kv, ops, rope, scale))
        if self.attn_out_norm is not None:
            a = self.attn_out_norm(a)
        h, residual = ops.add_norm(a, residual, self.post_norm)
        out = self.mlp(h, ops)
        if self.mlp_out_norm is not None:
            out = self.mlp_out_norm(out)
        return out, residual

    def mlp(self, h: torch.Tensor, ops: Ops) -> torch.Tensor:
        """The MLP block on the normed input h (before Gemma's output norm); public for the
        quantizer, which judges candidate gate/up weights on it."""
        if self.moe is not None:
            return self.moe(h, ops)
        blocks = h.shape[0] // ops.mlp_rows if ops.mlp_rows else 1
        if blocks < 2:
            return self.down(self.act(self.gate_up(h), ops))
        # a prompt chunk's rows in blocks, the last taking the rest: the gate/up output and its
        # activation were the chunk's largest tensors (cpu_ops.fused_cpu_ops sets the size)
        cuts = [b * ops.mlp_rows for b in range(blocks)] + [h.shape[0]]
        return torch.cat([self.down(self.act(self.gate_up(h[a:b]), ops)) for a, b in zip(cuts, cuts[1:])])

    def act(self, gate_up: torch.Tensor, ops: Ops) -> torch.Tensor:
        """This layer's activation of the fused gate/up output: GeGLU (Gemma) or SiLU*up."""
        return (ops.gelu_act if self.gelu else ops.act)(gate_up)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, embed: DenseMatrix | Q8Matrix | BlockMatrix | W16Matrix, layers: list[DecoderLayer], norm: RMSNorm,
                 head: LMHead, act_dtype: torch.dtype, max_positions: int, device: str = "cpu",
                 fingerprint: str | None = None, origin: dict | None = None, mapped: tuple[torch.Tensor, ...] = ()):
        """fingerprint: identity of the weights (keys what is cached per model, e.g. compiled
        packages); origin: the load_model arguments that load the same model again. mapped: the
        tables (embedding, head) read in place from the file's read-only mapping."""
        super().__init__()
        self.mapped = mapped
        self.cfg, self.act_dtype, self.device = cfg, act_dtype, device
        self.embed = embed  # [V, H]; a tied head shares it
        self.layers = nn.ModuleList(layers)
        self.norm, self.head = norm, head
        # on CPU the tables' rows are filled as positions come into use (cover): untouched pages
        # cost nothing there; a GPU allocation is all resident, so it is filled at once
        lazy = device == "cpu"
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, act_dtype,
                                    cfg.rotary_dim, cfg.mrope_section, cfg.mrope_interleaved, lazy).to(device)
        # Gemma 3: sliding-window layers rotate with their own base (and no scaling)
        self.rope_local = None if cfg.rope_local_theta is None else RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_local_theta, None, act_dtype, cfg.rotary_dim, lazy=lazy).to(device)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        # Gemma: embeddings times sqrt(hidden), rounded to the activation dtype as transformers does
        self.embed_scale = (torch.tensor(cfg.hidden_size ** 0.5, dtype=act_dtype).item()
                            if cfg.scale_embeddings else None)
        self.use_attention(default_backend(device))
        self.fingerprint, self.origin = fingerprint, origin

    def use_act_bits(self, bits: int) -> None:
        """The activations' width inside the layers' int4 / int8-lane CPU kernels: 16 (two int8 parts
        per value, the default: about bf16's error squared) or 8 (one part, llama.cpp's way: ~1.7x
        the multiply rate at prefill sizes, a relative error of ~5e-3 per product). The head's
        exact rows and the ranking copy keep 16, as do mixture-of-experts experts (moe_int4) and the
        layers on other kernels (dense, 16-bit weights)."""
        from .layers import Int4Linear, Int8wLinear

        if bits not in (8, 16):
            raise ValueError(f"activation bits must be 8 or 16, got {bits!r}")
        parts = 1 if bits == 8 else 2
        for layer in self.layers:
            linears = [m for m in layer.modules() if isinstance(m, (Int4Linear, Int8wLinear))]
            if all(m.act_parts == parts for m in linears):
                continue
            for m in linears:
                if parts == 2:
                    m.__dict__.pop("act_parts", None)  # the class's default
                else:
                    m.act_parts = parts
            layer.__dict__.pop("_fused_decode", None)  # the one-call step's arguments carry it
            self.__dict__.pop("_structure_key", None)  # compiled packages are keyed by it

    def release_mapped_pages(self) -> None:
        """Give back this process's pages of the tables read in place from the file (they stay in
        the page cache). A greedy step reads a few dozen rows of the head and a prompt its tokens'
        embedding rows, but the kernel maps 16 pages around each page it faults in: over a few
        hundred steps the whole table became resident (215 MB for a 128k x 2048 Q6_K head) beside
        the int4 ranking copy greedy steps read instead."""
        from .gguf import release_pages

        for t in self.mapped:
            release_pages(t)

    def cover(self, n: int) -> None:
        """Make the RoPE tables hold positions < n (a step's positions must be covered before it runs;
        `forward` covers its own, a captured or compiled step's caller does)."""
        for rope in (self.rope, self.rope_local):
            if rope is not None:
                rope.cover(n)

    def use_attention(self, backend: str, fused_cpu: bool = True) -> None:
        """Pick the backend ("torch" | "triton"); the runner builds the matching metadata.
        fused_cpu: on the torch backend of a CPU model with fp32 activations, our fused C++ ops
        where they load (False: the plain torch ops, which tests compare them with)."""
        fused_cpu = fused_cpu and self.device == "cpu" and self.act_dtype == torch.float32
        self.ops, self.attention_backend = Ops.for_backend(backend, fused_cpu), backend

    def new_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
        """dtype: the cache's element type; uint8 is the 8-bit q8_0 cache (localllm_kernels.kv_quant:
        rows of head_dim / 32 * 34 bytes)."""
        from localllm_kernels import kv_quant

        c = self.cfg
        shape = kv_quant.cache_shape(num_blocks, block_size, c.num_kv_heads, c.head_dim, dtype)
        # one tensor per layer: a single big tensor makes compiled graphs copy all of it. Every
        # slot is written before it is read, so the memory needs no zeroing.
        return [(torch.empty(shape, dtype=dtype, device=self.device),
                 torch.empty(shape, dtype=dtype, device=self.device)) for _ in range(c.num_layers)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], ops: Ops | None = None,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] of a flattened batch of new tokens. ops: other implementations
        of the same ops than the ones chosen at load (the compiled step traces plain torch ops).
        embeds: (rows of the batch, their embeddings): image embeddings in place of those tokens'.
        Embeddings [n, 1 + k, hidden] (Qwen3-VL's deepstack): the first in place of the tokens', the
        others added to their rows' residual stream after each of the first k layers."""
        ops = ops or self.ops
        if self.rope.lazy and not torch.compiler.is_compiling():  # (a traced step is covered by its caller)
            self.cover(int(positions.max()) + 1 if positions.numel() else 0)
        x, residual = self.embed_tokens(input_ids, embeds), None
        deep = embeds[1][:, 1:] if embeds is not None and embeds[1].dim() == 3 else None
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            x, residual = self.run_layer(layer, x, residual, positions, meta, kv, ops)
            if deep is not None and i < deep.shape[1]:  # (x joins the residual in the next add_norm)
                x = x.index_add(0, embeds[0], deep[:, i].to(x.dtype))
        return ops.add_norm(x, residual, self.norm)[0]

    # the pieces of `forward` the quantizer runs one layer at a time, so it spells no math of its own
    def embed_tokens(self, input_ids: torch.Tensor, embeds: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> torch.Tensor:
        """The first residual stream: embedding rows in the activation dtype, Gemma's scale applied;
        `embeds` (rows, values) replace rows after the scale (image embeddings, as transformers)."""
        x = self.embed.rows(input_ids).to(self.act_dtype)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if embeds is not None:
            rows = embeds[1] if embeds[1].dim() == 2 else embeds[1][:, 0]
            x = x.index_copy(0, embeds[0], rows.to(x.dtype))
        return x

    def run_layer(self, layer: DecoderLayer, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                  meta: AttnMeta, kv: tuple[torch.Tensor, torch.Tensor], ops: Ops | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer with this model's ops (or `ops`), RoPE table (local or global) and scale.
        positions: [T], or [3, T] M-RoPE positions (Qwen-VL steps with image tokens)."""
        ops = ops or self.ops
        rope, positions = self.layer_rope(layer).at(positions)
        return ops.layer(layer, x, residual, positions, meta, kv, ops, rope, self.scale)

    def layer_rope(self, layer: DecoderLayer) -> RotaryEmbedding:
        return self.rope_local if layer.window and self.rope_local is not None else self.rope

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)
