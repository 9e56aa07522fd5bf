"""What precision and context fit on this machine, decided before anything is loaded or downloaded.

`plan(model facts, device facts, request) -> Plan` is a pure function (unit-tested with a table);
`plan_for(MODEL, ...)` gathers the facts (config.json / GGUF metadata / the registry's `params` +
a table of known shapes) and calls it. The order tried for `--quant auto`:

  full precision (CPU: float32 then bfloat16; GPU: bfloat16)
  -> the registry's pre-quantized AWQ, then GPTQ variant
  -> quantize on load: int8 (CPU only), then int4 RTN, with a warning
  -> fail: "needs >= X GiB (weights Y + KV Z at ctx N + runtime R); only W available".

A GGUF file or an AWQ/GPTQ directory is loaded as it is (its own bits). Memory needed = weights as
the loader holds them (on CPU a GGUF embedding/head as the file stores it, others fp32; int4/int8 add a small int4 copy of the
head for greedy) + KV cache for the context + a runtime margin (activations of a full prefill
chunk, logits, allocator slack).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
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
    "meta-llama/llama-3.1-70b-instruct": (80, 8192, 28672, 64, 8, 128, 128256, False),
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
    "qwen/qwen2.5-vl-3b-instruct": (36, 2048, 11008, 16, 2, 128, 151936, True),
    "qwen/qwen2.5-vl-7b-instruct": (28, 3584, 18944, 28, 4, 128, 152064, False),
    "qwen/qwen3-vl-2b-instruct": (28, 2048, 6144, 16, 8, 128, 151936, True),
    "qwen/qwen3-vl-4b-instruct": (36, 2560, 9728, 32, 8, 128, 151936, True),
    "qwen/qwen3-vl-8b-instruct": (36, 4096, 12288, 32, 8, 128, 151936, False),
    "huggingfacetb/smolvlm-256m-instruct": (30, 576, 1536, 9, 3, 64, 49280, False),
    "huggingfacetb/smolvlm-500m-instruct": (32, 960, 2560, 15, 5, 64, 49280, False),
    "huggingfacetb/smolvlm-instruct": (24, 2048, 8192, 32, 32, 64, 49155, False),
}


def _gpt_oss(layers: int, experts: int) -> dict:
    """openai/gpt-oss-20b / -120b's published config.json: the fields our config reads."""
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
            "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": layers, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": experts, "num_experts_per_tok": 4,
            "attention_bias": True, "sliding_window": 128, "max_position_embeddings": 131072,
            "layer_types": ["sliding_attention", "full_attention"] * (layers // 2), "rope_theta": 150000,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "original_max_position_embeddings": 4096, "truncate": False},
            "swiglu_limit": 7.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "quantization_config": {"quant_method": "mxfp4"}}


# Registry models whose shape a KNOWN_SHAPES tuple cannot hold (gpt-oss: biases, sinks, MXFP4
# experts as published): their config.json, as the hub serves it.
KNOWN_CONFIGS = {"openai/gpt-oss-20b": _gpt_oss(24, 32), "openai/gpt-oss-120b": _gpt_oss(36, 128)}


def known_facts(repo: str, name: str | None = None, context: int | None = None,
                variants: dict | None = None, vision_params: int = 0) -> ModelFacts | None:
    """The facts of a registry repo from KNOWN_SHAPES / KNOWN_CONFIGS (None: not among them): what
    the planner knows of a model before it is downloaded."""
    repo = repo.lower()
    if repo in KNOWN_CONFIGS:
        return config_facts(name or repo, KNOWN_CONFIGS[repo], context, variants, vision_params)
    if repo in KNOWN_SHAPES:
        return ModelFacts.from_config(name or repo, shape_config(KNOWN_SHAPES[repo], context),
                                      variants=dict(variants or {}), vision_params=vision_params)
    return None


def config_facts(name: str, hf: dict, context: int | None = None, variants: dict | None = None,
                 vision_params: int = 0) -> ModelFacts:
    """The facts of a checkpoint from its config.json alone (`hf`), as facts_for_path finds them
    from its files: one published with MXFP4 experts (gpt-oss) is counted as the loader holds it."""
    cfg = ModelConfig.from_hf(hf)
    if context:
        cfg = replace(cfg, max_position_embeddings=context)
    native = (hf.get("quantization_config") or {}).get("quant_method")
    if native not in (None, "mxfp4"):
        raise ValueError(f"{name}: a {native} checkpoint is sized from its files, not its config")
    return ModelFacts.from_config(name, cfg, native=native, variants=dict(variants or {}),
                                  native_bytes=_mxfp4_bytes(cfg) if native else {}, vision_params=vision_params)


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
    matrices16: int = 0  # parameters of its embedding and untied head stored in 16 bits (kept so on CPU)
    layers: int = 0  # what a tensor/pipeline split must divide (0: unknown, estimated shapes)
    heads: int = 0
    kv_heads: int = 0
    # the vision tower and projector (an HF checkpoint's, or the GGUF's mmproj): held in the
    # activation dtype, fp32 on CPU (Gemma 3's 0.42B SigLIP: 1.7 GB)
    vision_params: int = 0

    @classmethod
    def from_config(cls, name: str, cfg: ModelConfig, **kw) -> ModelFacts:
        h = cfg.hidden_size
        return cls(name=name, params=cfg.num_params, linear_params=cfg.linear_params,
                   kv_bytes_per_token=cfg.kv_bytes_per_token(2), max_context=cfg.max_position_embeddings,
                   hidden=h, intermediate=cfg.intermediate_size, vocab=cfg.vocab_size, layers=cfg.num_layers,
                   heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, **kw)


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
    vision_params: int = 0  # the vision tower's parameters (its bytes are part of weights_bytes)
    vision_bytes: int = 0

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
        if self.vision_params:
            lines.append(f"  vision tower: {self.vision_params / 1e6:.0f}M parameters, {gib(self.vision_bytes)} of the "
                         "weights (images in)")
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
    """Bytes the loaded weights take (as localllm/model/loader.py builds them), the vision tower's
    included."""
    return _text_weight_bytes(f, precision, device) + vision_bytes(f, precision, device)


def vision_bytes(f: ModelFacts, precision: str, device: str) -> int:
    """The vision tower as the loader holds it: in the activation dtype (loader._resolve_precision:
    fp32 on CPU but for --quant bf16/fp16; 16 bits on a GPU but for --quant float32)."""
    if device == "cpu":
        return f.vision_params * (2 if precision in ("bfloat16", "float16") else 4)
    return f.vision_params * (4 if precision == "float32" else 2)


def _text_weight_bytes(f: ModelFacts, precision: str, device: str) -> int:
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
    if precision == "w16":  # 16-bit linears, embedding and head on our kernel, the head's int4 copy
        return f.linear_params * 2 + f.matrices16 * 2 + (other - f.matrices16) * 4 + fast_head
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
    p = _plan(f, dev, normalize_quant(quant), ctx, max_memory, kv_memory, kv_type)
    p.vision_params = f.vision_params
    p.vision_bytes = vision_bytes(f, p.precision, "cpu" if dev.device == "cpu" else "cuda")
    return p


def _plan(f: ModelFacts, dev: DeviceFacts, quant: str, ctx: int | None, max_memory: int | None,
          kv_memory: int | None, kv_type: str) -> Plan:
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
    """Weights of a GGUF / AWQ / GPTQ / MXFP4 checkpoint as the loader holds them, per device kind."""
    from .model import gguf_blocks
    from .model.gguf_weights import GGUFWeights

    cfg = weights.config
    if not isinstance(weights, GGUFWeights) and weights.mxfp4:
        return _mxfp4_bytes(cfg)
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
                elif kind == "cpu" and (t.qtype.name in ("F16", "BF16") or gguf_blocks.supported(t.qtype.name)):
                    # the embedding / head as stored (the file's blocks read in place, 16 bits kept)
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


def _mxfp4_bytes(cfg: ModelConfig) -> dict[str, int]:
    """gpt-oss's published checkpoint as the loader holds it, per device kind: on CPU the experts'
    MXFP4 blocks on our kernel, the rest 16-bit as stored, and the head's int4 ranking copy; on a
    GPU 16 bits throughout."""
    from .model import gguf_blocks

    experts = sum(map(cfg.is_moe_layer, range(cfg.num_layers))) * cfg.num_experts * 3 * \
        cfg.hidden_size * cfg.moe_intermediate_size
    fast_head = int(cfg.vocab_size * cfg.hidden_size * (0.5 + 4 / 32))
    return {"cpu": fast_head + int(experts * gguf_blocks.cpu_bytes_per_value("MXFP4")) + (cfg.num_params - experts) * 2,
            "cuda": cfg.num_params * 2}


def _vision_params(w, path: str | Path, mmproj: str | Path | None) -> int:
    """The vision tower's parameters: an HF checkpoint's vision tensors, or the mmproj's of a GGUF
    (--mmproj, else the one beside it), from headers only."""
    from .model.gguf_weights import GGUFWeights

    if isinstance(w, GGUFWeights):
        from .model.vision.mmproj import Mmproj, find_mmproj

        mmproj = mmproj or find_mmproj(path)
        return Mmproj(mmproj).params() if mmproj else 0
    from safetensors import safe_open

    from .model.vision.load import vision_params

    def numel(name: str) -> int:
        with safe_open(str(w.index[name]), framework="pt") as h:
            return math.prod(h.get_slice(name).get_shape())
    return vision_params(w.raw_config, list(w.index), numel)


def facts_for_path(path: str | Path, name: str | None = None, variants: dict | None = None,
                   mmproj: str | Path | None = None) -> ModelFacts:
    """mmproj: a GGUF's vision tower file (--mmproj; default: the one beside it)."""
    from .model.gguf_weights import GGUFWeights
    from .model.weights import open_weights

    w = open_weights(path)  # headers and metadata only
    native = "gguf" if isinstance(w, GGUFWeights) else (w.quant["quant_method"] if w.quant else None)
    f = ModelFacts.from_config(name or str(path), w.config, native=native, variants=dict(variants or {}),
                               vision_params=_vision_params(w, path, mmproj))
    if not native:
        import torch

        from .model import w16

        first = "model.layers.0." + w.config.checkpoint_linears()["gate_up"][0] + ".weight"
        f.stored16 = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(w16.stored_dtype(w, first), "")
        if f.stored16:
            heads = () if w.config.tie_word_embeddings else ("lm_head.weight",)  # a tied head is the embedding
            tables = [n for n in ("model.embed_tokens.weight", *heads) if n in getattr(w, "index", {})]
            f.matrices16 = sum(w.config.vocab_size * w.config.hidden_size for n in tables
                               if w16.stored_dtype(w, n) in w16.DTYPES)
    if native:
        f.native_bytes = _native_bytes(w)
    return f


def facts_for(model, mmproj: str | Path | None = None) -> ModelFacts:
    """MODEL argument (alias, repo, path, ModelRef, Path) -> facts, without downloading anything;
    mmproj: --mmproj, for a GGUF."""
    from .registry import ModelRef, resolve_model

    ref = model if isinstance(model, ModelRef) else resolve_model(str(model) if isinstance(model, Path) else model)
    spec = ref.spec
    variants = {k: getattr(spec, k) for k in ("awq", "gptq") if spec is not None and getattr(spec, k)}
    if ref.local_path is not None:
        return facts_for_path(ref.local_path, ref.name, variants, mmproj)
    from .hub import cached_snapshot

    snap = cached_snapshot(ref.repo, ref.revision) if ref.repo else None
    if snap is not None and (snap / "config.json").is_file():
        return facts_for_path(snap, ref.name, variants)
    ggufs = [] if spec is None else [(r, rev, f, m) for r, rev, f, m in (
        (spec.repo, ref.revision, spec.file, spec.mmproj), (spec.gguf_repo, "main", spec.gguf_file, spec.gguf_mmproj))
        if r and f]
    for repo, rev, file, beside in ggufs:  # a GGUF form pulled (with its mmproj): planned from its files
        gguf = cached_snapshot(repo, rev, file, beside)
        if gguf is not None:
            return facts_for_path(gguf / file, ref.name, variants, mmproj)
    context = spec.context if spec else None
    vision = spec.vision_params if spec else 0  # the registry's figure: the tower is not downloaded either
    f = known_facts(ref.repo or "", ref.name, context, variants, vision)
    if f is not None:
        if spec is not None and spec.params:
            f.params = spec.params
        return f
    if spec is None or not spec.params:
        raise PlanError(f"{ref.name} is not downloaded and its size is unknown: `localllm pull {ref.name}` first")
    f = _estimated_facts(ref.name, spec.params, context)
    f.variants, f.vision_params = variants, vision
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


# ---- many GPUs (vLLM: tensor parallel within a node, pipeline parallel across nodes) ------------
# Memory per GPU as `nvidia-smi` / `rocm-smi` report it (MiB), and whether the kind has bf16 and
# fp8 kernels in vLLM (compute capability >= 8.0; below it float16 and no fp8).
GPU_KINDS: dict[str, tuple[int, bool]] = {
    "b200": (183359, True), "h200": (143771, True), "h100": (81559, True), "a100": (81920, True),
    "a100-40": (40960, True), "l40s": (46068, True), "a6000": (49140, True), "l4": (23034, True),
    "a10g": (23028, True), "rtx4090": (24564, True), "rtx3090": (24576, True), "mi300x": (196592, True),
    "v100": (32768, False), "t4": (15360, False),
}
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of each GPU it may use
GPU_RUNTIME_BYTES = 2 * GiB  # per GPU: CUDA context, CUDA graphs, NCCL buffers, allocator slack
GPU_PREFILL_TOKENS = 8192  # vLLM's default max_num_batched_tokens on a large GPU: one step's activations


@dataclass
class Fleet:
    """`--gpus N[xKIND] --nodes M`: M nodes of N GPUs of `memory` bytes each."""

    per_node: int
    kind: str
    memory: int
    nodes: int = 1
    bf16: bool = True

    @property
    def total(self) -> int:
        return self.per_node * self.nodes

    def describe(self) -> str:
        where = f"{self.nodes} nodes x " if self.nodes > 1 else ""
        return f"{where}{self.per_node} x {self.kind} ({gib(self.memory)} each)"


def parse_gpus(text: str, nodes: int = 1, local: tuple[str, int] | None = None) -> Fleet:
    """'8xh100', '4x80GiB', '2xa100-40', or '4' (this machine's GPU kind: `local` = (name, bytes))
    -> Fleet; PlanError naming what is wrong."""
    import re

    if nodes < 1:
        raise PlanError(f"--nodes must be >= 1, got {nodes}")
    m = re.fullmatch(r"\s*(\d+)\s*(?:[x*]\s*(\S+))?\s*", text.lower())
    if m is None or int(m.group(1)) < 1:
        raise PlanError(f"--gpus {text!r}: expected COUNT or COUNTxKIND (8xh100, 4x80GiB; kinds: "
                        f"{', '.join(GPU_KINDS)})")
    count, kind = int(m.group(1)), m.group(2)
    if kind is None:
        if local is None:
            raise PlanError(f"--gpus {text}: this machine has no GPU to take the kind from; say which: "
                            f"--gpus {count}xh100 or {count}x80GiB (kinds: {', '.join(GPU_KINDS)})")
        return Fleet(count, local[0], local[1], nodes)
    if kind in GPU_KINDS:
        mib, modern = GPU_KINDS[kind]
        return Fleet(count, kind, mib << 20, nodes, modern)
    size = re.fullmatch(r"(\d+(?:\.\d+)?)(gib|gb|g)", kind)
    if size is None:
        raise PlanError(f"--gpus {text}: unknown GPU kind {kind!r} (one of {', '.join(GPU_KINDS)}, or a memory "
                        "size such as 80GiB)")
    scale = 10 ** 9 if size.group(2) == "gb" else GiB
    return Fleet(count, f"{size.group(1)} GiB GPU" if scale == GiB else f"{size.group(1)} GB GPU",
                 int(float(size.group(1)) * scale), nodes)


@dataclass
class Split:
    """One way to run the model on the fleet, per GPU (the fullest one)."""

    precision: str  # "bfloat16" | "float16" | "fp8" | "awq" | "gptq"
    label: str
    variant: str | None  # the pre-quantized repo to load (awq/gptq)
    tp: int
    pp: int
    dp: int  # replicas of tp x pp GPUs on one node (vLLM's --data-parallel-size)
    ctx: int
    weights: int
    kv: int  # one ctx-long sequence
    runtime: int
    budget: int
    fits: bool

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def sequences(self) -> int:
        """Full-length sequences the KV room holds at once (vLLM's 'maximum concurrency')."""
        return max(0, (self.budget - self.weights - self.runtime) // max(1, self.kv))


def _gpu_candidates(f: ModelFacts, quant: str, fleet: Fleet) -> list[tuple[str, str, str | None]]:
    """(precision, label, variant repo) in order of preference (most precise first)."""
    if f.native == "gguf":
        raise PlanError(f"{f.name} is a GGUF file: vLLM serves Hugging Face checkpoints (name the model's repo "
                        "or a model directory)")
    if f.native in ("awq", "gptq"):
        return [(f.native, f"{f.native.upper()} as stored", None)]
    sixteen = ("bfloat16", "bfloat16", None) if fleet.bf16 else ("float16", "float16", None)
    fp8 = [("fp8", "fp8 (quantized on load)", None)] if fleet.bf16 else []
    variants = [(k, f"{k.upper()} variant", f.variants[k]) for k in ("awq", "gptq") if f.variants.get(k)]
    table = {"bfloat16": [sixteen], "float16": [("float16", "float16", None)], "float32": [("float32", "float32", None)],
             "awq": [v for v in variants if v[0] == "awq"], "gptq": [v for v in variants if v[0] == "gptq"],
             "int8": fp8, "auto": [sixteen, *fp8, *variants]}
    if quant not in table:
        raise PlanError(f"--quant {quant} has no vLLM counterpart on GPUs (auto, bf16, fp16, fp32, int8 = fp8, "
                        "awq, gptq)")
    if not table[quant]:
        what = "fp8 needs compute capability >= 8.0" if quant == "int8" else "no such variant in models.toml"
        raise PlanError(f"{f.name}: --quant {quant} is not available on {fleet.kind} ({what})")
    return table[quant]


def _gpu_weights(f: ModelFacts, precision: str) -> tuple[int, int]:
    """(bytes of the decoder's linears, bytes of the rest) as vLLM holds them on GPUs."""
    other = (f.params - f.linear_params) * 2  # embedding, head, norms: 16-bit
    per = {"bfloat16": 2.0, "float16": 2.0, "float32": 4.0, "fp8": 1.0 + 4 / 4096}.get(precision, 0.5 + 4 / 128)
    return int(f.linear_params * per), other * (2 if precision == "float32" else 1)


def _tp_ok(f: ModelFacts, tp: int) -> bool:
    """vLLM's rule: heads split evenly; KV heads split evenly or replicated evenly."""
    if not f.heads:
        return True
    kvh = f.kv_heads or f.heads
    return f.heads % tp == 0 and (kvh % tp == 0 or tp % kvh == 0)


def split_for(f: ModelFacts, fleet: Fleet, precision: str, label: str, variant: str | None, ctx: int,
              tp: int, pp: int) -> Split:
    linear, other = _gpu_weights(f, precision)
    weights = linear // (tp * pp) + other // tp  # a pipeline stage holds its layers and the embedding or head
    kvh = f.kv_heads or max(1, f.heads)
    share = max(1, kvh // tp) / kvh if f.heads else 1 / tp  # KV heads a GPU holds: split, or one replicated
    kv_tok = f.kv_bytes_per_token * (2 if precision == "float32" else 1)
    kv = int(kv_tok * share * ctx / pp)
    act = GPU_PREFILL_TOKENS * (4 * f.hidden + 3 * f.intermediate // tp) * 2 + 256 * f.vocab * 4 // tp
    runtime = GPU_RUNTIME_BYTES + act
    budget = int(fleet.memory * GPU_MEMORY_UTILIZATION)
    dp = fleet.per_node // tp if pp == 1 else 1
    return Split(precision, label, variant, tp, pp, max(1, dp), ctx, weights, kv, runtime, budget,
                 weights + kv + runtime <= budget)


def gpu_splits(f: ModelFacts, fleet: Fleet, precision: str, label: str, variant: str | None,
               ctx: int) -> list[Split]:
    """Every split vLLM can run on the fleet, fewest GPUs first: TP of 1, 2, 4, ... within a node,
    then (the model still not fitting) TP over a whole node and PP over 2, 3, ... nodes."""
    out = []
    tp = 1
    while tp <= fleet.per_node:
        if _tp_ok(f, tp):
            out.append(split_for(f, fleet, precision, label, variant, ctx, tp, 1))
        tp *= 2
    full = fleet.per_node if _tp_ok(f, fleet.per_node) else (out[-1].tp if out else 1)
    if fleet.per_node != full or not any(s.tp == full for s in out):
        out.append(split_for(f, fleet, precision, label, variant, ctx, full, 1))
    for pp in range(2, fleet.nodes + 1):
        if not f.layers or pp <= f.layers:
            out.append(split_for(f, fleet, precision, label, variant, ctx, full, pp))
    return out


@dataclass
class GpuPlan:
    model: str
    fleet: Fleet
    ctx: int
    chosen: Split | None
    reason: str
    table: list[tuple[str, dict[int, Split | None]]]  # per precision: ctx -> the fewest-GPU split that fits
    rejected: list[str] = field(default_factory=list)
    estimated: bool = False

    @property
    def fits(self) -> bool:
        return self.chosen is not None


def plan_gpus(f: ModelFacts, fleet: Fleet, quant: str = "auto", ctx: int | None = None) -> GpuPlan:
    """The most precise precision whose fewest-GPU split fits the fleet at `ctx` (default: the
    model's whole context), and, for the table, the GPUs each precision needs at a few contexts."""
    quant = normalize_quant(quant)
    if ctx is not None and ctx < 1:
        raise PlanError(f"--ctx must be positive, got {ctx}")
    n = min(ctx or f.max_context, f.max_context)
    cands = _gpu_candidates(f, quant, fleet)
    contexts = sorted({c for c in (4096, 32768, f.max_context, n) if c <= f.max_context})
    table = []
    for precision, label, variant in cands:
        row = {}
        for c in contexts:
            row[c] = next((s for s in gpu_splits(f, fleet, precision, label, variant, c) if s.fits), None)
        table.append((label, row))
    chosen, rejected = None, []
    for precision, label, variant in cands:
        splits = gpu_splits(f, fleet, precision, label, variant, n)
        fit = next((s for s in splits if s.fits), None)
        if fit is not None:
            chosen = fit
            break
        big = splits[-1]
        rejected.append(f"{label} needs {gib(big.weights + big.kv + big.runtime)} per GPU even on "
                        f"{big.gpus} GPU{'s' if big.gpus > 1 else ''} (TP {big.tp}, PP {big.pp})")
    if chosen is None:
        reason = (f"{f.name} does not fit {fleet.describe()} at ctx {n}: {'; '.join(rejected)}; "
                  f"use more GPUs or nodes, or a smaller --ctx")
        return GpuPlan(f.name, fleet, n, None, reason, table, rejected, f.estimated)
    why = f"{chosen.label} fits on {chosen.gpus} GPU{'s' if chosen.gpus > 1 else ''}"
    why += f" (TP {chosen.tp}" + (f", PP {chosen.pp} over {chosen.pp} nodes" if chosen.pp > 1 else "") + ")"
    if rejected:
        why += f"; {'; '.join(rejected)}"
    elif quant == "auto":
        why += ", the most precise option"
    if chosen.dp > 1:
        why += f"; the node's other GPUs run {chosen.dp - 1} more replica{'s' if chosen.dp > 2 else ''} " \
               f"(data parallel {chosen.dp})"
    if chosen.pp < fleet.nodes and chosen.pp > 1 or (chosen.pp == 1 and fleet.nodes > 1):
        why += f"; it needs {chosen.pp} of the {fleet.nodes} nodes"
    if ctx and ctx > f.max_context:
        why += f"; --ctx {ctx} capped at the model's {f.max_context}"
    return GpuPlan(f.name, fleet, n, chosen, why, table, rejected, f.estimated)


def describe_gpu_plan(p: GpuPlan) -> str:
    """`localllm plan`'s explanation (the command comes from vllm_args, which the CLI appends)."""
    lines = [f"plan: {p.model} on {p.fleet.describe()}, ctx {p.ctx}, with vLLM"
             f" ({GPU_MEMORY_UTILIZATION:.0%} of each GPU: --gpu-memory-utilization)"]
    ctxs = sorted({c for _, row in p.table for c in row})
    width = max(len(label) for label, _ in p.table) + 2
    lines.append("  GPUs needed (TP within a node, PP across nodes):")
    lines.append(("    " + "precision".ljust(width) + "".join(f"ctx {c}".ljust(16) for c in ctxs)).rstrip())
    for label, row in p.table:
        cells = []
        for c in ctxs:
            s = row.get(c)
            cells.append(("-" if s is None else f"{s.gpus} (TP {s.tp}" + (f" PP {s.pp}" if s.pp > 1 else "") + ")")
                         .ljust(16))
        lines.append(("    " + label.ljust(width) + "".join(cells)).rstrip())
    lines.append(f"    (-: does not fit {p.fleet.total} GPU{'s' if p.fleet.total > 1 else ''})")
    s = p.chosen
    if s is None:
        lines.append(f"  does not fit: {p.reason}")
        return "\n".join(lines)
    lines.append(f"  choice: {s.label}, tensor parallel {s.tp}, pipeline parallel {s.pp}"
                 + (f", data parallel {s.dp}" if s.dp > 1 else "") + (f" (load {s.variant})" if s.variant else ""))
    lines.append(f"  per GPU: weights {gib(s.weights)} + KV {gib(s.kv)} for one {s.ctx}-token sequence + runtime "
                 f"{gib(s.runtime)} = {gib(s.weights + s.kv + s.runtime)} of {gib(s.budget)}; the KV room holds "
                 f"{s.sequences} such sequences at once")
    lines.append(f"  why: {p.reason}")
    if p.estimated:
        lines.append("  note: shapes estimated from the parameter count (not downloaded yet)")
    return "\n".join(lines)
