"""A BERT (or nomic-bert) embedding model's HF directory -> a GGUF under llama.cpp's `bert` (`nomic-bert`) names, written with the
gguf package as llama.cpp's converter (convert_hf_to_gguf.py, BertModel) writes it: the WordPiece
vocabulary in phantom-space form (a word-initial piece gets "▁", a "##" continuation loses it),
the special-token ids, the pooling type from the sentence-transformers files, F32 tensors.

    python bench/make_embed_gguf.py [HF_DIR] [--out FILE]   # default: the embedded all-minilm

Used by bench/embed_throughput.py to run llama.cpp's embedding mode on the same weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

# llama.cpp's enum llama_pooling_type
POOLING = {"mean": 1, "cls": 2, "last": 3}
def phantom(token: str, special: set[str]) -> str:
    if token in special:
        return token
    return token[2:] if token.startswith("##") else "\u2581" + token


def _nomic_tensors(w, src: Path, cfg) -> None:
    """nomic-bert's tensors under the names llama.cpp's converter gives them (gguf-py's own table,
    from the original remote-code names: Wqkv, fc11 up, fc12 gate, fc2, norm1, norm2, emb_ln)."""
    import gguf

    from localllm.model.encoder_loader import _Tensors

    t = _Tensors(src)  # a transformers-written checkpoint is mapped back to the original names
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.NOMIC_BERT, cfg.num_layers)
    names = ["embeddings.word_embeddings.weight", "embeddings.token_type_embeddings.weight", "emb_ln.weight",
             "emb_ln.bias"]
    for i in range(cfg.num_layers):
        p = f"encoder.layers.{i}."
        names += [p + m + ".weight" for m in ("attn.Wqkv", "attn.out_proj", "mlp.fc11", "mlp.fc12", "mlp.fc2")]
        names += [p + m + k for m in ("norm1", "norm2") for k in (".weight", ".bias")]
    for name in names:
        gname = table.get_name(name, try_suffixes=(".weight", ".bias"))
        w.add_tensor(gname, np.ascontiguousarray(t.get(name).numpy().astype(np.float32)))


def write_bert_gguf(src: Path, out: Path) -> Path:
    import gguf
    from safetensors.numpy import load_file

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from localllm.model.bert import BertConfig
    from localllm.model.encoder_loader import GGUF_BERT_LAYER, GGUF_BERT_NAMES, sentence_transformers_settings

    names = {hf: g for g, hf in GGUF_BERT_NAMES.items()}
    layer = {hf: g for g, hf in GGUF_BERT_LAYER.items()}

    raw = json.loads((src / "config.json").read_text())
    cfg = BertConfig.from_hf(raw)
    pooling, _ = sentence_transformers_settings(src, cfg)
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok.get("added_tokens", []) if a.get("special")}
    nomic = cfg.model_type == "nomic_bert"
    w = gguf.GGUFWriter(str(out), "nomic-bert" if nomic else "bert")
    w.add_name(src.name)
    if nomic:
        w.add_rope_freq_base(cfg.rope_theta)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_layers)
    w.add_head_count(cfg.num_heads)
    w.add_layer_norm_eps(cfg.layer_norm_eps)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType(POOLING[pooling.mode]))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_token_type_count(cfg.type_vocab_size)
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("jina-v2-en")
    w.add_token_list([phantom(t, special) for t in tokens])
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    ids = {t: vocab[t] for t in ("[CLS]", "[SEP]", "[UNK]", "[PAD]", "[MASK]") if t in vocab}
    w.add_bos_token_id(ids["[CLS]"])
    w.add_eos_token_id(ids["[SEP]"])
    w.add_sep_token_id(ids["[SEP]"])
    w.add_unk_token_id(ids["[UNK]"])
    w.add_pad_token_id(ids.get("[PAD]", 0))
    if "[MASK]" in ids:
        w.add_mask_token_id(ids["[MASK]"])
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)
    w.add_bool("tokenizer.ggml.add_sep_token", False)
    lower = (tok.get("normalizer") or {}).get("lowercase", True)
    w.add_bool("tokenizer.ggml.normalizer.lowercase", bool(lower))
    if nomic:
        _nomic_tensors(w, src, cfg)
    tensors = {}
    for f in ([] if nomic else sorted(src.glob("*.safetensors"))):
        tensors.update(load_file(str(f)))
    prefix = "bert." if "bert.embeddings.word_embeddings.weight" in tensors else ""
    for name, t in tensors.items():
        if not name.startswith(prefix) or name.endswith("position_ids") or ".pooler." in name or \
                name.startswith(prefix + "pooler."):
            continue
        key = name[len(prefix):]
        if key in names:
            gname = names[key]
        else:
            _, _, i, rest = key.split(".", 3)  # encoder.layer.{i}.{module}.{weight|bias}
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{layer[module]}.{kind}"
        w.add_tensor(gname, np.ascontiguousarray(t.astype(np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", nargs="?", help="HF directory (default: the embedded all-minilm)")
    ap.add_argument("--out", help="output file (default: <name>-f32.gguf here)")
    a = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from localllm.registry import resolve_model

    src = Path(a.src) if a.src else resolve_model("all-minilm").local_path
    out = Path(a.out or f"{'all-minilm' if not a.src else src.name}-f32.gguf")
    print(write_bert_gguf(src, out))


if __name__ == "__main__":
    main()
