"""Checkpoints -> a ready LlamaModel: the loading policy over the weights readers (gguf_weights,
hf_weights), which expose tensors under HF names with HF's rotate_half q/k row order, so the
model and the exporters see one layout. Linear layers are built in the precision the caller asks
for. A GGUF on CPU (and gpt-oss's MXFP4 checkpoint: its experts' blocks, bf16 elsewhere) keeps
the file's values, each matrix on the kernel of its type (exact repacks): Q4_0/Q4_1/Q4_K on the
int4 kernel, the other block types (Q8_0, Q6_K, Q5_*, IQ4_*, MXFP4, Q3_K, Q2_K) on the int8-lane
one, F16/BF16 on the 16-bit one, other types dequantized to fp32; nothing is re-quantized.
Elsewhere GGUF Q4_0/Q4_1 stay int4 and the rest is dequantized.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import logging
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..config import ModelConfig
from . import gguf_blocks, w16
from .convert_cache import ConvertCache, weights_fingerprint
from .errors import ModelLoadError
from .gguf import GGUFError, release_pages
from .gguf_weights import GGUFWeights
from .handle import ModelHandle
from .hf_weights import HFWeights
from .int4 import Int4Weight, quantize_rtn
from .layers import (
    BlockMatrix,
    ConcatLinear,
    DenseLinear,
    DenseMatrix,
    Int4Linear,
    Int8Linear,
    Int8wLinear,
    LMHead,
    Q8Matrix,
    RMSNorm,
    W16Linear,
    W16Matrix,
)
from .llama import DecoderLayer, LlamaModel
from .moe import (
    EXPERT_ACTS,
    Int4Experts,
    Int8wExperts,
    MoE,
    expert_tensor_names,
    int8w_form,
    make_experts,
    swiglu_oai,
)
from .weights import Weights, open_weights, reads_blocks

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PRECISIONS = ("auto", "float32", "bfloat16", "float16", "int8", "int4")


def _resolve_precision(precision: str, weights: Weights, device: str) -> tuple[str, torch.dtype]:
    """-> (linear mode, activation dtype). On CPU the int4/int8 kernels take bf16 inputs but the
    residual stream, attention and KV cache stay fp32: that keeps results independent of how
    requests are batched (bf16 attention flipped greedy tokens between batch shapes)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    cfg = weights.config
    # the first layer's MLP (an MoE layer: its first expert's), as stored
    first = ("model.layers.0." + cfg.checkpoint_linears()["gate_up"][0] + ".weight" if not cfg.is_moe_layer(0)
             else expert_tensor_names(cfg, 0)[1][0][0])
    native_int4 = reads_blocks(weights) and (
        weights.int4(first) is not None or (device == "cpu" and (gguf_blocks.supported(weights.kind(first)) or
                                                               weights.kind(first) in w16.GGUF_KINDS)))
    quantized = isinstance(weights, HFWeights) and weights.quant is not None
    if precision == "auto":
        if native_int4 or quantized:
            return "int4", (torch.float32 if device == "cpu" else torch.float16)
        # a bf16/fp16 checkpoint on CPU: its own values on our 16-bit kernel, fp32 math (as "float32"
        # up to summation order, half the bytes; BENCHMARKS.md); --quant fp32 keeps an fp32 copy
        if device == "cpu" and w16.stored_dtype(weights, first) is not None and w16.kernel_available():
            return "w16", torch.float32
        return ("float32", torch.float32) if device == "cpu" else ("bfloat16", torch.bfloat16)
    if precision in DTYPES:
        return precision, DTYPES[precision]
    return precision, (torch.float32 if device == "cpu" else torch.float16)


def _keep_dense(cfg: ModelConfig, mode: str, device: str, cpu_kernel: bool) -> bool:
    """Keep fp32 copies of int4 weights for prefill GEMMs (Int4Linear.dense) only where they pay:
    with torch's int4 kernel (2.3x faster at 512 rows) on a small model (8x the int4 bytes of RAM).
    Our kernel prefills as fast without them (SmolLM2-135M, 2 threads, 160-1000 tokens:
    502-656 tok/s either way, measured 2026-12-01) and they cost 425 MB there."""
    if mode != "int4" or device != "cpu":
        return False
    from localllm_kernels import cpu_int4

    if cpu_kernel and cpu_int4.load():
        return False
    from ..hardware import available_memory

    need = 4 * (cfg.num_params - cfg.vocab_size * cfg.hidden_size)
    return need <= min(2 << 30, available_memory("cpu") // 8)


def _gguf_q4_linear(weights: GGUFWeights, names: list[str], bias: torch.Tensor | None) -> Int4Linear | None:
    """GGUF Q4_0 / Q4_1 parts straight into our int4 kernel's layout by one C++ shuffle (no
    unpacked or fp32 copy of the weights on the way: first loads ~7x faster); None when the
    parts or this CPU do not allow it."""
    from localllm_kernels import cpu_int4, cpu_repack

    stacked = weights.stacked_blocks(names, ("Q4_0", "Q4_1"))  # one type, one width
    if stacked is None:
        return None
    raw, rows, _ = stacked
    n, k = raw.shape[0], raw.shape[1] * 32
    if not (cpu_int4.fits(n, k, 32) and cpu_int4.load() and cpu_repack.load()):
        return None
    packed = cpu_repack.q4_0_1([raw], torch.arange(n) if rows is None else rows, k)
    return Int4Linear.from_kernel_tensors({"qw": packed[0], "qsc": packed[1]}, n, 32, bias)


_INT4_KINDS = ("Q4_0", "Q4_1", "Q4_K")  # affine 4-bit groups of 32: the int4 kernel's layout


def _gguf_kernel(kind: str, n: int, k: int) -> str:
    """Which CPU kernel runs a GGUF matrix of this type: "int4" (cpu_int4), "int8" (cpu_int8, every
    other type with an exact integer decoding) or "dense" (fp32 values: float types, the rest)."""
    from localllm_kernels import cpu_int4, cpu_int8

    if kind in w16.GGUF_KINDS:
        return "w16" if w16.kernel_available() else "dense"
    if not gguf_blocks.supported(kind):
        return "dense"
    if kind in _INT4_KINDS and cpu_int4.fits(n, k, 32) and cpu_int4.load():
        return "int4"
    return "int8" if cpu_int8.fits(n, k, gguf_blocks.GROUP[kind]) and cpu_int8.load() else "dense"


def _gguf_repacked_linear(weights: Weights, names: list[str], kernel: str,
                          bias: torch.Tensor | None) -> nn.Module | None:
    """Parts all Q4_K (on the int4 kernel) or all of one of cpu_repack's other types (int8-lane)
    repacked from the file's blocks in one C++ pass (localllm_kernels.cpu_repack: the torch path's bytes;
    that path took ~6 of a 1B Q4_K_M file's 9.8 s first load), the parts read side by side and
    reordered by the repack itself (no concatenated or gathered copy); None where the parts or
    the kernel do not allow it."""
    from localllm_kernels import cpu_int8, cpu_repack

    kinds = {weights.kind(n) for n in names}
    kind = kinds.pop() if len(kinds) == 1 else None
    if not ((kind == "Q4_K" and kernel == "int4") or (kind in cpu_repack.KINDS[1:] and kernel == "int8")):
        return None
    stacked = weights.stacked_blocks(names, cpu_repack.KINDS)
    if stacked is None or not cpu_repack.load():
        return None
    raw, rows, scales = stacked  # (scales: MXFP4's E8M0 bytes apart, as gpt-oss's checkpoints keep them)
    n = raw.shape[0]
    bits = cpu_int8.preferred_bits(cpu_repack.BITS.get(kind, 4))
    if kind == "Q4_K":
        qw, qsc = cpu_repack.q4_k(raw, rows)
        return Int4Linear.from_kernel_tensors({"qw": qw, "qsc": qsc}, n, 32, bias)
    if kind in cpu_repack.BLOCK32:
        qw, qsc = cpu_repack.block32(raw, kind, bits, rows, scales)
        # the torch path keeps fp32 scales then (numpy's check: torch's forks its threads for each of
        # an MoE's thousands of small matrices, 0.6 s of an OLMoE-shaped first load)
        if not np.isfinite(qsc.numpy()).all():
            return None
    else:
        qw, qsc = cpu_repack.int8(raw, kind, bits, rows)
    return Int8wLinear(qw, qsc, n, gguf_blocks.GROUP[kind], cpu_repack.ZERO[kind], bias)


def _gguf_run_linear(weights: Weights, names: list[str], kernel: str, bias: torch.Tensor | None) -> nn.Module:
    """One kernel's linear over consecutive parts of a fused layer (their rows stacked)."""
    if kernel == "dense":
        return DenseLinear(torch.cat([weights.dense(n).float() for n in names]), bias)
    if kernel == "w16":
        return w16.linear(weights, names, bias)
    fast = _gguf_repacked_linear(weights, names, kernel, bias)
    if fast is not None:
        return fast
    parts = [weights.blocks(n) for n in names]
    n = sum(p.q.shape[0] for p in parts)
    # a run of one K-quant type keeps the file's sub-scales (its own bytes; see stack_key)
    sub = (gguf_blocks.SubScales.cat([p.sub for p in parts]).packed() if all(p.sub is not None for p in parts)
           else None)
    if kernel == "int4":
        from localllm_kernels import cpu_int4

        d = torch.cat([p.d for p in parts])
        sym = all(p.m is None and p.zero == 8 for p in parts)  # Q4_0: d alone
        m = None if sym else torch.cat([p.m if p.m is not None else -p.zero * p.d for p in parts])  # -8d: exact
        qw, qsc = cpu_int4.pack_dm(torch.cat([p.q for p in parts]), d, m, sub)
        return Int4Linear.from_kernel_tensors({"qw": qw, "qsc": qsc}, n, 32, bias)
    from localllm_kernels import cpu_int8

    # one group size, zero point and scale form for the stack: 32-groups split into 16s, and parts
    # of different zero points (or with offsets) all with offsets m = -zero * d: exact
    group = min(p.group for p in parts)
    zero = max(p.zero for p in parts)
    sym = all(p.m is None and p.zero == zero for p in parts)

    def per(t: torch.Tensor, g: int) -> torch.Tensor:
        return t.repeat_interleave(g // group, dim=1)

    d = torch.cat([per(p.d, p.group) for p in parts])
    m = None if sym else torch.cat([per(p.m if p.m is not None else -p.zero * p.d, p.group) for p in parts])
    bits = cpu_int8.preferred_bits(max(p.bits for p in parts))
    lut = parts[0].lut if all(p.lut is not None for p in parts) else None  # IQ4: indices, not bytes
    qw, qsc = cpu_int8.pack(torch.cat([p.q for p in parts]), d, m, zero, bits, sub, lut)
    return Int8wLinear(qw, qsc, n, group, zero, bias)


def _gguf_kernel_linear(weights: Weights, names: list[str], bias: torch.Tensor | None) -> nn.Module:
    """A GGUF linear on our CPU kernels, each part on the kernel of its type (a K-quant mix stores
    the parts of one fused layer in different types): runs of parts sharing a kernel become one
    matrix, several runs a ConcatLinear. The weights are exactly the file's values."""
    kernels, keys = [], []
    for name in names:
        n, k = weights.shape(name)
        kind = weights.kind(name)
        kernels.append(_gguf_kernel(kind, n, k))
        # int8-lane parts stack only with parts of their own group and zero point: each keeps the
        # file's bytes per weight (a Q5_0 q/k beside a Q8_0 v took 0.75 bytes a weight, not 0.69)
        # (on the int4 kernel Q4_K keeps its sub-scales: it stacks only with Q4_K)
        keys.append((kernels[-1], gguf_blocks.stack_key(kind)) if kernels[-1] == "int8" else
                    (kernels[-1], kind == "Q4_K"))
    runs: list[tuple[str, list[str]]] = []
    last = None
    for name, kern, key in zip(names, kernels, keys):
        if runs and last == key:
            runs[-1][1].append(name)
        else:
            runs.append((kern, [name]))
        last = key
    sizes = [sum(weights.shape(n)[0] for n in run) for _, run in runs]
    biases = [None] * len(runs) if bias is None else list(bias.split(sizes))
    linears = [_gguf_run_linear(weights, run, kern, b) for (kern, run), b in zip(runs, biases)]
    return linears[0] if len(linears) == 1 else ConcatLinear(linears)


def _linear(weights: Weights, names: list[str], mode: str, act_dtype: torch.dtype, device: str, dense: bool = False,
            cpu_kernel: bool = True):
    biases = [n.replace(".weight", ".bias") for n in names]
    bias = torch.cat([weights.dense(b).float() for b in biases]) if all(weights.has(b) for b in biases) else None
    if mode == "w16":
        return w16.linear(weights, names, bias)
    if mode == "int4" and device == "cpu" and cpu_kernel and not dense and reads_blocks(weights):
        fast = _gguf_q4_linear(weights, names, bias)
        if fast is not None:
            return fast
        return _gguf_kernel_linear(weights, names, bias)
    if mode == "int4":
        parts = [weights.int4(n) for n in names]
        if all(p is not None for p in parts):
            if Int4Weight.can_cat(parts):
                return Int4Linear(Int4Weight.cat(parts), act_dtype, bias, device, dense, cpu_kernel=cpu_kernel)
            # act-order parts with different input permutations: one int4 matmul each
            sizes = [p.shape[0] for p in parts]
            bs = [None] * len(parts) if bias is None else list(bias.split(sizes))
            return ConcatLinear([Int4Linear(p, act_dtype, b, device, cpu_kernel=cpu_kernel) for p, b in zip(parts, bs)])
    w = torch.cat([weights.dense(n).float() for n in names])
    # a GGUF's values are used as stored: a type without a kernel here stays exact (dense)
    prequantized = isinstance(weights, GGUFWeights) or (isinstance(weights, HFWeights) and weights.quant is not None)
    if mode == "int4" and not prequantized:  # quantize on load: largest group that divides K
        group = next((g for g in (128, 64, 32) if w.shape[1] % g == 0), None)
        if group is not None:
            return Int4Linear(quantize_rtn(w, group), act_dtype, bias, device, dense, cpu_kernel=cpu_kernel)
    if mode == "int8" and device == "cpu":
        return Int8Linear(w, act_dtype, bias)
    return DenseLinear(w.to(device, act_dtype), None if bias is None else bias.to(device, act_dtype))


def _trim_heap() -> None:
    """Give the C heap's free pages back to the OS. glibc keeps them: repacking an MoE layer's
    experts one by one on torch's int4 path (each a few short-lived copies) left ~2.5x the
    experts' size in RSS, 18.7 GB of peak for a 4.3 GB OLMoE-shaped GGUF."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@contextlib.contextmanager
def _lean_heap():
    """While a checkpoint is converted, allocations of 128 KiB and more get their own mappings
    (glibc's M_MMAP_THRESHOLD), so every temporary of a conversion goes back to the OS when
    freed. With glibc's default the threshold climbs to the size of the first freed temporary and
    later ones share the heap with the layers being kept: the holes between them are never
    returned (a Q4_K_M 135M file's first load peaked at 646 MB, 471 MB this way). Afterwards
    the limits glibc's own adaptation reaches (32 MiB, trim at 64 MiB), with the heap trimmed."""
    try:
        libc = ctypes.CDLL(None)
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        yield
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 128 << 10)
    try:
        yield
    finally:
        mallopt(m_mmap_threshold, 32 << 20)
        mallopt(m_trim_threshold, 64 << 20)
        trim(0)


def _moe_block(weights: Weights, cfg: ModelConfig, layer: int, mode: str, act_dtype: torch.dtype, device: str,
               cpu_kernel: bool, cache: ConvertCache | None) -> MoE:
    """One MoE layer: the router exact in fp32, each expert's gate/up (one fused linear) and down
    in the layer precision (GGUF Q4 experts repacked, HF weights RTN-quantized for int4), stacked
    for our int4 MoE op where the kernel takes them; from the conversion cache when it has them."""
    router, names = expert_tensor_names(cfg, layer)

    def expert(e: int) -> tuple:
        g, u, d = names[e]
        return (_linear(weights, [g, u], mode, act_dtype, device, cpu_kernel=cpu_kernel),
                _linear(weights, [d], mode, act_dtype, device, cpu_kernel=cpu_kernel))

    act = (EXPERT_ACTS[cfg.expert_act], cfg.swiglu_alpha, cfg.swiglu_limit)
    whole = mode == "int4" and device == "cpu" and cpu_kernel and reads_blocks(weights)

    def build_experts():
        experts = ((_layer_experts(weights, names, cfg.moe_intermediate_size, act) if whole else None)
                   or make_experts(expert, cfg.num_experts, cfg.moe_intermediate_size, act))
        _trim_heap()
        return experts

    def exact(name: str) -> torch.Tensor:
        def build():
            return weights.dense(name).float().to(device)
        return cache.tensor(name, build) if cache else build()

    experts = (cache.experts(f"{layer}.experts", cfg.num_experts, cfg.moe_intermediate_size, build_experts, act)
               if cache else build_experts())
    bias = router.replace(".weight", ".bias")
    loop_act = (functools.partial(swiglu_oai, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
                if cfg.expert_act == "swiglu_oai" else None)  # (LoopExperts apply it; Int8wExperts carry `act`)
    return MoE(exact(router), experts, cfg.num_experts_per_tok, cfg.norm_topk_prob,
               exact(bias) if weights.has(bias) else None, cfg.router_gating, loop_act)


def _layer_experts(weights: Weights, names: list[tuple[str, str, str]], inter: int,
                   act: tuple[int, float, float]) -> Int4Experts | Int8wExperts | None:
    """An MoE layer's experts built whole: each matrix of all E experts in one repack of the blocks
    the reader gives side by side (the layer's gate/up rows expert by expert, then its downs), which
    is already the op's [E, ...] stack when an expert's rows fill whole 16-row panels: no expert
    repacked alone and then copied into the stack (make_experts' way: 1,536 repacks and 10 GB of
    copies for gpt-oss-20b). The stacks make_experts would build from the same linears (Int4Experts
    where both matrices are int4 and the activation SiLU, else Int8wExperts); None where the types or
    shapes do not allow it."""
    e = len(names)
    mats = []
    for parts in ([n for g, u, _ in names for n in (g, u)], [d for *_, d in names]):
        kinds = {weights.kind(n) for n in parts}
        rows, k = sum(weights.shape(n)[0] for n in parts), weights.shape(parts[0])[1]
        kernel = _gguf_kernel(kinds.pop(), rows // e, k) if len(kinds) == 1 else None
        if rows % (16 * e) or kernel not in ("int4", "int8"):
            return None
        m = _gguf_q4_linear(weights, parts, None) if kernel == "int4" else None
        if m is None:
            m = _gguf_repacked_linear(weights, parts, kernel, None)
        if m is None:
            return None
        mats.append(m)
    biases = []
    for parts in ([(g, u) for g, u, _ in names], [(d,) for *_, d in names]):
        have = [weights.has(n.replace(".weight", ".bias")) for p in parts for n in p]
        if any(have) != all(have):
            return None
        if all(have):
            biases.append(torch.stack([torch.cat([weights.dense(n.replace(".weight", ".bias")).float() for n in p])
                                       for p in parts]))
    if len(biases) == 1:  # biases on one matrix only: make_experts' way (looped) takes them
        return None
    stacks = [t.view(e, -1, *t.shape[1:]) for m in mats for t in (m.qw, m.qsc)]
    if not biases and act[0] == 0 and Int4Experts.fits(mats[:1], mats[1:]):
        return Int4Experts(*stacks, mats[0].group_size, mats[1].group_size, inter)
    if not Int8wExperts.fits(mats[:1], mats[1:]):
        return None
    (_, _, g1, z1), (_, _, g2, z2) = (int8w_form(m) for m in mats)
    return Int8wExperts(*stacks, (g1, z1, g2, z2), inter, *(biases or (None, None)), act=act)


def _linear_names(cfg: ModelConfig) -> list[str]:
    """The checkpoint names of the dense layers' linears (MoE experts aside)."""
    mods = cfg.checkpoint_linears()
    return [f"model.layers.{i}.{m}.weight" for i in range(cfg.num_layers) for f in ("qkv", "o", "gate_up", "down")
            for m in mods[f] if not (cfg.is_moe_layer(i) and f in ("gate_up", "down"))]


def _context_length(cfg: ModelConfig, max_model_len: int | None) -> int:
    return min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)


def load_model(path: str | os.PathLike, precision: str = "auto", device: str = "cpu",
               max_model_len: int | None = None, fast_head: bool = True, cpu_kernels: bool = True,
               mmproj: str | os.PathLike | None = None) -> ModelHandle:
    """cpu_kernels=False: torch's own int4 kernel on CPU instead of ours (what a CPU without
    AVX2 runs; for comparisons). mmproj: llama.cpp's vision tower file for a GGUF text model
    (default: the mmproj*.gguf beside it, if one is there)."""
    with _lean_heap(), _no_cycle_collection():
        return _load_model(path, precision, device, max_model_len, fast_head, cpu_kernels, mmproj)


@contextlib.contextmanager
def _no_cycle_collection():
    """Python's cycle collector paused while a checkpoint loads: the load allocates ~10^5 objects
    (tokenizer tables, GGUF fields), each few hundred triggering a pass, and the full passes walk
    every object torch's import made (~0.1-0.2 s of a 1B GGUF's 2.4-2.7 s first load here).
    Reference counting still frees what the load drops."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _load_model(path: str | os.PathLike, precision: str, device: str, max_model_len: int | None, fast_head: bool,
                cpu_kernels: bool, mmproj: str | os.PathLike | None = None) -> ModelHandle:
    origin = {"path": str(Path(path).resolve()), "precision": precision, "device": device,
              "max_model_len": max_model_len, "fast_head": fast_head, "cpu_kernels": cpu_kernels}
    weights = open_weights(path)
    cfg = weights.config
    if device == "cpu" and cpu_kernels:  # a first contact compiles them at once, not one by one
        from localllm_kernels import cpu_prebuild

        cpu_prebuild.build_missing()
    mode, act_dtype = _resolve_precision(precision, weights, device)
    tokenizer = weights.tokenizer()
    dense = _keep_dense(cfg, mode, device, cpu_kernels)
    cache = ConvertCache.open(path, weights, mode, device, dense, cpu_kernels)

    def linear(key: str, names: list[str]):
        def build():
            return _linear(weights, names, mode, act_dtype, device, dense, cpu_kernels)
        return cache.linear(key, build) if cache else build()

    def norm(name: str) -> RMSNorm:
        w = weights.dense(name + ".weight")
        if cfg.norm_weight_offset:  # Gemma: (1 + w), the 1 added once here, kept in fp32 (as transformers)
            return RMSNorm(w.float().to(device) + cfg.norm_weight_offset, cfg.rms_norm_eps, scale_in_fp32=True)
        return RMSNorm(w.to(device, act_dtype), cfg.rms_norm_eps)

    max_len = _context_length(cfg, max_model_len)
    modules = cfg.checkpoint_linears()  # separate q/k/v, gate/up or (Phi-3) already fused
    layers = []
    try:
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            moe = (_moe_block(weights, cfg, i, mode, act_dtype, device, cpu_kernels, cache) if cfg.is_moe_layer(i)
                   else None)
            qkv, o, gate_up, down = (None if moe and f in ("gate_up", "down") else
                                     linear(f"{i}.{f}", [p + m + ".weight" for m in modules[f]])
                                     for f in ("qkv", "o", "gate_up", "down"))
            sinks = weights.dense(p + "self_attn.sinks.weight").float().to(device) if cfg.attn_sinks else None
            layers.append(DecoderLayer(cfg, qkv, o, gate_up, down, moe=moe, window=cfg.window(i), sinks=sinks,
                                       **{n: norm(p + m) for n, m in cfg.checkpoint_norms().items()}))
        # the embedding and head stay exact (fp32 on CPU, or the file's blocks read in place):
        # they are where rounding flips tokens
        head_dtype = torch.float32 if device == "cpu" else act_dtype

        mapped: list[torch.Tensor] = []  # exact matrices read in place from the file's mapping

        def exact(name: str) -> DenseMatrix | Q8Matrix | BlockMatrix | W16Matrix:
            from localllm_kernels import cpu_q8, cpu_table

            got = weights.mapped_blocks(name) if device == "cpu" and isinstance(weights, GGUFWeights) else None
            if got is not None and got[0] == "Q8_0" and cpu_q8.load():
                mapped.append(got[1])
                return Q8Matrix(got[1])
            if got is not None and got[0] in cpu_table.KINDS and cpu_table.load():
                mapped.append(got[1])
                return BlockMatrix(got[1], got[0])
            # stored in 16 bits (GGUF F16/BF16, HF bf16/fp16): kept so, exact, where our kernel runs
            if (device == "cpu" and mode in ("int4", "int8", "w16") and w16.stored_dtype(weights, name) in w16.DTYPES
                    and w16.kernel_available()):
                return W16Matrix(w16.tensor16(weights, name))

            def build():
                return weights.dense(name).to(device, head_dtype)
            return DenseMatrix(cache.tensor(name, build) if cache else build())

        embed = exact("model.embed_tokens.weight")
        head_w = embed if cfg.tie_word_embeddings or not weights.has("lm_head.weight") else exact("lm_head.weight")
        final_norm = norm("model.norm")
    except (GGUFError, KeyError) as e:
        raise ModelLoadError(f"{path}: {e}") from None
    fast_greedy = fast_head and mode in ("int4", "int8", "w16") and device == "cpu"
    # building the ranking copy reads every row of the head; decode reads a few: a head read in
    # place from the file's mapping gives its pages back as the build passes them (a 128k x 2048
    # Q6_K table: 215 MB of RSS that later loads, which take the copy from the cache, never have)
    read_rows = None
    if any(getattr(head_w, "blocks", None) is t for t in mapped):
        def read_rows(r0: int, r1: int) -> None:
            release_pages(head_w.blocks[r0:r1])
    fast = None
    if fast_greedy and cache:
        fast = cache.linear("head_int4", lambda: LMHead(head_w, True, device=device, cpu_kernel=cpu_kernels,
                                                        read_rows=read_rows).fast)
    head = LMHead(head_w, fast_greedy=fast_greedy, device=device, fast=fast, cpu_kernel=cpu_kernels,
                  softcap=cfg.final_logit_softcap, read_rows=read_rows)
    if cache and not cache.intact():  # the layers hold a damaged file's tensors: convert anew
        return _load_model(path, precision, device, max_model_len, fast_head, cpu_kernels, mmproj)
    # which int4 kernel(s) the layers call (also inside ConcatLinear): a compiled graph bakes it in
    kinds = {m.kind for part in (*layers, head) for m in part.modules()
             if isinstance(m, (Int4Linear, Int8wLinear, W16Linear))}
    kernel = "+".join(sorted(kinds)) or None
    fingerprint = weights_fingerprint(path, mode, act_dtype, max_len, dense, fast_greedy, device, kernel,
                                      type(head_w).__name__)
    model = LlamaModel(cfg, embed, layers, final_norm, head, act_dtype, max_len, device, fingerprint, origin,
                       tuple(mapped))
    if cache:
        cache.save()  # in the background
    eos = set(tokenizer.eos_ids) | weights.extra_eos_ids()
    desc = mode
    if mode == "int4" and device == "cpu":
        from localllm_kernels import cpu_int4

        isa = cpu_int4.isa_name() if kernel == "cpu_int4" else ""
        desc = {"cpu_int4": f"int4 weights (our kernel, {isa}, 16-bit matmul inputs), fp32 activations",
                "aten": "int4 weights, bf16 matmul inputs, fp32 activations"}.get(kernel, mode)
        # the kernels each matrix runs on (an MoE's stacked int8-lane experts too)
        lanes = kinds | ({"int8w"} if any(isinstance(m, Int8wExperts) for layer in layers for m in layer.modules())
                         else set())
        if lanes - {"cpu_int4", "aten"}:  # a GGUF of wider or mixed types, each tensor on its type's kernel
            from localllm_kernels import cpu_int8

            # (an MoE layer's experts share their stacks' types: its first expert's names them)
            experts = [n for i in range(cfg.num_layers) if cfg.is_moe_layer(i) for n in expert_tensor_names(cfg, i)[1][0]]
            types = "/".join(sorted({weights.kind(n) for n in _linear_names(cfg) + experts}))
            int4 = any(isinstance(m, Int4Linear) and m.kind == "cpu_int4" for layer in layers for m in layer.modules())
            ours = "/".join(n for n, k in (("int4", int4), ("int8-lane", "int8w" in lanes), ("16-bit", "w16" in lanes))
                            if k)  # (the head's int4 copy aside)
            inputs = "16-bit matmul inputs" if int4 or "int8w" in lanes else "fp32 matmul inputs"
            isa = cpu_int8.isa() if "int8w" in lanes else w16.isa()
            source = "GGUF " if isinstance(weights, GGUFWeights) else ""
            desc = f"{source}{types} weights as stored (our {ours} kernels, {isa}, {inputs}), fp32 activations"
    if mode == "w16":
        desc = w16.describe(layers)
    # CPU, int4/int8 weights: a 16-bit KV cache reads half the bytes per decode step; measured on
    # the real model against the fp32 cache (bench/check_kv.py): perplexity +0.001%, greedy tokens
    # 599/599 equal. fp16, not bf16 (+0.02%, 3 flips). --quant float32 keeps the exact fp32 cache.
    kv_dtype = torch.float16 if device == "cpu" and mode in ("int4", "int8", "w16") else act_dtype
    vision = _vision(path, weights, tokenizer, device, act_dtype, mmproj)
    return ModelHandle(model, tokenizer, cfg, eos, desc, kv_dtype, str(path), max_len, vision=vision)


def _vision(path, weights: Weights, tokenizer, device: str, act_dtype: torch.dtype, mmproj=None):
    """The vision tower of a vision-language checkpoint, or of a GGUF's mmproj file, in the
    activation dtype (fp32 on CPU: the tower runs once per image, so its exactness costs little)."""
    if isinstance(weights, GGUFWeights):
        from .vision.mmproj import find_mmproj, load_mmproj

        mmproj = mmproj or find_mmproj(path)
        if mmproj is None:
            return None
        return load_mmproj(mmproj, weights.arch, weights.config.hidden_size, tokenizer, device, act_dtype)
    if mmproj is not None:
        raise ModelLoadError(f"{path}: --mmproj goes with a GGUF text model; this checkpoint's vision tower, if it "
                             "has one, is read from its own files")
    from .vision.load import load_vision

    return load_vision(Path(path), weights.raw_config, weights.has, weights.dense, tokenizer, device, act_dtype)
