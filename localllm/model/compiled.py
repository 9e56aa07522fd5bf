"""A captured decode step: the whole model (all layers, attention over the paged cache, greedy
head) as one `torch.compile` graph.

Why: at batch 1 the eager step is ~300 small aten calls per token plus Python; on 2 cores that
overhead is as large as the matmuls. One graph fuses the elementwise work (norms, RoPE,
residuals, SiLU, the cache writes and the attention reductions) into a few C++ loops around the
int4 matmul kernels (see BENCHMARKS.md, "Where the time goes").

The step is a pure function of tensors: token ids [B], positions [B], the gather table [B, L]
(cache slot of every context position) and the per-layer caches. Nothing that changes between
steps is a Python int, so one graph serves every step: L and the cache size are dynamic, B is
one graph for B == 1 and one dynamic graph for B >= 2. The cold compile takes 30-80 s on 2
cores; Inductor's cache (under ~/.cache/localllm/inductor) makes later processes start in
seconds. Opt-in: `localllm run --compile`, or LOCALLLM_COMPILE=1 for every front end.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    home = os.environ.get("LOCALLLM_HOME")
    base = Path(home) if home else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "localllm"
    return base / "inductor"


def wanted() -> bool:
    """LOCALLLM_COMPILE=1 turns the compiled decode step on in every front end."""
    return os.environ.get("LOCALLLM_COMPILE", "").lower() in ("1", "true", "yes", "on")


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slots: torch.Tensor, gather: torch.Tensor, valid: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One query per sequence, written as pointwise ops and reductions: Inductor fuses the
    gather through the block table, the dot products and the softmax into a few loops instead
    of materializing K/V (faster than SDPA on gathered K/V, most of all at long context)."""
    B, H, D = q.shape
    kvh = k.shape[1]
    kc, vc = k_cache.view(-1, kvh, D), v_cache.view(-1, kvh, D)
    kc.index_copy_(0, slots, k.to(kc.dtype))
    vc.index_copy_(0, slots, v.to(vc.dtype))
    kk, vv = kc[gather], vc[gather]  # [B, L, KVH, D]
    qg = q.view(B, 1, kvh, H // kvh, D)
    s = (qg * kk.unsqueeze(3)).sum(-1) * scale  # [B, L, KVH, G]
    s = s.masked_fill(~valid.view(B, -1, 1, 1), float("-inf"))
    p = torch.softmax(s, dim=1)
    out = (p.unsqueeze(-1) * vv.unsqueeze(3)).sum(1)  # [B, KVH, G, D]
    return out.reshape(B, H * D).to(q.dtype)


def decode_step(model, ids: torch.Tensor, positions: torch.Tensor, gather: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], greedy: bool):
    """-> (final hidden [B, hidden], greedy tokens [B] or None). The same math as
    LlamaModel.forward for a decode-only batch (context of sequence b = positions[b] + 1)."""
    x = model.embed[ids].to(model.act_dtype)
    B = x.shape[0]
    L = gather.shape[1]
    valid = torch.arange(L, device=ids.device).unsqueeze(0) <= positions.unsqueeze(1)
    slots = gather.gather(1, positions.unsqueeze(1)).squeeze(1)
    rope, scale = model.rope, model.scale
    for layer, (kc, vc) in zip(model.layers, kv_caches):
        h = layer.input_norm(x)
        q, k, v = layer.qkv(h).split(layer.split, dim=-1)
        q, k = rope(positions, q.view(B, layer.H, layer.D), k.view(B, layer.KVH, layer.D))
        a = decode_attention(q, k, v.view(B, layer.KVH, layer.D), kc, vc, slots, gather, valid, scale)
        x = x + layer.o(a)
        g, u = layer.gate_up(layer.post_norm(x)).split(layer.inter, dim=-1)
        x = x + layer.down(F.silu(g) * u)
    hidden = model.norm(x)
    return hidden, (model.head.greedy(hidden) if greedy else None)


class CompiledDecode:
    """Callable used by ModelRunner for decode-only steps. Returns None when it cannot serve a
    call (compile failed): the runner then takes the eager path."""

    def __init__(self, model, greedy: bool = True, cpp_wrapper: bool | None = None):
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir()))
        self.model = model
        self.greedy = greedy
        self.failed: str | None = None
        self.calls = 0  # steps served by the graph
        self._marked: set[int] = set()
        opts = {}
        if cpp_wrapper if cpp_wrapper is not None else os.environ.get("LOCALLLM_COMPILE_CPP_WRAPPER") == "1":
            opts["cpp_wrapper"] = True  # no Python per kernel call, but a much longer cold compile
        self.fn = torch.compile(decode_step, fullgraph=True, dynamic=False, options=opts or None)

    def _mark(self, ids, positions, gather, kv_caches) -> None:
        # dynamic dims declared up front: otherwise the second step (one longer context)
        # recompiles the whole graph once more
        torch._dynamo.mark_dynamic(gather, 1)
        if ids.shape[0] > 1:
            for t in (ids, positions, gather):
                torch._dynamo.mark_dynamic(t, 0)
        if id(kv_caches) not in self._marked:  # each engine has its own cache size
            for kc, vc in kv_caches:
                torch._dynamo.mark_dynamic(kc, 0)
                torch._dynamo.mark_dynamic(vc, 0)
            self._marked.add(id(kv_caches))

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, gather: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        if self.failed or gather.shape[1] < 2:
            return None
        self._mark(ids, positions, gather, kv_caches)
        try:
            out = self.fn(self.model, ids, positions, gather, kv_caches, self.greedy)
            self.calls += 1
            return out
        except Exception as e:  # a compiler problem must not take the engine down
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("compiled decode disabled, using eager: %s", self.failed)
            return None


def enable(model, greedy: bool = True) -> CompiledDecode | None:
    """Attach a compiled decode step to `model` (CPU only; the CUDA path has its own kernels)."""
    if model.device != "cpu":
        return None
    model.compiled = CompiledDecode(model, greedy)
    return model.compiled


def disable(model) -> None:
    model.compiled = None
