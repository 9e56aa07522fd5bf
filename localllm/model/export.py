"""Write any checkpoint we can load as a Hugging Face directory (config.json, model.safetensors,
tokenizer files), with weights dequantized. Used to make test fixtures and for interop."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import checkpoint_linears
from .moe import expert_tensor_names
from .weights import open_weights


def hf_tensor_names(num_layers: int, tied: bool, qkv_bias: bool, qk_norm: bool = False,
                    fused: bool = False) -> list[str]:
    """fused: Phi-3's qkv_proj / gate_up_proj instead of separate q/k/v and gate/up."""
    names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if tied else ["lm_head.weight"])
    linears = checkpoint_linears(fused)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + m + ".weight" for ms in linears.values() for m in ms]
        if qkv_bias:
            names += [p + m + ".bias" for m in linears["qkv"]]
        if qk_norm:
            names += [p + f"self_attn.{m}_norm.weight" for m in "qk"]
    return names


def export_hf(src: str | os.PathLike, out: str | os.PathLike, dtype: torch.dtype = torch.float32,
              num_layers: int | None = None) -> Path:
    """`num_layers` keeps only the first layers (small fixtures for fast tests)."""
    w = open_weights(src)
    cfg = w.config
    if cfg.sandwich_norms or cfg.mrope_section:  # Gemma's four norms per layer, (1 + w) and windows,
        # Qwen-VL's M-RoPE and vision tower are not written back
        raise ValueError(f"{src}: exporting a {cfg.architecture} model as a Hugging Face checkpoint is not supported")
    if num_layers is not None:
        cfg.num_layers = num_layers
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    names = hf_tensor_names(cfg.num_layers, cfg.tie_word_embeddings, cfg.qkv_bias, cfg.qk_norm, cfg.fused_checkpoint)
    linears = checkpoint_linears(cfg.fused_checkpoint)
    for i in filter(cfg.is_moe_layer, range(cfg.num_layers)):  # router and experts instead of the MLP
        mlp = {f"model.layers.{i}.{m}.weight" for m in (*linears["gate_up"], *linears["down"])}
        router, experts = expert_tensor_names(cfg, i)
        names = [n for n in names if n not in mlp] + [router, *(n for e in experts for n in e)]
    tensors = {n: w.dense(n).to(dtype).contiguous() for n in names}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok = w.tokenizer()
    hf = cfg.to_hf()
    hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    hf["bos_token_id"], hf["eos_token_id"] = tok.bos_id, tok.eos_id
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_id, "eos_token_id": sorted(tok.eos_ids)}, indent=2))
    tok.save_hf(out)
    return out


def hf_checkpoint_dir(src: str | os.PathLike, cache: str | os.PathLike, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Where hf_checkpoint_of keeps the GGUF `src`'s checkpoint (whether or not it is there)."""
    from .convert_cache import weights_fingerprint

    src = Path(src)
    return Path(cache) / f"{src.stem}-{weights_fingerprint(src, 'hf-export', dtype)[:16]}"


def hf_checkpoint_of(src: str | os.PathLike, cache: str | os.PathLike,
                     dtype: torch.dtype = torch.bfloat16) -> tuple[Path, bool]:
    """-> (an HF checkpoint of the GGUF `src`, whether it was written now): for engines that read
    only HF checkpoints (vLLM). Written once per file under `cache`, keyed like the conversion cache
    (the file's path, size and mtime), into a temporary folder renamed into place, so an interrupted
    export leaves nothing a later run would take for whole. bf16 by default: vLLM computes in bf16
    on CPU and GPU alike, and a 7B GGUF written in fp32 would take 28 GB of disk."""
    out = hf_checkpoint_dir(src, cache, dtype)
    if (out / "config.json").is_file():
        return out, False
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        export_hf(src, tmp, dtype)
        try:
            tmp.rename(out)
        except OSError:  # another process wrote it first: theirs is as good
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out, True
