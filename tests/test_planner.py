"""The precision/context planner: a table of (model, device, memory) cases, the memory model, and
the CLI's --dry-run (no model is loaded)."""

import pytest
from typer.testing import CliRunner

from localllm.planner import (
    DEFAULT_CTX,
    KNOWN_SHAPES,
    DeviceFacts,
    GiB,
    ModelFacts,
    PlanError,
    known_facts,
    kv_bytes,
    normalize_quant,
    overhead_bytes,
    plan,
    plan_for,
    shape_config,
    weight_bytes,
)


def facts(repo: str, variants: dict | None = None, context: int = 32768, **kw) -> ModelFacts:
    return ModelFacts.from_config(repo, shape_config(KNOWN_SHAPES[repo], context), variants=variants or {}, **kw)


LLAMA8B = "meta-llama/llama-3.1-8b-instruct"
QWEN7B = "qwen/qwen2.5-7b-instruct"
SMOL = "huggingfacetb/smollm2-135m-instruct"
VARIANTS = {"awq": "org/m-AWQ", "gptq": "org/m-GPTQ"}
CPU, GPU = "cpu", "cuda"


def dev(kind: str, gib: float) -> DeviceFacts:
    return DeviceFacts(kind, int(gib / 0.9 * GiB))  # plan() budgets 90% of what is free


# (model, variants, device, GiB budget, quant, ctx) -> (fits, precision, variant, label start)
CASES = [
    (SMOL, None, CPU, 20, "auto", None, (True, "float32", None, "float32")),
    (LLAMA8B, VARIANTS, CPU, 40, "auto", 8192, (True, "float32", None, "float32")),
    (LLAMA8B, VARIANTS, CPU, 20, "auto", 8192, (True, "bfloat16", None, "bfloat16")),
    (LLAMA8B, VARIANTS, CPU, 11, "auto", 8192, (True, "int4", "org/m-AWQ", "AWQ")),
    (LLAMA8B, {"gptq": "org/m-GPTQ"}, CPU, 11, "auto", 8192, (True, "int4", "org/m-GPTQ", "GPTQ")),
    (LLAMA8B, None, CPU, 14, "auto", 8192, (True, "int8", None, "int8")),
    (LLAMA8B, None, CPU, 11, "auto", 8192, (True, "int4", None, "int4")),
    (LLAMA8B, None, CPU, 6, "auto", 8192, (False, "int4", None, "int4")),
    (LLAMA8B, VARIANTS, GPU, 24, "auto", 8192, (True, "bfloat16", None, "bfloat16")),
    (LLAMA8B, VARIANTS, GPU, 8, "auto", 8192, (True, "int4", "org/m-AWQ", "AWQ")),
    (LLAMA8B, None, GPU, 8, "auto", 8192, (True, "int4", None, "int4")),  # no int8 kernel on GPU
    (LLAMA8B, VARIANTS, GPU, 24, "gptq", 8192, (True, "int4", "org/m-GPTQ", "GPTQ")),
    (LLAMA8B, VARIANTS, GPU, 24, "bf16", 131072, (False, "bfloat16", None, "bfloat16")),  # KV of 128k: 16 GiB
    (LLAMA8B, VARIANTS, GPU, 24, "auto", 131072, (True, "int4", "org/m-AWQ", "AWQ")),
    (QWEN7B, None, GPU, 12, "int8", 4096, (False, "int8", None, "int8")),  # int8 stays dense on GPU
]


@pytest.mark.parametrize("repo, variants, kind, gib, quant, ctx, want", CASES)
def test_plan_table(repo, variants, kind, gib, quant, ctx, want):
    f = facts(repo, variants, context=131072)
    p = plan(f, dev(kind, gib), quant, ctx)
    fits, precision, variant, label = want
    assert (p.fits, p.precision, p.variant) == (fits, precision, variant), p.reason
    assert p.label.startswith(label)
    budget = int(dev(kind, gib).available * 0.9)
    assert p.available_bytes == budget
    if fits:
        assert p.needed_bytes <= budget
        assert p.ctx == (ctx or p.ctx)
    else:
        assert p.needed_bytes > budget


def test_preferred_option_is_rejected_only_when_it_does_not_fit():
    """The choice is the FIRST that fits: every option before it needs more than the budget."""
    f = facts(LLAMA8B, VARIANTS)
    d = dev(CPU, 11)
    p = plan(f, d, "auto", 8192)
    budget = p.available_bytes
    for precision in ("float32", "bfloat16"):
        need = weight_bytes(f, precision, CPU) + kv_bytes(f, precision, CPU, 8192) + overhead_bytes(f)
        assert need > budget
        assert f"{precision} needs" in p.reason


def test_memory_model_numbers():
    """Independent arithmetic for Llama-3.1-8B: linears 6.98e9 params, embed+head 1.05e9."""
    f = facts(LLAMA8B)
    assert f.params == 8_030_261_248
    linear = 32 * (4096 * 128 * (2 * 32 + 2 * 8) + 3 * 4096 * 14336)
    assert f.linear_params == linear
    other = f.params - linear
    assert weight_bytes(f, "bfloat16", GPU) == 2 * f.params
    assert weight_bytes(f, "bfloat16", CPU) == 2 * linear + 4 * other  # embedding/head fp32 on CPU
    assert weight_bytes(f, "float32", CPU) == 4 * f.params
    assert weight_bytes(f, "awq", GPU) == int(linear * (0.5 + 4 / 128)) + 2 * other
    assert f.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, dim 128, fp16
    # what the engine allocates: 1000 tokens in 63 whole 16-token blocks, plus the null block
    assert kv_bytes(f, "bfloat16", GPU, 1000) == 131072 * 64 * 16
    assert kv_bytes(f, "int4", CPU, 1000) == 131072 * 64 * 16  # fp16 KV next to int4 weights on CPU
    assert kv_bytes(f, "float32", CPU, 1000) == 2 * 131072 * 64 * 16  # the exact fp32 path keeps an fp32 cache


def test_failure_message():
    f = facts(LLAMA8B)
    p = plan(f, dev(CPU, 4), "auto", None)
    assert not p.fits
    msg = p.reason
    w, kv, over = p.weights_bytes, p.kv_bytes, p.overhead_bytes
    assert msg.startswith(f"{LLAMA8B} needs >= {(w + kv + over) / GiB:.2f} GiB (weights {w / GiB:.2f} GiB")
    assert f"KV {kv / GiB:.2f} GiB at ctx {DEFAULT_CTX}" in msg
    assert "only 4.00 GiB available" in msg
    assert p.describe().startswith("plan: does not fit")


def test_context_grows_to_what_fits_without_ctx():
    f = facts(LLAMA8B, context=131072)
    p = plan(f, dev(GPU, 24), "auto", None)
    assert p.fits and p.precision == "bfloat16"
    spare = p.available_bytes - p.weights_bytes - p.overhead_bytes
    assert p.ctx % 256 == 0 and kv_bytes(f, "bfloat16", GPU, p.ctx) == p.kv_bytes <= spare
    assert spare < kv_bytes(f, "bfloat16", GPU, p.ctx + 256)
    # a smaller model is capped at its own context length
    small = plan(facts(SMOL, context=8192), dev(GPU, 24), "auto", None)
    assert small.ctx == 8192


def test_ctx_beyond_model_is_capped():
    p = plan(facts(SMOL, context=8192), dev(CPU, 20), "auto", 100_000)
    assert p.fits and p.ctx == 8192 and "capped" in p.reason


def test_native_checkpoints_load_as_they_are():
    f = facts(SMOL, native="gguf", native_bytes={"cpu": 200 << 20, "cuda": 150 << 20})
    p = plan(f, dev(CPU, 2), "auto", None)
    assert (p.fits, p.precision, p.weights_bytes) == (True, "auto", 200 << 20)
    assert not plan(f, dev(CPU, 0.3), "auto", None).fits
    with pytest.raises(PlanError, match="GGUF checkpoint"):
        plan(f, dev(CPU, 2), "awq")


def test_quant_errors_and_aliases():
    with pytest.raises(PlanError, match="no AWQ variant"):
        plan(facts(SMOL), dev(CPU, 20), "awq")
    assert [normalize_quant(q) for q in ("bf16", "fp16", "FP32", "q8", "rtn", "gptq")] == \
        ["bfloat16", "float16", "float32", "int8", "int4", "gptq"]
    with pytest.raises(ValueError, match="--quant must be one of"):
        normalize_quant("int3")


def test_known_shapes_match_the_registry():
    from localllm.registry import load_registry

    for spec in load_registry().models.values():
        if spec.kind != "generate":  # embedding models and rerankers are sized from their files, not planned
            continue
        f = known_facts(spec.repo)
        assert abs(f.params - spec.params) / spec.params < 1e-4, spec.name  # (a shape tuple holds no biases)


def test_parameter_counts_are_transformers_own():
    """Biases and sinks are counted (Qwen2's on q/k/v; gpt-oss's on every linear, its router and
    experts, a sink per head): our count of a config is transformers' on the meta device; gpt-oss's
    registry entries are sized from their published configs, whose counts are the model cards'."""
    import torch
    import transformers

    from localllm.config import ModelConfig
    from localllm.planner import KNOWN_CONFIGS
    from localllm.registry import load_registry

    qwen = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 896,
            "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
            "tie_word_embeddings": True}
    for hf, cls in [(qwen, transformers.Qwen2ForCausalLM),
                    *((c, transformers.GptOssForCausalLM) for c in KNOWN_CONFIGS.values())]:
        kw = {k: v for k, v in hf.items() if k not in ("architectures", "quantization_config")}
        with torch.device("meta"):
            model = cls(cls.config_class(**kw))
        assert ModelConfig.from_hf(hf).num_params == sum(p.numel() for p in model.parameters())
    assert ModelConfig.from_hf(qwen).num_params == load_registry().lookup("qwen2.5:0.5b").params
    for repo in KNOWN_CONFIGS:
        f = known_facts(repo)
        assert f.params == load_registry().lookup(repo).params and f.native == "mxfp4"


def test_gpt_oss_is_planned_before_its_download():
    """`localllm run gpt-oss:20b` plans from the published config before pulling 13 GB: the experts
    as the MXFP4 blocks the loader keeps, the rest 16-bit; where that does not fit, the run stops
    before any download and says what it needs."""
    from localllm.cli import app
    from localllm.planner import gib

    f = known_facts("openai/gpt-oss-20b")
    assert 13 * GiB < f.native_bytes["cpu"] < 14 * GiB  # 12.8 GB of blocks and bf16 tables + the head's int4 copy
    r = CliRunner().invoke(app, ["run", "gpt-oss:20b", "--dry-run", "--max-memory", "16", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("plan: MXFP4 as stored on cpu, ctx ")
    assert f"weights {gib(f.native_bytes['cpu'])}" in r.output
    r = CliRunner().invoke(app, ["run", "gpt-oss:20b", "--dry-run", "--max-memory", "8", "--device", "cpu"])
    assert r.exit_code == 1
    assert f"weights {gib(f.native_bytes['cpu'])} as MXFP4 as stored" in r.output and "only 8.00 GiB" in r.output
    from localllm.models_cli import list_models

    rows = {r["name"]: r for r in list_models() if r["repo"].startswith(("openai/", "meta-llama/"))}
    assert rows["gpt-oss-20b"]["variant"] == "mxfp4"  # the form the repo holds (downloaded or not)
    assert rows["llama3.2-1b"]["variant"] == "bf16"


def test_plan_for_the_embedded_model(gguf_path):
    p = plan_for("smollm2-135m", max_memory=4)
    assert p.fits and p.precision == "auto" and p.ctx == 8192
    assert 100 << 20 < p.weights_bytes < 400 << 20  # Q4_1 linears as int4, Q8_0 embedding as fp32
    assert p.describe().startswith("plan: GGUF as stored on cpu, ctx 8192")
    assert not plan_for(gguf_path, max_memory=0.2).fits
    # registry models are planned without a download (shapes table + params)
    q = plan_for("qwen2.5-7b", max_memory=64, device="cpu")
    assert q.fits and q.precision == "float32" and not q.estimated


def test_cli_dry_run():
    from localllm.cli import app

    r = CliRunner().invoke(app, ["run", "smollm2-135m", "--dry-run", "--max-memory", "4"])
    assert r.exit_code == 0, r.output
    assert "plan: GGUF as stored" in r.output and "why:" in r.output
    r = CliRunner().invoke(app, ["run", "llama3.1-8b", "--dry-run", "--max-memory", "3", "--device", "cpu"])
    assert r.exit_code == 1
    assert "needs >=" in r.output and "only 3.00 GiB available" in r.output
    r = CliRunner().invoke(app, ["run", "smollm2-135m", "--dry-run", "--quant", "int3"])
    assert r.exit_code == 2 and "--quant must be one of" in r.output


def test_a_16_bit_checkpoint_keeps_its_weights_on_cpu():
    """An HF bf16 checkpoint on CPU: its own 16-bit values on our kernel first (fp32 math, as
    precise as an fp32 copy at half the bytes; the embedding fp32, the head's int4 copy for greedy),
    then the smaller options; on GPU nothing changes."""
    f = facts(LLAMA8B, VARIANTS, stored16="bf16")
    linear, other = f.linear_params, f.params - f.linear_params
    p = plan(f, dev(CPU, 40), "auto", 8192)
    assert (p.fits, p.precision, p.variant) == (True, "auto", None)
    assert p.label == "16-bit weights (bf16 as stored, our kernel), fp32 activations"
    assert p.weights_bytes == 2 * linear + 4 * other + int(f.vocab * f.hidden * (0.5 + 4 / 32))
    assert p.kv_bytes == kv_bytes(f, "int4", CPU, 8192)  # a 16-bit KV cache, as beside int4/int8 weights
    small = plan(f, dev(CPU, 11), "auto", 8192)
    assert (small.precision, small.variant) == ("int4", "org/m-AWQ") and "16-bit weights" in small.reason
    assert plan(f, dev(CPU, 40), "fp32", 8192).weights_bytes == 4 * f.params  # --quant fp32: the fp32 copy
    assert plan(f, dev(GPU, 24), "auto", 8192).precision == "bfloat16"
