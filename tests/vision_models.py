"""Tiny random vision-language checkpoints written by transformers itself (its own config
classes, model and processor): the real SmolLM2 tokenizer with the family's image tokens added."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}


def _tokenizer(base_dir: Path, special: dict[str, str], extra: list[str]):
    """The SmolLM2 tokenizer (written by localllm into base_dir) with the image tokens added as
    special tokens, and the family's names for them (boi_token, image_token, ...)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(base_dir)
    tok.add_special_tokens({"additional_special_tokens": list(special.values()) + extra})
    return PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, bos_token=tok.bos_token,
                                   eos_token=tok.eos_token, extra_special_tokens=special)


def peak(model: torch.nn.Module, seed: int = 1) -> None:
    """Random weights scaled so logits are peaked (greedy near-ties would make token-exact
    comparisons flaky), norm weights away from their identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm weights around 1, biases around 0
                p.copy_(0.3 * torch.randn(p.shape, generator=g) + (1.0 if name.endswith("weight") else 0.0))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 2 / p[0].numel() ** 0.5)


def gemma3(out: Path, tokenizer) -> Path:
    """Gemma3ForConditionalGeneration: a 6-layer text model (its own head: a tied one at these
    sizes only echoes the last token; five sliding layers of window 8, so
    the 16-token images cross windows), a 2-layer SigLIP tower on 64x64 images (8x8 patches),
    16 tokens per image; saved with its Gemma3Processor (the published Gemma 3 chat template)."""
    import transformers

    from localllm.family_templates import builtin_template

    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_hf(out)
    tok = _tokenizer(out, GEMMA3_TOKENS, ["<start_of_turn>", "<end_of_turn>"])
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in GEMMA3_TOKENS.items()}
    text = transformers.Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6, sliding_window=8,
        query_pre_attn_scalar=32, eos_token_id=sorted(tokenizer.eos_ids), bos_token_id=tokenizer.bos_id,
        pad_token_id=0, tie_word_embeddings=False, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=64, patch_size=8, vision_use_head=False)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16,
                                    boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
                                    image_token_index=ids["image_token"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    peak(model)
    model.save_pretrained(out)
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 64, "width": 64}), tokenizer=tok,
        chat_template=builtin_template("gemma3"), image_seq_length=16)
    processor.save_pretrained(out)
    return out


def random_image(seed: int, width: int, height: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                   *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))]
# SmolVLM's chat template as published (HuggingFaceTB/SmolVLM-Instruct)
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'][0]['type'] == "
    "'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' "
    "%}{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def idefics3(out: Path, tokenizer) -> Path:
    """Idefics3ForConditionalGeneration (SmolVLM): a 2-layer Llama text model, a 2-layer tower on
    32x32 tiles (4x4 patches, 64 per tile, 16 tokens after the 2x pixel shuffle), images resized
    to a longest edge of 64 and split into up to 2x2 tiles and a global one; saved with its
    Idefics3Processor and SmolVLM's chat template."""
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_hf(out)
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(out)
    tok.add_special_tokens({"additional_special_tokens": IDEFICS3_TOKENS})
    text = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                    eos_token_id=sorted(tokenizer.eos_ids), bos_token_id=tokenizer.bos_id,
                                    pad_token_id=0)
    vision = transformers.Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=2, image_size=32, patch_size=4)
    cfg = transformers.Idefics3Config(text_config=text, vision_config=vision, scale_factor=2,
                                      image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(cfg).eval()
    peak(model)
    model.save_pretrained(out)
    ip = transformers.Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    transformers.Idefics3Processor(image_processor=ip, tokenizer=tok, image_seq_len=16,
                                   chat_template=SMOLVLM_TEMPLATE).save_pretrained(out)
    return out


def huge_png(width: int, height: int) -> bytes:
    """A PNG header claiming width x height 1-bit pixels and no pixel data: what a decompression
    bomb's first bytes say (a decoder must refuse it by its size, before reading any pixels)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)) + \
        chunk(b"IEND", b"")


def prefill_logits(engine, prompt) -> torch.Tensor:
    """Logits at every prompt position (an ImagePrompt), the prompt as one prefill through the runner."""
    from localllm.engine.sequence import Sequence
    from localllm.sampling import SamplingParams

    seq = Sequence("logits", prompt.ids, SamplingParams(), 1)
    seq.images = prompt.images
    engine.block_manager.allocate(seq, len(prompt.ids))
    try:
        return engine.runner.model.logits(engine.runner.forward_hidden([seq], [len(prompt.ids)])).float()
    finally:
        engine.block_manager.free_seq(seq)
