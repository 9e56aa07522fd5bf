"""A captured decode step: the whole model (all layers, attention over the paged cache, greedy
head) exported once and compiled ahead of time by AOTInductor into a C++ package.

Why: at batch 1 the eager step is ~300 small aten calls per token plus Python; on 2 cores that
overhead is as large as the matmuls. One compiled graph fuses the elementwise work (norms, RoPE,
residuals, SiLU, the cache writes and the attention reductions) into a few C++ loops around the
int4 matmul kernels, and AOTInductor's C++ wrapper leaves no Python per kernel call (see
BENCHMARKS.md, "Where the time goes").

The step is a pure function of tensors: token ids [B], positions [B], the gather table [B, L]
(cache slot of every context position) and the per-layer caches, which it updates in place.
L and the cache size are dynamic; batch 1 has its own package and batches of 2..max_batch() share
one with a dynamic B. A package is built on first use (export + compile: ~40-60 s on 2 cores) into
~/.cache/localllm/aoti, keyed by the model's weights, the code, torch and the thread count;
later processes load it in ~10 ms. The package holds no weights: it runs on the model's
own tensors, so a process keeps one copy of them. Opt-in: `localllm run --compile`, or
LOCALLLM_COMPILE=1 for every front end.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from .layers import Int4Linear

log = logging.getLogger(__name__)


def max_batch(model) -> int:
    """The largest decode batch a package takes; larger ones run eagerly. Int4 layers with fp32
    prefill copies switch to those at `dense_min_rows` rows (32 with torch's int4 kernel, 160 with
    ours), a branch an exported graph cannot hold for a dynamic batch."""
    rows = [m.dense_min_rows for m in model.modules() if isinstance(m, Int4Linear) and m.dense is not None]
    return min(rows, default=257) - 1


def cache_dir() -> Path:
    home = os.environ.get("LOCALLLM_HOME")
    base = Path(home) if home else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "localllm"
    return base / "aoti"


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


class _Step(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.m = model

    def forward(self, ids, positions, gather, *caches):
        kv = [(caches[i], caches[i + 1]) for i in range(0, len(caches), 2)]
        return decode_step(self.m, ids, positions, gather, kv, True)


def _code_digest() -> str:
    """The sources whose math a package bakes in: a change to them invalidates every package."""
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in ("compiled.py", "llama.py", "layers.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def package_path(model, kind: str) -> Path | None:
    """Where the package for this model and batch kind lives; None when the model has no
    fingerprint of its weights (then nothing is cached between processes)."""
    fp = getattr(model, "fingerprint", None)
    if not fp:
        return None
    key = "|".join((fp, kind, _code_digest(), torch.__version__, str(torch.get_num_threads())))
    return cache_dir() / f"decode-{kind}-{fp[:12]}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.pt2"


def build_package(model, kind: str, example: tuple, out: Path) -> None:
    """Export decode_step on example inputs and compile it into `out` (atomically)."""
    from torch.export import Dim

    ids, positions, gather, caches = example
    L = Dim("L", min=2, max=model.rope.cos.shape[0])
    nb = Dim("num_blocks", min=2)
    batch = {0: Dim("B", min=2, max=max_batch(model))} if kind == "bn" else None
    shapes = {"ids": batch, "positions": batch, "gather": {**(batch or {}), 1: L},
              "caches": tuple({0: nb} for _ in caches)}
    with torch.inference_mode():
        ep = torch.export.export(_Step(model), (ids, positions, gather, *caches), dynamic_shapes=shapes,
                                 strict=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.stem}.{os.getpid()}.tmp.pt2")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    try:
        scalars = _compile_without_weights(ep, model, tmp, 1 if kind == "b1" else 2)
        if scalars is None:  # fall back to a package that carries its own copy of the weights
            torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp))
        else:
            out.with_suffix(".json").write_text(json.dumps({"scalars": scalars}))
        os.replace(tmp, out)
        # other versions for the same weights (older code or torch, other thread counts) are stale
        prefix = out.name.rsplit("-", 1)[0]
        for old in out.parent.glob(f"{prefix}-*"):
            if old.stem != out.stem and ".tmp." not in old.name:
                old.unlink(missing_ok=True)
    finally:
        tmp.unlink(missing_ok=True)


def _compile_without_weights(ep, model, path: Path, batch: int) -> dict[str, int] | None:
    """Compile a package that holds no weights. Besides the model's tensors it then needs the
    constants Inductor creates itself: one 0-d int64 group size per int4 matmul (the C shim takes
    it as a tensor), numbered in graph order. Returns them by name once a test step matches the
    eager step (`_same_as_eager`), else None."""
    int4 = torch.ops.aten._weight_int4pack_mm_for_cpu.default
    groups = [n.args[2] for n in ep.graph.nodes if n.target is int4]
    torch._inductor.aoti_compile_and_package(
        ep, package_path=str(path), inductor_configs={"aot_inductor.package_constants_in_so": False})
    names = set(_tensors(model))
    fqns = _Package(path).get_constant_fqns()
    missing = sorted((n for n in fqns if n not in names), key=lambda n: int(n.removeprefix("constant") or -1))
    if len(missing) != len(groups) or not all(n.startswith("constant") for n in missing):
        return None
    scalars = dict(zip(missing, groups))
    return scalars if _same_as_eager(model, path, scalars, batch) else None


def _same_as_eager(model, path: Path, scalars: dict[str, int], batch: int) -> bool:
    """One decode step of the package (`batch` copies of one sequence) against decode_step
    itself, after 12 eager steps have filled a small cache with real keys and values."""
    cfg, n = model.cfg, 12
    caches = [torch.zeros(2, 16, cfg.num_kv_heads, cfg.head_dim, dtype=model.act_dtype)
              for _ in range(2 * cfg.num_layers)]
    kv = list(zip(caches[::2], caches[1::2]))
    gather = torch.arange(16, 32).view(1, -1)
    tokens = (torch.arange(n + 1) * 7919 + 3) % cfg.vocab_size
    with torch.inference_mode():
        for p in range(n):
            decode_step(model, tokens[p:p + 1], torch.tensor([p]), gather, kv, False)
        args = (tokens[n:n + 1].repeat(batch), torch.tensor([n] * batch), gather.repeat(batch, 1))
        ref, _ = decode_step(model, *args, [(k.clone(), v.clone()) for k, v in kv], False)
        hidden, _ = _load(model, path, scalars)(*args, *caches)
    # bf16 matmul inputs rounded at other points of a fused graph differ by ~5e-3 over 30 layers;
    # a wrong group size gives O(1)
    return bool(((hidden - ref).norm() / ref.norm()) < 3e-2)


def _tensors(model) -> dict[str, torch.Tensor]:
    step = _Step(model)
    return dict(step.named_parameters()) | dict(step.named_buffers())


def load_package(model, path: Path):
    sidecar = path.with_suffix(".json")
    return _load(model, path, json.loads(sidecar.read_text())["scalars"] if sidecar.is_file() else None)


class _Package:
    """An AOTI package run through torch's C++ loader directly, with flat tensor lists: going
    through torch._inductor.aoti_load_package imports Inductor's Python package (~1.5 s of every
    load) and its wrapper re-parses the call spec on every call."""

    def __init__(self, path: Path):
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)

    def get_constant_fqns(self) -> list[str]:
        return self.loader.get_constant_fqns()

    def load_constants(self, tensors: dict[str, torch.Tensor], check_full_update: bool, user_managed: bool) -> None:
        self.loader.load_constants(tensors, False, check_full_update, user_managed)

    def __call__(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        return self.loader.boxed_run(list(tensors))


def _load(model, path: Path, scalars: dict[str, int] | None):
    runner = _Package(path)
    tensors = _tensors(model)
    if scalars is not None:  # a package without weights: it runs on the model's own tensors
        tensors.update({name: torch.tensor(v, dtype=torch.int64) for name, v in scalars.items()})
        runner.load_constants({k: tensors[k] for k in runner.get_constant_fqns()}, True, True)
    else:  # its packaged weights are replaced by the model's where they match
        runner.load_constants({k: tensors[k] for k in runner.get_constant_fqns() if k in tensors}, False, True)
    return runner


class CompiledDecode:
    """Callable used by ModelRunner for decode-only steps: -> (hidden, greedy tokens). Returns
    None when it cannot serve a call (a build or load failed): the runner then runs eagerly."""

    def __init__(self, model):
        self.model = model
        self.failed: str | None = None
        self.calls = 0  # steps served by a package
        self._runners: dict[str, object] = {}
        self.max_batch = max_batch(model)

    def _runner(self, kind: str, example: tuple):
        if kind not in self._runners:
            path = package_path(self.model, kind)
            if path is None:  # nothing to key a cache on: build for this process only
                path = cache_dir() / f"decode-{kind}-{os.getpid()}-{id(self.model)}.pt2"
            if not path.is_file():
                # shown: the first use stalls for about a minute
                log.warning("compiling the decode step (%s; once per model, about a minute) into %s", kind, path)
                build_package(self.model, kind, example, path)
            self._runners[kind] = load_package(self.model, path)
        return self._runners[kind]

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, gather: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        if self.failed or gather.shape[1] < 2 or ids.shape[0] > self.max_batch:
            return None
        caches = [t for kv in kv_caches for t in kv]
        kind = "b1" if ids.shape[0] == 1 else "bn"
        try:
            out = self._runner(kind, (ids, positions, gather, caches))(ids, positions, gather, *caches)
        except Exception as e:  # a compiler problem must not take the engine down
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("compiled decode disabled, using eager: %s", self.failed)
            return None
        self.calls += 1
        return out[0], out[1]


def enable(model) -> CompiledDecode | None:
    """Attach a compiled decode step to `model` (CPU only; the CUDA path has its own kernels)."""
    if model.device != "cpu":
        return None
    model.compiled = CompiledDecode(model)
    return model.compiled


def disable(model) -> None:
    model.compiled = None
