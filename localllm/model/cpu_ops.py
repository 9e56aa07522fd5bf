"""The CPU op set of the layer loop: our fused C++ ops (localllm_kernels.cpu_fused) in place of
the ~20 small torch calls per layer around the GEMMs, chosen once at load (`fused_cpu_ops`).

Why: at batch 1 the eager step spent as much time in those calls (their dispatcher overhead,
allocations, and torch's fp32 rms_norm at ~50 us a call) as in the int4 GEMMs (BENCHMARKS.md,
issue 31). The math is the torch ops' (llama.py's `add_norm`, `split_rope_attend`, `silu_mul`):
the residual adds, RoPE and the cache writes bit-exact, the norms and activations within a few
ulp. Anything the fused ops do not cover (other activation dtypes, a fresh prompt that attends
with SDPA) runs the plain ops.

A layer whose linears are all on our GEMMs (int4, int8-lane, 16-bit: every GGUF block type, mixed
files' parts each on its own) takes its decode-sized steps (decode, verify,
prefix-hit extend: below the rows where the GEMMs go dense) as one C++ call, `Ops.layer` ->
torch.ops.localllm.decode_layer: the same ops in the same order, so the same bits, without the ~10
Python-to-dispatcher hops per layer that left the eager step 1.4x the compiled one's time.
"""

from __future__ import annotations

import dataclasses

import torch

from .attention import SDPA_MIN_TOKENS, AttnMeta
from .layers import Int4Linear, RMSNorm, RotaryEmbedding


def fused_cpu_ops(plain, one_call_layers: bool = True):
    """`plain` (llama.Ops of plain torch ops) with the fused ops where our library loads; `plain`
    itself when it does not (no C++ compiler). one_call_layers: a decode step's layer (linears on
    our GEMMs) runs as one C++ call of the same ops (`Ops.layer`); False: the ops one by one from
    Python (tests compare the two)."""
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
                                                 float(layer.softcap or 0.0), layer.sinks)
        return out.view(qkv.shape[0], layer.H * layer.D)

    decode_layer = torch.ops.localllm.decode_layer.default  # (the packet's overload lookup: ~1 us a call)

    def layer_step(layer, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, meta: AttnMeta,
                   kv: tuple[torch.Tensor, torch.Tensor], ops, rope: RotaryEmbedding, scale: float):
        args = decode_layer_args(layer)
        # (rope.cos goes through nn.Module.__getattr__: ~1 us; M-RoPE steps pass plain RopeRows)
        tables = rope.__dict__.get("_buffers") or rope.__dict__
        cos = tables["cos"]
        if (args is None or x.dtype != torch.float32 or x.dim() != 2 or x.shape[0] >= args[3]
                or cos.dtype != torch.float32 or meta.spans or uses_sdpa(meta, layer)):
            return layer(x, residual, positions, meta, kv, ops, rope, scale)
        return decode_layer(x, residual, args[0], args[1], args[2], positions, cos, tables["sin"], kv[0], kv[1],
                            meta.slot_mapping, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                            rope.rotary_dim, scale)

    # a 512-token chunk's MLP in blocks of 256 rows (as decode_layer does): a 1B shape's gate/up output
    # and activation, 32 + 16 MB of the chunk's 107 MB live peak, halve; rows are independent in our
    # GEMMs, and 256 rows take the same kernel routes as 512 (torch's fp32 GEMM of a dense linear
    # may round a row's sums otherwise at another row count, as any chunking of a prompt does)
    ops = dataclasses.replace(plain, add_norm=add_norm, act=act, gelu_act=gelu_act, attend=attend, mlp_rows=256)
    return dataclasses.replace(ops, layer=layer_step) if one_call_layers else ops


def decode_layer_args(layer) -> tuple | None:
    """(weights, ints, floats, rows below which it applies) of `layer` for the one-call decode step
    (torch.ops.localllm.decode_layer: the fused ops' sequence for one layer in C++), or None where
    that does not apply: a linear not on our int4 / int8-lane / 16-bit kernels (or one of their
    parts, for a GGUF's mixed qkv), experts, Gemma's output norms, attention sinks, norms in another dtype. Kept in
    the layer's __dict__ (nn.Module's attribute lookups cost ~1 us each, ~20 of them a layer) and
    checked against the buffers it was made from, which `.to()` and the like replace."""
    d = layer.__dict__
    cached = d.get("_fused_decode")
    if cached is not None:
        for buffers, name, t in cached[0]:
            if buffers.get(name) is not t:
                break
        else:
            return cached[1]
    mods = d["_modules"]
    leaves: list = []
    parts = [_linear_parts(mods.get(n), leaves) for n in ("qkv", "o", "gate_up", "down")]
    args = None if any(p is None for p in parts) else _layer_args(layer, parts)
    d["_fused_decode"] = (leaves, args)
    return args


NO_TENSOR = torch.empty(0)  # decode_layer's "none" in a tensor list (a part's absent scales or bias)


def _linear_parts(m, leaves: list) -> list | None:
    """The parts of linear `m` as decode_layer takes them: (weights, scales, bias, kind, group, out
    features, zero point, rows below which the part runs its kernel, the activations' int8 parts
    (None: not an integer kernel)), or None where a part is on no kernel decode_layer calls. Each
    part's buffers go into `leaves` (the cache's check)."""
    from .layers import ConcatLinear, Int8wLinear, W16Linear

    if isinstance(m, ConcatLinear):
        parts = [_linear_parts(p, leaves) for p in m.parts]
        return None if any(p is None for p in parts) else [q for p in parts for q in p]
    bias = NO_TENSOR if getattr(m, "bias", None) is None else m.bias
    if isinstance(m, Int4Linear):
        rows = m.kernel_rows()
        if rows is None:
            return None
        part = (m.qw, m.qsc, bias, 0, m.group_size, m.out_features, 0, rows, m.act_parts)
        names = ("qw", "qsc")
    elif isinstance(m, Int8wLinear):
        part = (m.qw, m.qsc, bias, 1, m.group_size, m.out_features, m.zero, 1 << 62, m.act_parts)
        names = ("qw", "qsc")
    elif isinstance(m, W16Linear):
        part = (m.w, NO_TENSOR, NO_TENSOR if m.b is None else m.b, 2, 0, m.out_features, 0, 1 << 62, None)
        names = ("w", "b")
    else:
        return None
    buffers, params = m.__dict__["_buffers"], m.__dict__["_parameters"]
    leaves += [(buffers, n, buffers.get(n)) for n in names]
    leaves.append((params, "bias", params.get("bias")))  # (None there: a bias set later is seen)
    return [part]


def _layer_args(layer, parts: list[list]) -> tuple | None:
    qn, kn = layer.q_norm, layer.k_norm
    norms = [layer.input_norm, layer.post_norm] + ([qn, kn] if qn is not None else [])
    if (layer.moe is not None or layer.attn_out_norm is not None or layer.mlp_out_norm is not None
            or layer.sinks is not None or any(n.weight.dtype != torch.float32 for n in norms) or (qn is not None and kn.eps != qn.eps)):
        return None
    weights = [n.weight for n in norms]
    acts = {q[8] for p in parts for q in p if q[8] is not None}  # one activation width a layer
    if len(acts) > 1:
        return None
    ints = [layer.H, layer.KVH, layer.D, int(layer.window or 0), int(layer.gelu)] + [len(p) for p in parts]
    ints.append(acts.pop() if acts else 2)
    for part in (q for p in parts for q in p):
        weights += part[:3]
        ints += part[3:7]
    floats = [layer.input_norm.eps, layer.post_norm.eps, 1e-6 if qn is None else qn.eps, float(layer.softcap or 0.0)]
    return weights, ints, floats, min(q[7] for p in parts for q in p)


def uses_sdpa(meta: AttnMeta, layer) -> bool:
    """A sequence of this step is a fresh prompt that torch_attention runs through SDPA (not the
    paged kernel): the fused attend leaves such steps to it."""
    if meta.decode_only or meta.q_lens is None or layer.window or layer.softcap or layer.sinks is not None:
        return False
    return any(n == c and n >= SDPA_MIN_TOKENS for n, c in zip(meta.q_lens, meta.ctx_lens))
