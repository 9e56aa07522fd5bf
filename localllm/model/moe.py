"""Mixture-of-experts MLP blocks (Mixtral, Qwen3-MoE, gpt-oss), in place of a layer's gate_up/down.

A router (kept exact in fp32: it is E x hidden, tiny) scores the experts per token; softmax in
fp32, the top k, optionally renormalised to sum to 1 (Mixtral always, Qwen3-MoE per
norm_topk_prob); the output is the weighted sum of those k experts' SiLU-gated MLPs. gpt-oss:
a router bias, the top k logits softmaxed among themselves, experts with biases and a clamped
SwiGLU (`swiglu_oai`).

Speed: a decode step must read only the chosen experts' weights (k of E). Both implementations
group the (token, expert) pairs by expert and run one GEMM per used expert on its gathered rows:
  Int4Experts: int4 experts stacked [E, ...] in our int4 kernel's layout, the whole MLP in one C++
    op (localllm::moe_int4): no data-dependent Python, so the compiled CPU step exports it;
  Int8wExperts: the same for experts on the int8-lane kernel (GGUF MXFP4, Q5_K, Q6_K, Q8_0, ...
    experts, one type a matrix, and the mixes of a K-quant file: Q4_K gate/up beside a Q6_K down,
    the int4 layout being the int8-lane one for 4-bit values; gpt-oss's biases and clamped
    SwiGLU too): localllm::moe_int8w; eager (no package is built for it);
  LoopExperts: any other linears (fp32/bf16, torch's int4, CUDA, experts whose matrices take
    different kernels), a Python loop over the used experts: eager only (`compilable` says so to
    the compiled step and the CUDA graphs).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .layers import Int4Linear, Int8wLinear

# one expert's matrix of an MoE layer (HF names: Mixtral's w1/w3/w2, Qwen3-MoE's gate/up/down_proj)
EXPERT_NAME = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.(weight|bias)")
EXPERT_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def expert_tensor_names(cfg: ModelConfig, layer: int) -> tuple[str, list[tuple[str, str, str]]]:
    """(router, [(gate, up, down) of each expert]): the checkpoint names of one MoE layer as the
    hub checkpoints store them (one tensor per expert and matrix)."""
    p = f"model.layers.{layer}."
    if cfg.architecture == "MixtralForCausalLM":
        p += "block_sparse_moe."
        parts = ("w1", "w3", "w2")
    else:
        p += "mlp."
        parts = ("gate_proj", "up_proj", "down_proj")
    return p + "gate.weight", [tuple(f"{p}experts.{e}.{m}.weight" for m in parts) for e in range(cfg.num_experts)]


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation on [gate | up]: gate clamped above at `limit`, up to +-limit,
    (up + 1) * gate * sigmoid(alpha * gate) (transformers' GptOssExperts, in its order)."""
    g, u = gate_up.chunk(2, dim=-1)
    g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return (u + 1) * (g * torch.sigmoid(g * alpha))


class MoE(nn.Module):
    def __init__(self, router: torch.Tensor, experts: nn.Module, top_k: int, renormalize: bool,
                 router_bias: torch.Tensor | None = None, gating: str = "softmax", act: Callable | None = None):
        """gating "softmax": softmax over all experts, then the top k (renormalized if asked);
        "topk_softmax" (gpt-oss): the top k logits, softmaxed among themselves. act: the experts'
        activation of their gate_up output (None: the layer ops' SiLU*up)."""
        super().__init__()
        if gating not in ("softmax", "topk_softmax"):
            raise ValueError(f"unknown router gating {gating!r}")
        self.router = nn.Parameter(router.float(), requires_grad=False)  # [E, hidden]
        self.register_buffer("router_bias", None if router_bias is None else router_bias.float())
        self.experts, self.top_k, self.renormalize = experts, top_k, renormalize
        self.gating, self.act = gating, act

    def forward(self, h: torch.Tensor, ops) -> torch.Tensor:
        logits = F.linear(h.float(), self.router, self.router_bias)
        if self.gating == "topk_softmax":
            top, ids = logits.topk(self.top_k, dim=-1)
            w = torch.softmax(top, dim=-1)
        else:
            w, ids = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
            if self.renormalize:
                w = w / w.sum(dim=-1, keepdim=True)
        return self.experts(h, ids, w, self.act or ops.act)


class LoopExperts(nn.Module):
    """Experts as separate linears (gate_up fused per expert, down), looped over the used ones."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module]):
        super().__init__()
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, act: Callable) -> torch.Tensor:
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # pairs t * k + j grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=len(self.down)).tolist()
        wflat = w.reshape(-1).to(x.dtype)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                pairs = order[start:start + n]
                rows = pairs // k
                y = self.down[e](act(self.gate_up[e](x[rows])))
                # (index_add_ here took 34 ms a call for 8 rows on 2 busy cores: 4x the whole step)
                out.index_put_((rows,), y * wflat[pairs, None], accumulate=True)
            start += n
        return out


class Int4Experts(nn.Module):
    """Int4 experts stacked for localllm::moe_int4 (localllm_kernels/cpu/int4_gemm.cpp): w1/s1 each expert's
    gate_up, w2/s2 its down, [E, ...] in our int4 kernel's layout (what the conversion cache stores)."""

    def __init__(self, w1: torch.Tensor, s1: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, group1: int,
                 group2: int, inter: int):
        from localllm_kernels import cpu_int4

        super().__init__()
        cpu_int4.load()  # registers the op (stacks from the conversion cache come without an Int4Linear)
        self.group1, self.group2, self.inter = group1, group2, inter
        for name, t in (("w1", w1), ("s1", s1), ("w2", w2), ("s2", s2)):
            self.register_buffer(name, t)

    @classmethod
    def stacked(cls, experts: Iterable[tuple[Int4Linear, Int4Linear]], n: int, inter: int) -> Int4Experts | None:
        """The n (gate_up, down) pairs stacked (_stack); None when one does not fit the kernel."""
        def parts(gate_up: nn.Module, down: nn.Module) -> tuple | None:
            if not cls.fits([gate_up], [down]):
                return None
            return (gate_up.qw, gate_up.qsc, down.qw, down.qsc), (gate_up.group_size, down.group_size)
        stack = _stack(experts, n, parts)
        return None if stack is None else cls(*stack[0], *stack[1], inter)

    @staticmethod
    def fits(gate_up: list[nn.Module], down: list[nn.Module]) -> bool:
        """Every expert on our int4 kernel, without bias or input permutation, one group size per matrix."""
        layers = [*gate_up, *down]
        if not all(isinstance(m, Int4Linear) and m.kind == "cpu_int4" and m.bias is None and m.in_perm is None
                   for m in layers):
            return False
        return len({m.group_size for m in gate_up}) == 1 and len({m.group_size for m in down}) == 1

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, act: Callable) -> torch.Tensor:
        y = torch.ops.localllm.moe_int4(x.float(), ids, w.float(), self.w1, self.s1, self.w2, self.s2,
                                        self.group1, self.group2, self.inter)
        return y.to(x.dtype)


class Int8wExperts(nn.Module):
    """Int8-lane experts stacked for localllm::moe_int8w (localllm_kernels/cpu/int8_gemm.cpp): w1/s1
    each expert's gate_up, w2/s2 its down, [E, ...] in Int8wLinear's layout; one group size, zero
    point and scale form per matrix (what the conversion cache stores); b1/b2 their biases [E, 2I] /
    [E, H] (gpt-oss) or None; act (kind, alpha, limit): kind 0 SiLU*up, 1 gpt-oss's clamped SwiGLU
    (EXPERT_ACTS). The activations keep 16 bits (--act-bits 8 leaves the experts as it leaves
    moe_int4's)."""

    def __init__(self, w1: torch.Tensor, s1: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, forms: tuple[int, ...],
                 inter: int, b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                 act: tuple[int, float, float] = (0, 0.0, 0.0)):
        from localllm_kernels import cpu_int8

        super().__init__()
        cpu_int8.load()  # registers the op (stacks from the conversion cache come without an Int8wLinear)
        (self.group1, self.zero1, self.group2, self.zero2), self.inter = forms, inter
        self.act_kind, self.alpha, self.limit = act
        for name, t in (("w1", w1), ("s1", s1), ("w2", w2), ("s2", s2), ("b1", b1), ("b2", b2)):
            self.register_buffer(name, t)

    @classmethod
    def stacked(cls, experts: Iterable[tuple[nn.Module, nn.Module]], n: int, inter: int,
                act: tuple[int, float, float] = (0, 0.0, 0.0)) -> Int8wExperts | None:
        """The n (gate_up, down) pairs stacked (_stack); None when one does not fit the kernel."""
        def parts(gate_up: nn.Module, down: nn.Module) -> tuple | None:
            if not cls.fits([gate_up], [down]):
                return None
            (w1, s1, g1, z1), (w2, s2, g2, z2) = int8w_form(gate_up), int8w_form(down)
            biases = (gate_up.bias.float(), down.bias.float()) if gate_up.bias is not None else ()
            return (w1, s1, w2, s2, *biases), (g1, z1, g2, z2, len(biases))
        stack = _stack(experts, n, parts)
        if stack is None:
            return None
        (w1, s1, w2, s2, *biases), form = stack
        return cls(w1, s1, w2, s2, form[:4], inter, *(biases or (None, None)), act=act)

    @staticmethod
    def fits(gate_up: list[nn.Module], down: list[nn.Module]) -> bool:
        """Every expert's matrices on the int8-lane kernel as they are, both with a bias or neither."""
        return all(int8w_form(m) is not None for m in (*gate_up, *down)) and all(
            (g.bias is None) == (d.bias is None) for g, d in zip(gate_up, down))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, act: Callable) -> torch.Tensor:
        y = torch.ops.localllm.moe_int8w(x.float(), ids, w.float(), self.w1, self.s1, self.w2, self.s2, self.group1,
                                         self.zero1, self.group2, self.zero2, self.inter, 2, self.b1, self.b2,
                                         self.act_kind, self.alpha, self.limit)
        return y.to(x.dtype)


# an expert activation's kind in moe_int8w (its name in ModelConfig.expert_act)
EXPERT_ACTS = {"silu": 0, "swiglu_oai": 1}


def _stack(experts: Iterable[tuple[nn.Module, nn.Module]], n: int, parts: Callable) -> tuple[list, tuple] | None:
    """The n (gate_up, down) pairs' kernel tensors (parts(gate_up, down) -> ((w1, s1, w2, s2), form)
    or None) copied into [n, ...] buffers allocated once, as each pair comes: the caller builds one
    expert at a time and drops it, so a layer is never held twice (per expert, then stacked).
    -> (buffers, form); None when a pair does not fit, differs from the first in shapes or form, or
    n do not come."""
    bufs, form, count = None, None, 0
    for e, pair in enumerate(experts):
        got = parts(*pair)
        if got is None:
            return None
        tensors, f = got
        if bufs is None:
            bufs, form = [t.new_empty(n, *t.shape) for t in tensors], f
        if f != form or any(t.shape != b.shape[1:] or (t.dtype == torch.uint8) != (b.dtype == torch.uint8)
                            for t, b in zip(tensors, bufs)):
            return None
        for i, t in enumerate(tensors):
            if t.dtype != bufs[i].dtype and bufs[i].dtype == torch.float16:
                bufs[i] = bufs[i].float()  # fp16 where exact per expert: one dtype (fp32) for the stack
            bufs[i][e].copy_(t)
        del pair, got, tensors  # before the next expert is built
        count += 1
    return (bufs, form) if count == n else None


def int8w_form(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
    """(w, scales, group size, zero point) of a linear the int8-lane kernel runs as it is stored (its
    bias aside): an Int8wLinear, or an Int4Linear on our int4 kernel with groups of 32 (its layout and
    scale forms are the int8-lane ones for 4-bit values with zero point 8: the same outputs bit for bit)."""
    if isinstance(m, Int8wLinear):
        return m.qw, m.qsc, m.group_size, m.zero
    if (isinstance(m, Int4Linear) and m.kind == "cpu_int4" and m.in_perm is None
            and m.dense is None and m.group_size == 32):
        return m.qw, m.qsc, 32, 8
    return None


def make_experts(expert: Callable[[int], tuple[nn.Module, nn.Module]], n: int, inter: int,
                 act: tuple[int, float, float] = (0, 0.0, 0.0)) -> nn.Module:
    """The fastest implementation the experts' linears allow (see the module docstring), from
    expert(e) -> (gate_up, down), called once per expert in order (twice in the rare layer whose
    experts start on the kernel and then leave it: mixed group sizes). act: the experts' activation
    (Int8wExperts' (kind, alpha, limit); moe_int4 has SiLU*up only, and no biases)."""
    first = expert(0)
    for cls in (Int4Experts, Int8wExperts) if act[0] == 0 else (Int8wExperts,):
        if cls.fits([first[0]], [first[1]]):
            pairs = itertools.chain([first], (expert(e) for e in range(1, n)))
            del first  # the chain holds it only until it is copied
            stacked = cls.stacked(pairs, n, inter) if cls is Int4Experts else cls.stacked(pairs, n, inter, act)
            if stacked is not None:
                return stacked
            first = expert(0)
            break
    pairs = [first, *(expert(e) for e in range(1, n))]
    return LoopExperts([g for g, _ in pairs], [d for _, d in pairs])


def compilable(model: nn.Module) -> bool:
    """No block of the model needs eager Python (the compiled CPU step and CUDA graphs can hold it);
    Int8wExperts' op has no export support (no package is built for it)."""
    return not any(isinstance(m, (LoopExperts, Int8wExperts)) for m in model.modules())
