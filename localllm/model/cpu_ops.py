"""The CPU op set of the layer loop: our fused C++ ops (localllm_kernels.cpu_fused) in place of
the ~20 small torch calls per layer around the GEMMs, chosen once at load (`fused_cpu_ops`).

Why: at batch 1 the eager step spent as much time in those calls (their dispatcher overhead,
allocations, and torch's fp32 rms_norm at ~50 us a call) as in the int4 GEMMs (BENCHMARKS.md,
issue 31). The math is the torch ops' (llama.py's `add_norm`, `split_rope_attend`, `silu_mul`):
the residual adds, RoPE and the cache writes bit-exact, the norms and activations within a few
ulp. Anything the fused ops do not cover (other activation dtypes, a fresh prompt that attends
with SDPA) runs the plain ops.
"""

from __future__ import annotations

import dataclasses

import torch

from .attention import SDPA_MIN_TOKENS, AttnMeta
from .layers import RMSNorm, RotaryEmbedding


def fused_cpu_ops(plain):
    """`plain` (llama.Ops of plain torch ops) with the fused ops where our library loads; `plain`
    itself when it does not (no C++ compiler)."""
    from localllm_kernels import cpu_attention, cpu_fused

    if not (cpu_fused.load() and cpu_attention.load()):
        return plain

    def add_norm(x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm):
        if x.dtype != torch.float32 or norm.weight.dtype != torch.float32 or x.dim() != 2:
            return plain.add_norm(x, residual, norm)
        if residual is None:
            return torch.ops.localllm.rms_norm(x, norm.weight, norm.eps), x
        return torch.ops.localllm.add_rms_norm(x, residual, norm.weight, norm.eps)

    def act(gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype != torch.float32 or gate_up.dim() != 2:
            return plain.act(gate_up)
        return torch.ops.localllm.silu_mul(gate_up)

    def gelu_act(gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype != torch.float32 or gate_up.dim() != 2:
            return plain.gelu_act(gate_up)
        return torch.ops.localllm.gelu_tanh_mul(gate_up)

    def attend(layer, qkv: torch.Tensor, positions: torch.Tensor, meta: AttnMeta,
               kv: tuple[torch.Tensor, torch.Tensor], ops, rope: RotaryEmbedding, scale: float) -> torch.Tensor:
        qn = layer.q_norm
        if (qkv.dtype != torch.float32 or rope.cos.dtype != torch.float32 or uses_sdpa(meta, layer) or meta.spans
                or (qn is not None and (qn.weight.dtype != torch.float32 or layer.k_norm.eps != qn.eps))):
            return plain.attend(layer, qkv, positions, meta, kv, plain, rope, scale)
        q = torch.ops.localllm.rope_store(
            qkv, positions, rope.cos, rope.sin, kv[0], kv[1], meta.slot_mapping, layer.H, layer.KVH, layer.D,
            rope.rotary_dim, None if qn is None else qn.weight, None if qn is None else layer.k_norm.weight,
            1e-6 if qn is None else qn.eps)
        out = torch.ops.localllm.paged_attention(q, kv[0], kv[1], meta.block_tables, meta.cu_seqlens_q,
                                                 meta.context_lens, float(scale), int(layer.window or 0),
                                                 float(layer.softcap or 0.0))
        return out.view(qkv.shape[0], layer.H * layer.D)

    return dataclasses.replace(plain, add_norm=add_norm, act=act, gelu_act=gelu_act, attend=attend)


def uses_sdpa(meta: AttnMeta, layer) -> bool:
    """A sequence of this step is a fresh prompt that torch_attention runs through SDPA (not the
    paged kernel): the fused attend leaves such steps to it."""
    if meta.decode_only or meta.q_lens is None or layer.window or layer.softcap:
        return False
    return any(n == c and n >= SDPA_MIN_TOKENS for n, c in zip(meta.q_lens, meta.ctx_lens))
