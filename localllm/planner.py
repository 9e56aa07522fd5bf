"""What precision and context fit on this machine, decided before anything is loaded or downloaded.

`plan(model facts, device facts, request) -> Plan` is a pure function (unit-tested with a table);
`plan_for(MODEL, ...)` gathers the facts (config.json / GGUF metadata / the registry's `params` +
a table of known shapes) and calls it. The order tried for `--quant auto`:

  full precision (CPU: float32 then bfloat16; GPU: bfloat16)
  -> the registry's pre-quantized AWQ, then GPTQ variant
  -> quantize on load: int8 (CPU only), then int4 RTN, with a warning
  -> fail: "needs >= X GiB (weights Y + KV Z at ctx N + runtime R); only W available".

A GGUF file or an AWQ/GPTQ directory is loaded as it is (its own bits). Memory needed = weights as
the loader holds them (on CPU the embedding/head stay fp32, int4/int8 add a small int4 copy of the
head for greedy) + KV cache for the context + a runtime margin (activations of a full prefill
chunk, logits, allocator slack).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from .config import KV_TYPE_BYTES, ModelConfig, kv_blocks, kv_tokens

GiB = 1 << 30
DEFAULT_CTX = 4096  # without --ctx: the context a plan must at least fit (then it grows to what fits)
PREFILL_TOKENS = 2048  # EngineConfig.max_num_batched_tokens: activations of one prefill chunk
BLOCK = 16  # EngineConfig.block_size: KV is allocated in blocks of this many tokens
QUANT_ALIASES = {
    "auto": "auto", "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "f16": "float16",
    "float16": "float16", "half": "float16", "fp32": "float32", "f32": "float32", "float32": "float32",
    "int8": "int8", "q8": "int8", "int4": "int4", "q4": "int4", "rtn": "int4", "awq": "awq", "gptq": "gptq",
}

# Shapes of the registry's models, so a plan needs no download: (layers, hidden, intermediate,
# heads, kv_heads, head_dim, vocab, tied). test_planner checks them against models.toml `params`.
KNOWN_SHAPES = {
    "huggingfacetb/smollm2-135m-instruct": (30, 576, 1536, 9, 3, 64, 49152, True),
    "huggingfacetb/smollm2-360m-instruct": (32, 960, 2560, 15, 5, 64, 49152, True),
    "huggingfacetb/smollm2-1.7b-instruct": (24, 2048, 8192, 32, 32, 64, 49152, True),
    "qwen/qwen2.5-0.5b-instruct": (24, 896, 4864, 14, 2, 64, 151936, True),
    "qwen/qwen2.5-1.5b-instruct": (28, 1536, 8960, 12, 2, 128, 151936, True),
    "qwen/qwen2.5-7b-instruct": (28, 3584, 18944, 28, 4, 128, 152064, False),
    "qwen/qwen2.5-coder-0.5b": (24, 896, 4864, 14, 2, 64, 151936, True),
    "qwen/qwen2.5-coder-1.5b": (28, 1536, 8960, 12, 2, 128, 151936, True),
    "qwen/qwen2.5-coder-3b": (36, 2048, 11008, 16, 2, 128, 151936, True),
    "qwen/qwen2.5-coder-7b": (28, 3584, 18944, 28, 4, 128, 152064, False),
    "meta-llama/llama-3.2-1b-instruct": (16, 2048, 8192, 32, 8, 64, 128256, True),
    "meta-llama/llama-3.2-3b-instruct": (28, 3072, 8192, 24, 8, 128, 128256, True),
    "meta-llama/llama-3.1-8b-instruct": (32, 4096, 14336, 32, 8, 128, 128256, False),
    "mistralai/mistral-7b-instruct-v0.3": (32, 4096, 14336, 32, 8, 128, 32768, False),
    "qwen/qwen3-0.6b": (28, 1024, 3072, 16, 8, 128, 151936, True),
    "qwen/qwen3-1.7b": (28, 2048, 6144, 16, 8, 128, 151936, True),
    "qwen/qwen3-4b": (36, 2560, 9728, 32, 8, 128, 151936, True),
    "qwen/qwen3-8b": (36, 4096, 12288, 32, 8, 128, 151936, False),
    "microsoft/phi-3-mini-4k-instruct": (32, 3072, 8192, 32, 32, 96, 32064, False),
    "microsoft/phi-3.5-mini-instruct": (32, 3072, 8192, 32, 32, 96, 32064, False),
    "microsoft/phi-4-mini-instruct": (32, 3072, 8192, 24, 8, 128, 200064, True),
    # mixture of experts: + (experts, experts per token, expert width), every layer sparse
    "mistralai/mixtral-8x7b-instruct-v0.1": (32, 4096, 14336, 32, 8, 128, 32000, False, 8, 2, 14336),
    "qwen/qwen3-30b-a3b": (48, 2048, 6144, 32, 4, 128, 151936, False, 128, 8, 768),
    "qwen/qwen3-coder-30b-a3b-instruct": (48, 2048, 6144, 32, 4, 128, 151936, False, 128, 8, 768),
    "google/gemma-2-2b-it": (26, 2304, 9216, 8, 4, 256, 256000, True),
    "google/gemma-2-9b-it": (42, 3584, 14336, 16, 8, 256, 256000, True),
    "google/gemma-3-270m-it": (18, 640, 2048, 4, 1, 256, 262144, True),
    "google/gemma-3-1b-it": (26, 1152, 6912, 4, 1, 256, 262144, True),
    "google/gemma-3-4b-it": (34, 2560, 10240, 8, 4, 256, 262208, True),
    "google/gemma-3-12b-it": (48, 3840, 15360, 16, 8, 256, 262208, True),
    "google/gemma-3-27b-it": (62, 5376, 21504, 32, 16, 128, 262208, True),
}


def shape_config(shape: tuple, context: int | None = None) -> ModelConfig:
    """The config of a KNOWN_SHAPES entry (its MoE fields, when it has them)."""
    L, h, inter, heads, kvh, hd, vocab, tied, *moe = shape
    extra = {}
    if moe:
        n, k, width = moe
        extra = dict(num_experts=n, num_experts_per_tok=k, moe_intermediate_size=width, moe_layers=(True,) * L)
    return ModelConfig(vocab, h, inter, L, heads, kvh, hd, max_position_embeddings=context or 4096,
                       tie_word_embeddings=tied, **extra)


class PlanError(RuntimeError):
    """The model does not fit (or the request cannot be planned); the message says why."""


@dataclass
class ModelFacts:
    name: str
    params: int
    linear_params: int  # parameters in the decoder's linears: what int8/int4 shrink
    kv_bytes_per_token: int  # at 2 bytes per element
    max_context: int
    hidden: int = 0
    intermediate: int = 0
    vocab: int = 0
    native: str | None = None  # "gguf" | "awq" | "gptq": already quantized, loaded as is
    native_bytes: dict[str, int] = field(default_factory=dict)  # device kind ("cpu"/"cuda") -> bytes
    variants: dict[str, str] = field(default_factory=dict)  # "awq"/"gptq" -> hub repo
    estimated: bool = False  # shapes guessed from the parameter count
    stored16: str = ""  # "bf16" / "fp16": an HF checkpoint whose linears are stored in 16 bits

    @classmethod
    def from_config(cls, name: str, cfg: ModelConfig, **kw) -> ModelFacts:
        h = cfg.hidden_size
        return cls(name=name, params=cfg.num_params, linear_params=cfg.linear_params,
                   kv_bytes_per_token=cfg.kv_bytes_per_token(2), max_context=cfg.max_position_embeddings,
                   hidden=h, intermediate=cfg.intermediate_size, vocab=cfg.vocab_size, **kw)


@dataclass
class DeviceFacts:
    device: str  # "cpu" | "cuda" | "cuda:N"
    available: int  # bytes free for weights + KV + activations


@dataclass
class Plan:
    model: str
    device: str
    precision: str  # what load_model gets: auto | float32 | bfloat16 | float16 | int8 | int4
    variant: str | None  # hub repo to load instead of the model (pre-quantized AWQ/GPTQ)
    ctx: int
    fits: bool
    reason: str
    weights_bytes: int
    kv_bytes: int
    overhead_bytes: int
    available_bytes: int
    label: str = ""  # human name of the choice ("bfloat16", "AWQ variant", "int4 (RTN on load)")
    warnings: list[str] = field(default_factory=list)
    estimated: bool = False
    kv_type: str = ""  # the KV cache's element type (--kv-type, or what auto gives: kv_type_for)

    @property
    def needed_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.overhead_bytes

    def describe(self) -> str:
        if not self.fits:
            return f"plan: does not fit - {self.reason}"
        lines = [f"plan: {self.label} on {self.device}, ctx {self.ctx}" +
                 (f" (load {self.variant})" if self.variant else ""),
                 f"  memory: weights {gib(self.weights_bytes)} + KV {gib(self.kv_bytes)}"
                 + (f" ({self.kv_type})" if self.kv_type else "") + " + runtime "
                 f"{gib(self.overhead_bytes)} = {gib(self.needed_bytes)} of {gib(self.available_bytes)} available",
                 f"  why: {self.reason}"]
        lines += [f"  warning: {w}" for w in self.warnings]
        if self.estimated:
            lines.append("  note: shapes estimated from the parameter count (not downloaded yet)")
        return "\n".join(lines)

    explain = describe  # the name `show` looks for


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def normalize_quant(quant: str | None) -> str:
    q = QUANT_ALIASES.get((quant or "auto").lower())
    if q is None:
        raise ValueError(f"--quant must be one of auto, bf16, fp16, fp32, int8, int4, awq, gptq; got {quant!r}")
    return q


# ---- the memory model -------------------------------------------------------------------------
def weight_bytes(f: ModelFacts, precision: str, device: str) -> int:
    """Bytes the loaded weights take (as localllm/model/loader.py builds them)."""
    cpu = device == "cpu"
    if precision in ("auto", "native") and f.native:
        return f.native_bytes.get("cpu" if cpu else "cuda", 0)
    if precision == "auto" and f.stored16 and cpu:  # the loader's "w16": linears as stored
        precision = "w16"
    other = f.params - f.linear_params  # embedding, untied head, norms: fp32 on CPU
    other_b = other * (4 if cpu else 2)
    fast_head = int(f.vocab * f.hidden * (0.5 + 4 / 32)) if cpu else 0  # int4 copy for greedy
    if precision == "float32":
        return f.params * 4
    if precision in ("bfloat16", "float16"):
        return f.linear_params * 2 + other_b
    if precision == "w16":  # 16-bit linears on our kernel, the exact fp32 embedding, the head's int4 copy
        return f.linear_params * 2 + other_b + fast_head
    if precision == "int8":
        per = 1.0 if cpu else 2.0  # no GPU int8 kernel: the loader keeps the layer dense
        return int(f.linear_params * per) + other_b + fast_head
    group = 128 if precision in ("awq", "gptq", "auto") else 64  # int4 on load: 64 when K % 128 != 0
    return int(f.linear_params * (0.5 + 4 / group)) + other_b + fast_head


def kv_type_for(precision: str, device: str, kv_type: str = "auto") -> str:
    """The KV cache type the engine will hold: --kv-type, or for auto the loader's choice (a 16-bit
    cache, fp32 on CPU for float32 weights, bf16 for bf16 activations)."""
    if kv_type != "auto":
        if kv_type not in KV_TYPE_BYTES:
            raise ValueError(f"unknown KV cache type {kv_type!r}; choose from auto, {', '.join(KV_TYPE_BYTES)}")
        return kv_type
    if device == "cpu":
        return {"float32": "f32", "bfloat16": "bf16"}.get(precision, "f16")
    return "bf16" if precision == "bfloat16" else "f16"


def _kv_per_token(f: ModelFacts, precision: str, device: str, kv_type: str = "auto") -> int:
    return round(f.kv_bytes_per_token / 2 * KV_TYPE_BYTES[kv_type_for(precision, device, kv_type)])


def kv_bytes(f: ModelFacts, precision: str, device: str, ctx: int, kv_type: str = "auto") -> int:
    """What the engine allocates for one `ctx`-token context: whole blocks and the null block."""
    return _kv_per_token(f, precision, device, kv_type) * BLOCK * kv_blocks(ctx, BLOCK)


def overhead_bytes(f: ModelFacts) -> int:
    if f.hidden:
        act = PREFILL_TOKENS * (4 * f.hidden + 3 * f.intermediate) * 4 + 64 * f.vocab * 4
    else:
        act = f.params // 25
    return 256 * (1 << 20) + act


# ---- the decision -----------------------------------------------------------------------------
def _candidates(f: ModelFacts, quant: str, device: str) -> list[tuple[str, str | None, str, str | None]]:
    """(precision, variant repo, label, warning) in order of preference."""
    if f.native:
        if quant in ("auto", f.native) or (f.native == "gguf" and quant == "int4"):
            return [("auto" if f.native == "gguf" else "int4", None, f"{f.native.upper()} as stored", None)]
        if quant in ("awq", "gptq"):
            raise PlanError(f"{f.name} is a {f.native.upper()} checkpoint; --quant {quant} needs a float model "
                            "with a registry variant")
    warn8 = "quantizing on load to int8 (weight-only, per-channel): quality close to bf16"
    warn4 = ("quantizing on load to int4 (round-to-nearest): lower quality than an AWQ/GPTQ checkpoint "
             "(`localllm quantize` makes one)")
    full = {"float32": ("float32", None, "float32", None), "bfloat16": ("bfloat16", None, "bfloat16", None),
            "float16": ("float16", None, "float16", None), "int8": ("int8", None, "int8 (on load)", warn8),
            "int4": ("int4", None, "int4 (RTN on load)", warn4)}
    variants = [("int4", f.variants[k], f"{k.upper()} variant", None) for k in ("awq", "gptq") if f.variants.get(k)]
    if quant in ("awq", "gptq"):
        v = [c for c in variants if c[2].startswith(quant.upper())]
        if not v:
            raise PlanError(f"{f.name} has no {quant.upper()} variant in models.toml "
                            f"(use --quant int4 to quantize on load, or `localllm quantize`)")
        return v
    if quant != "auto":
        return [full[quant]]
    if device == "cpu" and f.stored16:  # its own 16-bit values, fp32 math: as precise as an fp32 copy
        w16 = ("auto", None, f"16-bit weights ({f.stored16} as stored, our kernel), fp32 activations", None)
        return [w16, *variants, full["int8"], full["int4"]]
    if device == "cpu":
        return [full["float32"], full["bfloat16"], *variants, full["int8"], full["int4"]]
    return [full["bfloat16"], *variants, full["int4"]]  # int8 has no GPU kernel here


def plan(f: ModelFacts, dev: DeviceFacts, quant: str = "auto", ctx: int | None = None,
         max_memory: int | None = None, kv_memory: int | None = None, kv_type: str = "auto") -> Plan:
    """The first candidate whose weights + KV(ctx) + runtime fit the budget. `max_memory` (bytes)
    replaces 90% of the device's free memory as the budget. Without `ctx` the plan must fit
    min(DEFAULT_CTX, model context) and then takes the largest context that fits. `kv_memory`
    (bytes, --kv-memory) is what the engine will allocate for KV whatever the context: the plan
    counts exactly that, and the context is what it holds (at most the model's). `kv_type`
    (--kv-type) is the KV cache's element type; its bytes per token are what the plan counts."""
    quant = normalize_quant(quant)
    if kv_memory:
        return _plan_fixed_kv(f, dev, quant, ctx, max_memory, kv_memory, kv_type)
    kind = "cpu" if dev.device == "cpu" else "cuda"
    budget = int(max_memory) if max_memory else int(dev.available * 0.9)
    if ctx is not None and ctx < 1:
        raise PlanError(f"--ctx must be positive, got {ctx}")
    floor = min(ctx, f.max_context) if ctx else min(DEFAULT_CTX, f.max_context)
    over = overhead_bytes(f)
    cands = _candidates(f, quant, kind)
    rejected = []
    for precision, variant, label, warning in cands:
        w = weight_bytes(f, "native" if f.native and precision in ("auto", "int4") else
                         (variant and "awq") or precision, kind)
        kv_tok = _kv_per_token(f, precision, kind, kv_type)
        if w + kv_bytes(f, precision, kind, floor, kv_type) + over <= budget:
            n = floor if ctx else max(floor, min(f.max_context, (budget - w - over) // kv_tok // 256 * 256))
            while n > floor and w + kv_bytes(f, precision, kind, n, kv_type) + over > budget:
                n = max(floor, n - 256)
            why = f"{label} fits with ctx {n}"
            if rejected:
                why += f" ({'; '.join(rejected)})"
            elif quant == "auto":
                why += " (the most precise option)"
            if ctx and ctx > f.max_context:
                why += f"; --ctx {ctx} capped at the model's {f.max_context}"
            return Plan(f.name, dev.device, precision, variant, n, True, why, w, kv_bytes(f, precision, kind, n, kv_type),
                        over, budget, label, [warning] if warning else [], f.estimated,
                        kv_type_for(precision, kind, kv_type))
        rejected.append(f"{label} needs {gib(w + kv_bytes(f, precision, kind, floor, kv_type) + over)}")
    precision, variant, label, _ = cands[-1]
    w = weight_bytes(f, "native" if f.native and precision in ("auto", "int4") else (variant and "awq") or precision,
                     kind)
    kv = kv_bytes(f, precision, kind, floor, kv_type)
    where = "--max-memory" if max_memory else f"free {'RAM' if kind == 'cpu' else 'GPU memory'} x 0.9"
    msg = (f"{f.name} needs >= {(w + kv + over) / GiB:.2f} GiB (weights {gib(w)} as {label} + KV {gib(kv)} at ctx "
           f"{floor} + runtime {gib(over)}); only {gib(budget)} available ({where})")
    return Plan(f.name, dev.device, precision, variant, floor, False, msg, w, kv, over, budget, label, [],
                f.estimated, kv_type_for(precision, kind, kv_type))


def _plan_fixed_kv(f: ModelFacts, dev: DeviceFacts, quant: str, ctx: int | None, max_memory: int | None,
                   kv_memory: int, kv_type: str = "auto") -> Plan:
    kind = "cpu" if dev.device == "cpu" else "cuda"
    budget = int(max_memory) if max_memory else int(dev.available * 0.9)
    if ctx is not None and ctx < 1:
        raise PlanError(f"--ctx must be positive, got {ctx}")
    over = overhead_bytes(f)
    cands = _candidates(f, quant, kind)
    rejected = []
    where = "--max-memory" if max_memory else f"free {'RAM' if kind == 'cpu' else 'GPU memory'} x 0.9"
    for i, (precision, variant, label, warning) in enumerate(cands):
        w = weight_bytes(f, "native" if f.native and precision in ("auto", "int4") else
                         (variant and "awq") or precision, kind)
        holds = kv_tokens(kv_memory // (_kv_per_token(f, precision, kind, kv_type) * BLOCK), BLOCK)
        n = min(ctx or f.max_context, f.max_context, max(holds, 0))
        if holds < (min(ctx, f.max_context) if ctx else 1):
            what = f"one {min(ctx, f.max_context)}-token context (--ctx)" if ctx else "one KV block"
            return Plan(f.name, dev.device, precision, variant, n, False,
                        f"--kv-memory {gib(kv_memory)} holds {max(holds, 0)} tokens, less than {what}; raise it"
                        + (" or lower --ctx" if ctx else ""), w, kv_memory, over, budget, label, [], f.estimated,
                        kv_type_for(precision, kind, kv_type))
        if w + kv_memory + over <= budget or i == len(cands) - 1:
            fits = w + kv_memory + over <= budget
            why = (f"{label} with the KV cache --kv-memory asks for (ctx {n})" if fits else
                   f"{f.name} needs >= {(w + kv_memory + over) / GiB:.2f} GiB (weights {gib(w)} as {label} + KV "
                   f"{gib(kv_memory)} from --kv-memory + runtime {gib(over)}); only {gib(budget)} available ({where})")
            if fits and rejected:
                why += f" ({'; '.join(rejected)})"
            return Plan(f.name, dev.device, precision, variant, n, fits, why, w, kv_memory, over, budget, label,
                        [warning] if warning and fits else [], f.estimated, kv_type_for(precision, kind, kv_type))
        rejected.append(f"{label} needs {gib(w + kv_memory + over)}")
    raise AssertionError("unreachable: the last candidate always returns")


# ---- facts ------------------------------------------------------------------------------------
def _estimated_facts(name: str, params: int, context: int | None) -> ModelFacts:
    """No config: a Llama-like shape from the parameter count, KV without GQA (conservative)."""
    layers = max(1, round((params / 196608) ** (1 / 3)))  # params ~ 12 L h^2 with h ~ 128 L
    hidden = 128 * layers
    return ModelFacts(name, params, int(params * 0.85), 2 * layers * hidden * 2, context or 4096, estimated=True)


def _native_bytes(weights) -> dict[str, int]:
    """Weights of a GGUF / AWQ / GPTQ checkpoint as the loader holds them, per device kind."""
    from .model import gguf_blocks
    from .model.gguf_weights import GGUFWeights

    cfg = weights.config
    out = {}
    for kind, other in (("cpu", 4), ("cuda", 2)):
        fast_head = int(cfg.vocab_size * cfg.hidden_size * (0.5 + 4 / 32)) if kind == "cpu" else 0
        total = fast_head
        if isinstance(weights, GGUFWeights):
            for name, t in weights.file.tensors.items():
                n = math.prod(t.shape)
                linear = name.startswith("blk.") and len(t.shape) == 2
                if kind == "cpu" and linear:  # each matrix on its type's kernel (see the loader)
                    total += int(n * gguf_blocks.cpu_bytes_per_value(t.qtype.name))
                elif kind == "cpu" and t.qtype.name == "Q8_0":  # the embedding / head read in place
                    total += t.nbytes
                else:
                    total += int(n * (0.5 + 4 / 32)) if linear and t.qtype.name in ("Q4_0", "Q4_1") else n * other
        else:
            f = ModelFacts.from_config("", cfg)
            g = weights.quant.get("group_size", 128)
            g = min(g if g > 0 else 128, 128)
            total += int(f.linear_params * (0.5 + 4 / g)) + (f.params - f.linear_params) * other
        out[kind] = total
    return out


def facts_for_path(path: str | Path, name: str | None = None, variants: dict | None = None) -> ModelFacts:
    from .model.gguf_weights import GGUFWeights
    from .model.weights import open_weights

    w = open_weights(path)  # headers and metadata only
    native = "gguf" if isinstance(w, GGUFWeights) else (w.quant["quant_method"] if w.quant else None)
    f = ModelFacts.from_config(name or str(path), w.config, native=native, variants=dict(variants or {}))
    if not native:
        import torch

        from .model import w16

        first = "model.layers.0." + w.config.checkpoint_linears()["gate_up"][0] + ".weight"
        f.stored16 = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(w16.stored_dtype(w, first), "")
    if native:
        f.native_bytes = _native_bytes(w)
    return f


def facts_for(model) -> ModelFacts:
    """MODEL argument (alias, repo, path, ModelRef, Path) -> facts, without downloading anything."""
    from .registry import ModelRef, resolve_model

    ref = model if isinstance(model, ModelRef) else resolve_model(str(model) if isinstance(model, Path) else model)
    spec = ref.spec
    variants = {k: getattr(spec, k) for k in ("awq", "gptq") if spec is not None and getattr(spec, k)}
    if ref.local_path is not None:
        return facts_for_path(ref.local_path, ref.name, variants)
    from .hub import cached_snapshot

    snap = cached_snapshot(ref.repo, ref.revision) if ref.repo else None
    if snap is not None and (snap / "config.json").is_file():
        return facts_for_path(snap, ref.name, variants)
    shape = KNOWN_SHAPES.get((ref.repo or "").lower())
    context = spec.context if spec else None
    if shape is not None:
        f = ModelFacts.from_config(ref.name, shape_config(shape, context), variants=variants)
        if spec is not None and spec.params:
            f.params = spec.params
        return f
    if spec is None or not spec.params:
        raise PlanError(f"{ref.name} is not downloaded and its size is unknown: `localllm pull {ref.name}` first")
    f = _estimated_facts(ref.name, spec.params, context)
    f.variants = variants
    return f


def device_facts(device: str = "auto") -> DeviceFacts:
    from .hardware import available_memory, pick_device

    dev = pick_device(device)
    return DeviceFacts(dev, available_memory(dev))


def plan_for(model=None, quant: str = "auto", max_memory: float | None = None, ctx: int | None = None,
             device: str = "auto", kv_memory: int | None = None, kv_type: str = "auto") -> Plan:
    """The plan for a MODEL argument (alias, repo, directory, .gguf, Path or ModelRef) on this
    machine; `max_memory` in GiB, `kv_memory` in bytes. Reads metadata only: nothing is loaded
    or downloaded."""
    return plan(facts_for(model), device_facts(device), quant, ctx,
                int(max_memory * GiB) if max_memory else None, kv_memory, kv_type)
