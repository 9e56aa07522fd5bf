"""A gpt-oss GGUF (bench/make_gguf.py gpt-oss-20b) rewritten as openai/gpt-oss-20b is published on
the hub: safetensors shards (one a layer) under transformers' names, the experts as MXFP4 blocks and
E8M0 scales (gate_up_proj_blocks [E, 2I, H / 32, 16], gate and up rows interleaved), every other
matrix, the router, embedding and head in bf16, quant_method mxfp4 in config.json, the GGUF's
tokenizer as tokenizer.json. The experts hold the GGUF's values exactly (the same codes and scales);
the Q8_0 matrices are rounded to bf16.

    python bench/gpt_oss_hf.py FILE.gguf OUT_DIR

Used for BENCHMARKS.md's HF-checkpoint rows (`bench/compare.py --model OUT_DIR --engines localllm`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localllm.model.gguf_weights import GGUFWeights  # noqa: E402


def hf_mxfp4(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF MXFP4 blocks uint8 [..., K / 32, 17] -> the checkpoint's (blocks [..., K / 32, 16], scales
    [..., K / 32]): its byte j holds values 2j (low nibble) and 2j + 1; GGUF's byte j values j and j + 16."""
    qs = raw[..., 1:]
    codes = torch.cat([qs & 15, qs >> 4], dim=-1)  # value order
    return codes[..., 0::2] | (codes[..., 1::2] << 4), raw[..., 0].contiguous()


def convert(src: Path, out: Path) -> None:
    w = GGUFWeights(src)
    c = w.config
    out.mkdir(parents=True, exist_ok=True)
    n, shards, index = c.num_layers, [], {}

    def bf16(name: str) -> torch.Tensor:
        return w.dense(name).to(torch.bfloat16).contiguous()

    for i in range(n + 1):
        t: dict[str, torch.Tensor] = {}
        if i == n:  # the last shard: embedding, final norm, head
            t = {"model.embed_tokens.weight": bf16("model.embed_tokens.weight"),
                 "model.norm.weight": bf16("model.norm.weight"), "lm_head.weight": bf16("lm_head.weight")}
        else:
            p = f"model.layers.{i}."
            for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
                for kind in ("weight", "bias"):
                    t[f"{p}self_attn.{m}.{kind}"] = bf16(f"{p}self_attn.{m}.{kind}")
            t[p + "self_attn.sinks"] = bf16(p + "self_attn.sinks.weight")
            for norm in ("input_layernorm", "post_attention_layernorm"):
                t[f"{p}{norm}.weight"] = bf16(f"{p}{norm}.weight")
            t[p + "mlp.router.weight"], t[p + "mlp.router.bias"] = bf16(p + "mlp.gate.weight"), bf16(p + "mlp.gate.bias")
            parts = {}
            for part in ("gate", "up", "down"):
                g = w.file.tensors[f"blk.{i}.ffn_{part}_exps.weight"]
                e, rows, k = g.shape
                raw = torch.from_numpy(w.file.read(g)).view(e, rows, k // 32, 17)
                parts[part] = hf_mxfp4(raw)
                bias = w.file.tensors[f"blk.{i}.ffn_{part}_exps.bias"]
                assert bias.qtype.name == "F32", bias.qtype.name
                parts[part + "_bias"] = torch.from_numpy(w.file.read(bias)).view(torch.float32)
            for j, suffix in enumerate(("blocks", "scales")):
                gate, up = parts["gate"][j], parts["up"][j]
                t[f"{p}mlp.experts.gate_up_proj_{suffix}"] = torch.stack([gate, up], dim=2).flatten(1, 2).contiguous()
                t[f"{p}mlp.experts.down_proj_{suffix}"] = parts["down"][j]
            gb, ub = parts["gate_bias"].view(e, -1), parts["up_bias"].view(e, -1)
            t[p + "mlp.experts.gate_up_proj_bias"] = torch.stack([gb, ub], dim=2).flatten(1).to(torch.bfloat16)
            t[p + "mlp.experts.down_proj_bias"] = parts["down_bias"].view(e, -1).to(torch.bfloat16)
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(t, out / name, metadata={"format": "pt"})
        index.update(dict.fromkeys(t, name))
        shards.append(name)
        print(f"{name}: {len(t)} tensors", flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    rope = c.rope_scaling
    config = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "hidden_size": c.hidden_size, "intermediate_size": c.moe_intermediate_size, "head_dim": c.head_dim,
        "num_hidden_layers": n, "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "num_local_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok, "experts_per_token": c.num_experts_per_tok,
        "layer_types": ["sliding_attention" if c.layer_windows[j] else "full_attention" for j in range(n)],
        "sliding_window": next(x for x in c.layer_windows if x), "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "swiglu_limit": c.swiglu_limit,
        "rope_scaling": {k: rope[k] for k in ("rope_type", "factor", "beta_fast", "beta_slow",
                                               "original_max_position_embeddings", "truncate")},
        "tie_word_embeddings": False, "vocab_size": c.vocab_size, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    w.tokenizer().save_hf(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out", type=Path)
    a = ap.parse_args()
    convert(a.gguf, a.out)


if __name__ == "__main__":
    main()
