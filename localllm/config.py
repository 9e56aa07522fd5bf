"""Configuration objects passed down from the front ends to the engine and model."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass


@dataclass
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM, Phi-3/Phi-4-mini,
    and the mixture-of-experts Mixtral and Qwen3-MoE)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    partial_rotary_factor: float = 1.0  # Phi-4-mini: RoPE on the first 3/4 of each head only
    sliding_window: int | None = None  # Phi-3, Mistral v0.1: every layer's attention window
    hidden_act: str = "silu"  # "silu" (SwiGLU) | "gelu_tanh" (Gemma's GeGLU)
    # Gemma 2/3
    layer_windows: tuple[int | None, ...] | None = None  # per layer: its sliding window, None = full
    rope_local_theta: float | None = None  # Gemma 3: the RoPE base of the sliding-window layers
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (default head_dim)
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the logits
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    sandwich_norms: bool = False  # Gemma 2/3: norms on the attention and MLP outputs too
    # Gemma's checkpoints store RMSNorm weights w for a scale of (1 + w); llama.cpp's converter
    # adds the 1, so a GGUF's config says 0
    norm_weight_offset: float = 0.0
    architecture: str = "LlamaForCausalLM"
    model_type: str = "llama"
    # mixture of experts (Mixtral, Qwen3-MoE); 0 experts: a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's MLP width (intermediate_size: the dense layers')
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1
    moe_layers: tuple[bool, ...] | None = None  # per layer: an MoE block (else a dense MLP)
    # Qwen2.5-VL's M-RoPE: rotary frequencies in sections rotated by the temporal, height and
    # width positions of image tokens (layers.RotaryEmbedding); None: plain RoPE
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False  # Qwen3-VL: the sections' frequencies interleaved (t, h, w, t, h, w, ...)
    # gpt-oss: a learned logit per query head in each attention softmax's denominator; the router's
    # top k of its logits softmaxed among themselves ("topk_softmax"; else "softmax": over all
    # experts, then the top k); its experts' clamped SwiGLU, (up + 1) * g * sigmoid(alpha * g)
    attn_sinks: bool = False
    router_gating: str = "softmax"
    expert_act: str = "silu"  # "silu" | "swiglu_oai"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        supported = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                     "Phi3ForCausalLM", *GEMMA_DEFAULTS, "Gemma3ForConditionalGeneration",
                     "Idefics3ForConditionalGeneration", *MOE_ARCHS, *MROPE_ARCHS}
        if arch not in supported:
            raise ValueError(f"unsupported architecture {arch!r} (supported: {', '.join(sorted(supported))})")
        if arch == "Gemma3ForConditionalGeneration":  # the text model of Gemma 3 4B/12B/27B (the tower: model/vision)
            # transformers reads the tie from the outer config
            tie = {"tie_word_embeddings": cfg["tie_word_embeddings"]} if "tie_word_embeddings" in cfg else {}
            arch, cfg = "Gemma3ForCausalLM", {**cfg.get("text_config", {}), **tie, "architectures": ["Gemma3ForCausalLM"]}
        if arch == "Idefics3ForConditionalGeneration":  # SmolVLM: a Llama text model (the tower: model/vision)
            tie = {"tie_word_embeddings": cfg["tie_word_embeddings"]} if "tie_word_embeddings" in cfg else {}
            arch, cfg = "LlamaForCausalLM", {**cfg.get("text_config", {}), **tie, "architectures": ["LlamaForCausalLM"]}
        mrope, interleaved = None, False
        if arch in MROPE_ARCHS:  # Qwen2.5-VL's / Qwen3-VL's text model; the vision tower: model/vision/qwen_vl
            cfg, mrope, interleaved = _mrope_text_config(cfg)
        gemma = arch in GEMMA_DEFAULTS
        if gemma:  # hub configs omit fields at their defaults
            cfg = {**GEMMA_DEFAULTS[arch], **{k: v for k, v in cfg.items() if v is not None or "softcap" in k}}
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        # transformers 5 moves partial_rotary_factor into rope_parameters, older configs keep it on top
        partial = (rope or {}).get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0
        if rope and rope.get("rope_type", rope.get("type")) in (None, "default", "mrope"):
            rope = None
        if rope and arch == "Phi3ForCausalLM":
            rope = _phi3_longrope(cfg, rope)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        # transformers applies Phi-3's, Mistral's and Mixtral's windows (Qwen2's only with use_sliding_window,
        # which no released model sets)
        window = (cfg.get("sliding_window") if arch in ("Phi3ForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")
                  else None)
        fields = (_gemma_fields(arch, cfg) if gemma else {}) | _moe_fields(arch, cfg) \
            | (_gpt_oss_fields(cfg) if arch == "GptOssForCausalLM" else {})
        return cls(**{**dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch in ("Qwen2ForCausalLM", "Qwen2_5_VLForConditionalGeneration")
            or bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3VLForConditionalGeneration"),
            partial_rotary_factor=float(partial),
            sliding_window=int(window) if window else None,
            architecture=arch,
            model_type=cfg.get("model_type", "llama"),
            mrope_section=mrope, mrope_interleaved=interleaved,
        ), **fields})

    @classmethod
    def from_gguf(cls, meta: dict, tensors: Collection[str], read_floats: Callable[[str], list[float]]) -> ModelConfig:
        """A GGUF file's architecture as llama.cpp reads it: its metadata `meta`, the names of its
        `tensors` (which say tied embeddings, biases, q/k norms, MoE layers) and `read_floats`,
        a tensor's values by name (LongRoPE's factor sets are tensors). KeyError / TypeError: a
        required key is missing; ValueError: the file holds what we do not support."""
        arch = meta.get("general.architecture")
        if arch not in GGUF_ARCHS:
            raise ValueError(f"architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHS)})")

        def m(key, default=None):
            return meta.get(f"{arch}.{key}", default)

        heads = m("attention.head_count")
        hidden = m("embedding_length")
        head_dim = m("attention.key_length") or hidden // heads
        fields = dict(
            vocab_size=m("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
            hidden_size=hidden, intermediate_size=m("feed_forward_length"),
            num_layers=m("block_count"), num_heads=heads,
            num_kv_heads=m("attention.head_count_kv") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(m("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(m("rope.freq_base", 10000.0)),
            max_position_embeddings=int(m("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensors,
            qkv_bias="blk.0.attn_q.bias" in tensors,
            qk_norm="blk.0.attn_q_norm.weight" in tensors,
            partial_rotary_factor=m("rope.dimension_count", head_dim) / head_dim,
            # Phi-3 only, as from_hf (llama.cpp writes 0 for "none")
            sliding_window=(m("attention.sliding_window") or None) if arch == "phi3" else None,
            rope_scaling=_gguf_longrope(m, tensors, read_floats) or _gguf_rope_freqs(tensors, read_floats)
            or _gguf_rope_scaling(m),
            architecture=GGUF_ARCHS[arch],
            model_type=arch,
        ) | (_gguf_gemma_fields(m, arch, heads, hidden, head_dim) if arch.startswith("gemma") else {}) \
            | (_gguf_mrope_fields(m, arch) if arch in ("qwen2vl", "qwen3vl") else {}) \
            | (_gguf_gpt_oss_fields(m) if arch == "gpt-oss" else {})
        return cls(**fields | _gguf_moe_fields(m, arch, fields["num_layers"], tensors))

    def window(self, layer: int) -> int | None:
        """The attention window of layer `layer` (None: full causal attention; Phi-4-mini's window
        of 262144 beyond its context is none)."""
        w = self.layer_windows[layer] if self.layer_windows else self.sliding_window
        return w if w and w < self.max_position_embeddings else None

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that RoPE rotates (transformers' int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def fused_checkpoint(self) -> bool:
        """Checkpoints store q/k/v as one qkv_proj and gate/up as one gate_up_proj (Phi-3)."""
        return self.architecture == "Phi3ForCausalLM"

    def checkpoint_linears(self) -> dict[str, tuple[str, ...]]:
        """Each of our fused linears -> the checkpoint modules it holds, in row order."""
        return checkpoint_linears(self.fused_checkpoint)

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.moe_layers and self.moe_layers[i])

    def checkpoint_norms(self) -> dict[str, str]:
        """Each norm of our DecoderLayer -> the checkpoint module that holds it. Gemma's
        post_attention_layernorm is the norm on the attention output; its pre-MLP norm is
        pre_feedforward_layernorm."""
        norms = {"input_norm": "input_layernorm", "post_norm": "post_attention_layernorm"}
        if self.qk_norm:
            norms |= {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
        if self.sandwich_norms:
            norms |= {"post_norm": "pre_feedforward_layernorm", "attn_out_norm": "post_attention_layernorm",
                      "mlp_out_norm": "post_feedforward_layernorm"}
        return norms

    def to_hf(self) -> dict:
        if (self.rope_scaling or {}).get("rope_type") == "freq_factors":
            raise ValueError("a GGUF's per-frequency RoPE factors (rope_freqs: Llama 3.1+) have no Hugging Face "
                             "config form; use the model's Hugging Face checkpoint")
        extra = _moe_to_hf(self)
        if self.partial_rotary_factor != 1.0:
            extra["partial_rotary_factor"] = self.partial_rotary_factor
        if self.sliding_window:
            extra["sliding_window"] = self.sliding_window
        if self.rope_scaling and "original_max_position_embeddings" in self.rope_scaling:
            extra["original_max_position_embeddings"] = self.rope_scaling["original_max_position_embeddings"]
        return extra | {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }

    @property
    def num_params(self) -> int:
        h = self.hidden_size
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.linear_params + self.num_layers * 2 * h + emb + h + self.bias_params

    @property
    def bias_params(self) -> int:
        """Biases and sinks: Qwen2's on q/k/v; gpt-oss's on every linear (q/k/v/o, the router,
        each expert's gate_up and down) and a sink per query head."""
        L, h = self.num_layers, self.hidden_size
        n = L * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.qkv_bias else 0
        if self.architecture == "GptOssForCausalLM":
            moe = sum(self.moe_layers or ())
            n += L * (h + self.num_heads) + moe * self.num_experts * (1 + 2 * self.moe_intermediate_size + h)
        return n

    @property
    def linear_params(self) -> int:
        """Parameters of the decoder's linears: every expert resident, and the routers."""
        return self._linear_params(self.num_experts)

    @property
    def active_params(self) -> int:
        """The parameters one token uses: k experts of each MoE layer."""
        return self.num_params - self.linear_params + self._linear_params(self.num_experts_per_tok)

    def _linear_params(self, experts: int) -> int:
        h, L = self.hidden_size, self.num_layers
        attn = h * self.head_dim * (self.num_heads * 2 + self.num_kv_heads * 2)
        moe = sum(self.moe_layers or ())
        mlp = (L - moe) * 3 * h * self.intermediate_size
        mlp += moe * (experts * 3 * h * self.moe_intermediate_size + self.num_experts * h)
        return L * attn + mlp

    def kv_bytes_per_token(self, dtype_bytes: float = 2) -> int:
        """K and V of every layer; dtype_bytes per value (q8_0: 34 / 32, KV_TYPE_BYTES)."""
        return round(2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes)


MOE_ARCHS = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM")
MROPE_ARCHS = ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration")


def _mrope_text_config(cfg: dict) -> tuple[dict, tuple[int, ...], bool]:
    """A Qwen-VL text model's config, M-RoPE sections and layout. Qwen2.5-VL's hub configs are flat
    (text fields on top, rope_scaling {type: mrope, mrope_section}); transformers 5 and Qwen3-VL
    nest them in text_config (rope_parameters or rope_scaling {mrope_section, mrope_interleaved}).
    The head is tied where either level says so. Defaults are transformers'."""
    text = cfg.get("text_config") or {}
    merged = {**cfg, **text, "model_type": cfg.get("model_type"),
              "tie_word_embeddings": bool(cfg.get("tie_word_embeddings") or text.get("tie_word_embeddings"))}
    rope = merged.get("rope_parameters") or merged.get("rope_scaling") or {}
    qwen3 = cfg["architectures"][0] == "Qwen3VLForConditionalGeneration"
    section = rope.get("mrope_section") or ((24, 20, 20) if qwen3 else (16, 24, 24))
    return merged, tuple(int(n) for n in section), qwen3  # transformers' Qwen3-VL always interleaves


def _moe_fields(arch: str, cfg: dict) -> dict:
    """The MoE fields of an HF config. Mixtral: every layer sparse, intermediate_size is the
    experts' width, top-k renormalised. Qwen3-MoE: layer i is sparse unless listed in
    mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step; renormalised per
    norm_topk_prob (transformers' default False). transformers 5 writes Qwen3-MoE's expert count
    as num_local_experts, the hub configs as num_experts."""
    if arch not in MOE_ARCHS:
        return {}
    L, k = cfg["num_hidden_layers"], cfg["num_experts_per_tok"]
    if arch in ("MixtralForCausalLM", "GptOssForCausalLM"):
        return {"num_experts": cfg["num_local_experts"], "num_experts_per_tok": k,
                "moe_intermediate_size": cfg["intermediate_size"], "norm_topk_prob": True, "moe_layers": (True,) * L}
    n = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
    return {"num_experts": n, "num_experts_per_tok": k, "moe_intermediate_size": cfg["moe_intermediate_size"],
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "moe_layers": tuple(n > 0 and i not in dense and (i + 1) % step == 0 for i in range(L))}


def _moe_to_hf(c: ModelConfig) -> dict:
    if c.architecture == "MixtralForCausalLM":
        return {"num_local_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok}
    if c.architecture == "Qwen3MoeForCausalLM":
        return {"num_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok,
                "moe_intermediate_size": c.moe_intermediate_size, "norm_topk_prob": c.norm_topk_prob,
                "decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(c.num_layers) if not c.is_moe_layer(i)]}
    return {}


def checkpoint_linears(fused: bool) -> dict[str, tuple[str, ...]]:
    """Our fused linears (qkv, o, gate_up, down) -> the checkpoint modules each holds, in row
    order: Llama's separate q/k/v and gate/up, or Phi-3's qkv_proj and gate_up_proj (q, k, v rows
    and gate, up rows in the same order as ours)."""
    if fused:
        return {"qkv": ("self_attn.qkv_proj",), "o": ("self_attn.o_proj",),
                "gate_up": ("mlp.gate_up_proj",), "down": ("mlp.down_proj",)}
    return {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
            "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


# Gemma configs as transformers completes them (Gemma2Config / Gemma3TextConfig defaults): hub
# configs, Gemma 3's nested text_config especially, leave these out
GEMMA_DEFAULTS = {
    "Gemma2ForCausalLM": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                              num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                              max_position_embeddings=8192, rope_theta=10000.0, query_pre_attn_scalar=256,
                              sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                              tie_word_embeddings=True, model_type="gemma2"),
    "Gemma3ForCausalLM": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                              num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                              max_position_embeddings=131072, rope_theta=1_000_000.0, rope_local_base_freq=10000.0,
                              query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6,
                              tie_word_embeddings=True, model_type="gemma3_text"),
}


def sliding_layers(n: int, period: int) -> list[bool]:
    """Which of n layers slide when every period-th one is global (Gemma's layouts, as both
    transformers and llama.cpp derive them)."""
    return [(i + 1) % period != 0 for i in range(n)]


def _gemma_fields(arch: str, cfg: dict) -> dict:
    """Gemma 2/3's fields: which layers slide (layer_types, else the pattern transformers derives:
    every other layer for Gemma 2, five in six for Gemma 3), the RoPE of the global layers (Gemma 3
    4B+: linear x8) and of the local ones, soft-caps, the attention scale."""
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if not types:
        pattern = 2 if arch == "Gemma2ForCausalLM" else \
            cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6
        types = ["sliding_attention" if s else "full_attention" for s in sliding_layers(n, pattern)]
    window = int(cfg["sliding_window"])
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one RoPE dict per layer type
        glob, local = params["full_attention"], params.get("sliding_attention") or {}
    else:
        glob = {**(cfg.get("rope_scaling") or {}), **params}
        local = {"rope_theta": cfg.get("rope_local_base_freq")}
    scaling = None if glob.get("rope_type", glob.get("type", "default")) == "default" else \
        {k: v for k, v in glob.items() if k != "rope_theta"}
    theta = glob.get("rope_theta") or cfg.get("rope_theta") or 10000.0
    gemma3 = arch == "Gemma3ForCausalLM"
    return dict(
        rope_theta=float(theta), rope_scaling=scaling,
        rope_local_theta=float(local.get("rope_theta") or 10000.0) if gemma3 else None,
        layer_windows=tuple(window if t == "sliding_attention" else None for t in types),
        hidden_act="gelu_tanh", query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]),
        attn_logit_softcap=cfg.get("attn_logit_softcapping") or None,
        final_logit_softcap=cfg.get("final_logit_softcapping") or None,
        scale_embeddings=True, sandwich_norms=True, qk_norm=gemma3, norm_weight_offset=1.0,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)), qkv_bias=bool(cfg.get("attention_bias")),
        partial_rotary_factor=1.0,
    )


def _phi3_longrope(cfg: dict, rope: dict) -> dict:
    """Phi-3's LongRoPE parameters as transformers resolves them (Phi3Config and
    _compute_longrope_parameters): "su" is the old name; the top-level
    original_max_position_embeddings wins over the dict's; attention_factor, when not given, is
    sqrt(1 + ln(s) / ln(original)) with s = factor, else max_position_embeddings / original."""
    kind = rope.get("rope_type", rope.get("type"))
    if kind in ("su", "yarn"):  # transformers reads both as longrope for Phi-3
        kind = "longrope"
    if kind != "longrope":
        raise ValueError(f"unsupported rope_scaling type {kind!r} for Phi-3 (supported: default, longrope)")
    orig = int(cfg.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings") or 4096)
    attn = rope.get("attention_factor")
    if attn is None:
        s = rope.get("factor") or cfg.get("max_position_embeddings", 4096) / orig
        attn = 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(orig))
    return {"rope_type": "longrope", "short_factor": [float(x) for x in rope["short_factor"]],
            "long_factor": [float(x) for x in rope["long_factor"]], "original_max_position_embeddings": orig,
            "attention_factor": float(attn)}


# GGUF general.architecture -> the HF architecture it holds
GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
              "gemma3": "Gemma3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "gpt-oss": "GptOssForCausalLM",
              # Qwen2-VL / 2.5-VL's and Qwen3-VL's text models (their towers: an mmproj file beside them)
              "qwen2vl": "Qwen2_5_VLForConditionalGeneration", "qwen3vl": "Qwen3VLForConditionalGeneration"}
# llama.cpp sizes Gemma's attention scale by the model: 1/sqrt(hidden / heads) for the 27B models
# (query_pre_attn_scalar 144 / 168, known by their layer counts), 1/sqrt(head_dim) otherwise
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gguf_mrope_fields(m: Callable, arch: str) -> dict:
    """Qwen-VL's M-RoPE as llama.cpp's converter writes it: rope.dimension_sections, the temporal,
    height and width sections (a fourth, unused, is 0); Qwen3-VL's interleaved, as transformers
    always rotates it. Its deepstack features need nothing here (they ride on the image rows)."""
    sections = [int(x) for x in m("rope.dimension_sections") or ()]
    if not sections:
        raise ValueError(f"a {arch} GGUF needs {arch}.rope.dimension_sections (M-RoPE)")
    while sections and sections[-1] == 0:
        sections.pop()
    if len(sections) != 3:
        raise ValueError(f"{arch}.rope.dimension_sections {sections} is not 3 sections (temporal, height, width)")
    return {"mrope_section": tuple(sections), "mrope_interleaved": arch == "qwen3vl"}


def _gguf_moe_fields(m: Callable, arch: str, num_layers: int, tensors: Collection[str]) -> dict:
    """llama.cpp's MoE metadata: Mixtral is arch 'llama' with experts (their width is
    feed_forward_length); qwen3moe has expert_feed_forward_length. A layer is sparse where
    it has a router (ffn_gate_inp); top-k weights renormalised unless expert_weights_norm
    says otherwise (llama.cpp renormalises for both)."""
    n = int(m("expert_count", 0) or 0)
    if not n:
        return {}
    inter = m("expert_feed_forward_length") or m("feed_forward_length")
    fields = {"num_experts": n, "num_experts_per_tok": int(m("expert_used_count")),
              "moe_intermediate_size": int(inter), "norm_topk_prob": bool(m("expert_weights_norm", True)),
              "moe_layers": tuple(f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(num_layers)),
              "intermediate_size": int(m("feed_forward_length") or inter)}
    # HF's names for the model type (to_hf writes it)
    fields["model_type"] = {"llama": "mixtral", "gpt-oss": "gpt_oss"}.get(arch, "qwen3_moe")
    if arch == "llama":
        fields["architecture"] = "MixtralForCausalLM"
    return fields


def _gguf_gemma_fields(m: Callable, arch: str, heads: int, hidden: int, head_dim: int) -> dict:
    """Gemma 2/3 as llama.cpp (0.3.36's) reads them, with its values for absent keys: the
    window (Gemma 2: 4096; Gemma 3: none, every layer global); which layers slide (the file's
    attention.sliding_window_pattern, a period or a flag per layer, else every other for
    Gemma 2, five in six for Gemma 3); the local RoPE base (rope.freq_base_swa, else Gemma
    2's global one, Gemma 3's 10000); soft-caps (Gemma 2: attention 50, final 30; Gemma 3
    none on attention, a final one only when the file has it)."""
    n = m("block_count")
    gemma2 = arch == "gemma2"
    window = int(m("attention.sliding_window") or (4096 if gemma2 else 0)) or None
    pattern = m("attention.sliding_window_pattern") or (2 if gemma2 else 6)
    slides = pattern if isinstance(pattern, list) else sliding_layers(n, pattern)
    local_theta = m("rope.freq_base_swa") or (None if gemma2 else 10000.0)
    return dict(
        layer_windows=tuple(window if s else None for s in slides),
        rope_local_theta=None if local_theta is None else float(local_theta),
        query_pre_attn_scalar=float(hidden // heads if n == GEMMA_27B_LAYERS[arch] else head_dim),
        attn_logit_softcap=float(m("attn_logit_softcapping", 50.0)) if gemma2 else None,
        final_logit_softcap=float(m("final_logit_softcapping", 30.0 if gemma2 else 0.0)) or None,
        hidden_act="gelu_tanh", scale_embeddings=True, sandwich_norms=True,
    )


def _gguf_gpt_oss_fields(m: Callable) -> dict:
    """gpt-oss as llama.cpp's converter writes it: a sliding window (128) on every even layer (HF's
    layer_types, llama.cpp's swa pattern 2), YaRN RoPE (the factor and the original context; HF's
    config leaves the ramp's ends untruncated, so do we), attention sinks, biases everywhere (found
    by name), the router's softmax over its top k and the experts' clamped SwiGLU (alpha 1.702,
    limit 7: no key holds them)."""
    n, window = m("block_count"), int(m("attention.sliding_window") or 128)
    rope = {"rope_type": "yarn", "factor": float(m("rope.scaling.factor", 32.0)),
            "original_max_position_embeddings": int(m("rope.scaling.original_context_length", 4096)),
            "beta_fast": float(m("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(m("rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}
    if m("rope.scaling.type", "yarn") != "yarn":
        raise ValueError(f"gpt-oss with rope scaling {m('rope.scaling.type')!r} is not supported (yarn only)")
    return dict(layer_windows=tuple(window if i % 2 == 0 else None for i in range(n)), rope_scaling=rope,
                attn_sinks=True, router_gating="topk_softmax", expert_act="swiglu_oai")


def _gpt_oss_fields(cfg: dict) -> dict:
    """gpt-oss as its HF config says: the window on the layers layer_types calls sliding (every even
    one in the published configs), attention sinks, the router's softmax over its top k and the
    experts' clamped SwiGLU (transformers' defaults where a key is absent: alpha 1.702, limit 7)."""
    window = int(cfg.get("sliding_window") or 128)
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                       for i in range(cfg["num_hidden_layers"])]
    return dict(layer_windows=tuple(window if t == "sliding_attention" else None for t in types), attn_sinks=True,
                router_gating="topk_softmax", expert_act="swiglu_oai",
                swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)), swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))


def _gguf_rope_scaling(m: Callable) -> dict | None:
    """RoPE scaling as the converter's keys say it (rope.scaling.type, .factor, ...): linear (the
    positions divided by the factor) or YaRN (Qwen2.5's long-context configs), as transformers
    reads the same fields of config.json."""
    kind, factor = m("rope.scaling.type"), m("rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor:
        orig = m("rope.scaling.original_context_length")
        if not orig:
            raise ValueError("YaRN RoPE scaling without rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(orig),
                "beta_fast": float(m("rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(m("rope.scaling.yarn_beta_slow", 1.0))}
    return None


def _gguf_rope_freqs(tensors: Collection[str], read_floats: Callable[[str], list[float]]) -> dict | None:
    """Llama 3.1+'s RoPE scaling as llama.cpp's converter stores it: no parameters, a factor per
    frequency (rope_freqs.weight, from the checkpoint's llama3 rope_scaling) that divides it."""
    if "rope_freqs.weight" not in tensors:
        return None
    return {"rope_type": "freq_factors", "freq_factors": read_floats("rope_freqs.weight")}


def _gguf_longrope(m: Callable, tensors: Collection[str], read_floats: Callable[[str], list[float]]) -> dict | None:
    """LongRoPE as llama.cpp's converter stores it: the factor sets as F32 tensors, the
    original context and the cos/sin factor as metadata."""
    if "rope_factors_long.weight" not in tensors:
        return None
    ctx, orig = int(m("context_length", 4096)), int(m("rope.scaling.original_context_length", 4096))
    attn = m("rope.scaling.attn_factor")
    if attn is None:  # the converter's (and transformers') default
        attn = math.sqrt(1 + math.log(ctx / orig) / math.log(orig)) if ctx > orig else 1.0
    return {"rope_type": "longrope", "original_max_position_embeddings": orig, "attention_factor": float(attn),
            "long_factor": read_floats("rope_factors_long.weight"),
            "short_factor": read_floats("rope_factors_short.weight")}


def kv_blocks(tokens: int, block_size: int, contexts: int = 1) -> int:
    """The KV blocks that hold `contexts` sequences of `tokens` tokens each: whole blocks per
    sequence, plus the null block (block 0, never handed out). The planner, the server's model
    pool and the engine all size the cache with this, so what one plans the other allocates."""
    return contexts * -(-tokens // block_size) + 1


def kv_tokens(num_blocks: int, block_size: int) -> int:
    """The tokens of one sequence that `num_blocks` KV blocks hold (all but the null block)."""
    return max(num_blocks - 1, 0) * block_size


# KV cache element types (--kv-type) and their bytes per value; q8_0: 32 int8 + an fp16 scale per 32
KV_TYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32}


@dataclass
class EngineConfig:
    """Knobs of the serving engine; the CLI and server fill it, the engine reads it."""

    max_model_len: int | None = None  # None: the model's context length
    block_size: int = 16
    # tokens per step (prompt chunks + decodes); None: 512 on CPU (llama.cpp's micro-batch: a
    # 2000-token prompt prefills as fast in 512-token chunks, with ~90 MB less peak memory on the
    # 135M model and ~650 MB less on a 1B), 2048 on a GPU
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 64
    num_kv_blocks: int | None = None  # None: sized for `parallel` full contexts (and memory)
    kv_memory_bytes: int | None = None  # explicit KV budget
    # full-length contexts the KV cache holds at once (llama.cpp's --parallel): 1 for a chat or a
    # one-shot run; a server's shorter requests share the same tokens
    parallel: int = 4
    memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_threads: int | None = None
    speculative: str | None = None  # None | "ngram" | a draft model (alias, path, repo) | "auto"
    num_speculative_tokens: int = 4  # the initial (and largest) k
    # the captured step: CUDA graphs on a GPU, the AOTInductor package of the forward on CPU (built
    # in the background the first time); False = eager, as vLLM's enforce_eager
    compile: bool = True
    # on CPU, queue a missing compiled package for the background builder (localllm ps): chat and
    # serve do; a one-shot `run` only with --build (it would exit long before the build lands)
    background_build: bool = True
    max_graph_batch: int = 256  # largest decode batch captured (capped by max_num_seqs)
    # the KV cache's element type (--kv-type, llama.cpp's -ctk/-ctv names): "auto" is the loader's
    # choice for the weights; "q8_0" the 8-bit cache (blocks of 32 int8 and an fp16 scale)
    kv_type: str = "auto"
    # the activations' width inside the int4 / int8-lane CPU kernels (--act-bits): 16 by default
    # (our quality rule), 8 the opt-in speed mode (llama.cpp's way; runs the eager one-call step)
    act_bits: int = 16
    # llama.cpp's mmproj file (vision tower) for a GGUF text model (--mmproj); None: the
    # mmproj*.gguf beside the model file, when one is there
    mmproj: str | None = None

    def __post_init__(self):
        # 0 used to mean "default" by falling through `if x:` tests; None is the only default
        for name in ("max_model_len", "kv_memory_bytes", "num_threads", "num_kv_blocks"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"EngineConfig.{name} must be a positive integer or None, got {v!r}")
        if self.kv_type != "auto" and self.kv_type not in KV_TYPE_BYTES:
            raise ValueError(f"unknown KV cache type {self.kv_type!r}; choose from auto, {', '.join(KV_TYPE_BYTES)}")
        if self.act_bits not in (8, 16):
            raise ValueError(f"EngineConfig.act_bits must be 8 or 16, got {self.act_bits!r}")
