"""A tiny vision-language checkpoint written by transformers (tests/vision_models.py,
tests/test_vision_qwen.py) as what llama.cpp's converter makes of it: the text model's GGUF and
an mmproj GGUF, under llama.cpp's names (gguf-py's own tensor name table, the converter's), with
its clip.vision.* metadata. The vision tensors are stored as the converter stores them (F16
matrices, F32 norms, biases and embeddings); the checkpoint's own copies are rounded to the same
values first, so transformers runs on exactly the file's weights."""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
from safetensors.torch import load_file, save_file
from test_families import gguf_tensors, llama_qk_perm, tokenizer_fields, write_gguf

# family -> (llama.cpp's projector type, the text model's GGUF architecture)
PROJECTOR = {"gemma3": ("gemma3", "gemma3"), "idefics3": ("idefics3", "llama"),
             "qwen2.5-vl": ("qwen2.5vl_merger", "qwen2vl"), "qwen3-vl": ("qwen3vl_merger", "qwen3vl")}
# where each family's checkpoint (as transformers 5 saves it) keeps its text model
TEXT_PREFIXES = ("language_model.model.", "model.language_model.", "model.text_model.", "model.")
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_model.", "model.connector.", "visual.",
                   "model.visual.")


def is_vision(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def stored_f32(name: str) -> bool:
    """What the converter keeps in F32 in an F16 mmproj: 1-D tensors and the forced ones
    (SigLIP's embeddings, Qwen3-VL's position table)."""
    return ".embeddings." in name or "pos_embed" in name


def round_vision(hf_dir: Path) -> None:
    """The checkpoint's vision matrices rounded to fp16 (what the mmproj stores), in place."""
    f = hf_dir / "model.safetensors"
    state = load_file(f)
    for name, t in state.items():
        if is_vision(name) and t.dim() >= 2 and not stored_f32(name):
            state[name] = t.half().float()
    save_file(state, str(f), metadata={"format": "pt"})


def _text_config(cfg: dict, family: str) -> types.SimpleNamespace:
    """The text config as write_gguf reads it (attributes), transformers' defaults filled."""
    import transformers

    text = transformers.AutoConfig.for_model(**cfg).text_config
    ns = types.SimpleNamespace(**text.to_dict())
    ns.tie_word_embeddings = bool(cfg.get("tie_word_embeddings") or cfg["text_config"].get("tie_word_embeddings"))
    ns.rope_parameters = getattr(text, "rope_parameters", None)
    return ns


def tokenizer_metadata(hf_dir: Path, base_gguf: Path) -> list[tuple]:
    """The base model's tokenizer metadata (test_families.tokenizer_fields) with the checkpoint's
    added tokens (control tokens, as the converter marks special ones) and its processor's chat
    template."""
    import gguf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    out = []
    for key, val, vtype, sub in tokenizer_fields(base_gguf):
        n = len(val) if key == "tokenizer.ggml.tokens" else None
        if key == "tokenizer.ggml.tokens":
            val = list(val) + tok.convert_ids_to_tokens(list(range(n, len(tok))))
        elif key == "tokenizer.ggml.token_type":
            val = list(val) + [int(gguf.TokenType.CONTROL)] * (len(tok) - len(val))
        elif key == "tokenizer.ggml.scores":
            val = list(val) + [0.0] * (len(tok) - len(val))
        elif key == "tokenizer.chat_template":
            continue
        out.append((key, val, vtype, sub))
    out.append(("tokenizer.chat_template", (hf_dir / "chat_template.jinja").read_text(), gguf.GGUFValueType.STRING,
                None))
    return out


def write_text_gguf(hf_dir: Path, family: str, base_gguf: Path, out: Path, quantized: bool = False) -> Path:
    """The checkpoint's text model as the converter writes it (test_families.write_gguf)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = PROJECTOR[family][1]
    text = _text_config(cfg, family)
    state = {}
    for name, t in load_file(hf_dir / "model.safetensors").items():
        if is_vision(name):
            continue
        prefix = next((p for p in TEXT_PREFIXES if name.startswith(p)), None)
        name = name if name == "lm_head.weight" or prefix is None else "model." + name.removeprefix(prefix)
        if name.endswith("lm_head.weight"):
            name = "lm_head.weight"
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = llama_qk_perm(t, text.num_attention_heads if "q_proj" in name else text.num_key_value_heads)
        state[name] = t
    extra = {}
    if arch in ("qwen2vl", "qwen3vl"):
        extra[f"{arch}.rope.dimension_sections"] = [*text.rope_parameters["mrope_section"], 0]
    if arch == "qwen3vl":
        extra[f"{arch}.n_deepstack_layers"] = len(cfg["vision_config"].get("deepstack_visual_indexes") or [])
    model = types.SimpleNamespace(config=text)
    return write_gguf(model, arch, out, tokenizer_metadata(hf_dir, base_gguf), quantized=quantized, tensors=list(gguf_tensors(model, state, arch)),
                      extra_kv=extra)


def _mmproj_tensors(state: dict, family: str, cfg: dict):
    """(llama.cpp name, array) of the vision tensors, as convert_hf_to_gguf.py's MmprojModel
    subclasses rename and reshape them."""
    import gguf

    v = cfg["vision_config"]
    blocks = v.get("num_hidden_layers") or v.get("depth")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, blocks)
    deep = v.get("deepstack_visual_indexes") or []
    for name, t in state.items():
        if not is_vision(name):
            continue
        if family in ("gemma3", "idefics3"):
            if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
                name = name.replace("vision_tower.", "vision_tower.vision_model.", 1)  # the hub's layout
            name = name.replace("_weight", ".weight")
            if "soft_emb_norm.weight" in name:  # Gemma3RMSNorm's (1 + w)
                t = t + 1
            yield names.get_name(name, try_suffixes=(".weight", ".bias")), t
            continue
        name = name.replace("model.visual.", "visual.", 1)
        if name == "visual.patch_embed.proj.weight":  # Conv3d -> two Conv2d, one per frame
            yield "v.patch_embd.weight", t[:, :, 0]
            yield "v.patch_embd.weight.1", t[:, :, 1]
        elif name == "visual.patch_embed.proj.bias":
            yield "v.patch_embd.bias", t
        elif ".attn.qkv." in name and family == "qwen2.5-vl":  # split q, k, v
            for part, x in zip("qkv", t.chunk(3)):
                yield names.get_name(name.replace("qkv", part), try_suffixes=(".weight", ".bias")), x
        elif name.startswith("visual.deepstack_merger_list."):
            j, rest = name.split(".", 3)[2:]
            module, kind = rest.split(".")
            yield f"v.deepstack.{deep[int(j)]}.{ {'norm': 'norm', 'linear_fc1': 'fc1', 'linear_fc2': 'fc2'}[module]}.{kind}", t
        elif name.startswith("visual.merger."):
            module, kind = name.removeprefix("visual.merger.").rsplit(".", 1)
            target = {"ln_q": "v.post_ln", "norm": "v.post_ln", "mlp.0": "mm.0", "mlp.2": "mm.2", "linear_fc1": "mm.0",
                      "linear_fc2": "mm.2"}  # Qwen2.5-VL's merger.mlp.{0,2}, Qwen3-VL's linear_fc{1,2}
            yield f"{target[module]}.{kind}", t
        else:
            yield names.get_name(name, try_suffixes=(".weight", ".bias")), t


def write_mmproj(hf_dir: Path, family: str, out: Path, processor: dict, qtype: str = "F16") -> Path:
    """The checkpoint's vision tower and projector as llama.cpp's converter writes an mmproj:
    matrices in `qtype` (F16, or Q8_0 where a row is whole blocks), the rest F32."""
    import gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    v = cfg["vision_config"]
    text = cfg.get("text_config") or cfg
    kind, _ = PROJECTOR[family]
    w = gguf.GGUFWriter(str(out), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(kind)
    w.add_vision_projection_dim(text["hidden_size"])
    qwen = family.startswith("qwen")
    w.add_vision_image_size(v.get("image_size", 560))
    w.add_vision_patch_size(v["patch_size"])
    w.add_vision_embedding_length(v["hidden_size"])
    w.add_vision_feed_forward_length(v["intermediate_size"])
    w.add_vision_block_count(v.get("depth") or v["num_hidden_layers"])
    w.add_vision_head_count(v.get("num_heads") or v["num_attention_heads"])
    w.add_vision_image_mean(processor["image_mean"])
    w.add_vision_image_std(processor["image_std"])
    w.add_vision_attention_layernorm_eps(v.get("layer_norm_eps", 1e-6))
    if family == "gemma3":
        side = int(cfg["mm_tokens_per_image"] ** 0.5)
        w.add_vision_projector_scale_factor(v["image_size"] // v["patch_size"] // side)
    if family == "idefics3":
        w.add_vision_projector_scale_factor(cfg.get("scale_factor", 2))
        w.add_vision_preproc_image_size(processor["size"]["longest_edge"])
    if qwen:
        w.add_vision_spatial_merge_size(v["spatial_merge_size"])
        w.add_vision_min_pixels(processor["size"]["shortest_edge"])
        w.add_vision_max_pixels(processor["size"]["longest_edge"])
    if family == "qwen2.5-vl":
        full = v["fullatt_block_indexes"]
        w.add_vision_n_wa_pattern(full[0] + 1)
        w.add_vision_window_size(v["window_size"])
    if family == "qwen3-vl":
        deep = set(v.get("deepstack_visual_indexes") or [])
        w.add_vision_is_deepstack_layers([i in deep for i in range(v["depth"])])
    for name, t in _mmproj_tensors(load_file(hf_dir / "model.safetensors"), family, cfg):
        data = t.float().numpy()
        f32 = name.startswith("v.position_embd") or (not qwen and name.startswith("v.patch_embd"))
        if data.ndim >= 2 and not f32:
            if qtype == "Q8_0" and data.shape[-1] % 32 == 0:
                q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
                w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
                continue
            data = data.astype(np.float16)
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def image_processor_config(hf_dir: Path) -> dict:
    from localllm.model.vision.load import processor_config

    cfg = processor_config(hf_dir, full=True)
    return cfg.get("image_processor", cfg)


def write_pair(hf_dir: Path, family: str, base_gguf: Path, out_dir: Path) -> tuple[Path, Path]:
    """(text GGUF, mmproj GGUF) side by side in out_dir, as a pulled GGUF repo holds them; the
    checkpoint's vision matrices rounded to the mmproj's F16 values first."""
    out_dir.mkdir(parents=True, exist_ok=True)
    round_vision(hf_dir)
    mmproj = write_mmproj(hf_dir, family, out_dir / f"mmproj-{family}-F16.gguf", image_processor_config(hf_dir))
    text = write_text_gguf(hf_dir, family, base_gguf, out_dir / f"{family}-F32.gguf")
    return text, mmproj
