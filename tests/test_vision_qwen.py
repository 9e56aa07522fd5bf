"""Qwen2.5-VL against transformers (fp32) on a tiny random checkpoint written by transformers with
its own config classes: the image processor's pixel inputs for two images of different sizes,
the vision tower, the M-RoPE positions and the language model rotating with them, and greedy
decoding with the images in the prompt."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import make_engine
from PIL import Image
from vision_models import prefill_logits

from localllm.config import ModelConfig
from localllm.model.loader import load_model
from localllm.model.vision.qwen_vl import QwenVisionConfig, mrope_positions
from localllm.model.vision.qwen_vl_processor import QwenImageProcessing, preprocess
from localllm.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

# small enough for a fast tower, big enough that both images span several attention windows
PIXELS = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 40)
QWEN_TOKENS = {"vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>",
               "image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
# Qwen2.5-VL-Instruct's chat template as published (chat_template.json)
QWEN_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")


def images() -> list[Image.Image]:
    """Two images of different sizes and aspect ratios, one with transparency."""
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (90, 130, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 256, (200, 64, 4), dtype=np.uint8), "RGBA")]


def peak(model: torch.nn.Module) -> None:
    """Random weights with peaked logits (no greedy near-ties), norms away from 1."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name or "ln_q" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (2 if "language_model" in name else 1) / p[0].numel() ** 0.5)


def image_only(base):
    """transformers' Qwen-VL processor class without its video processor (which needs torchvision,
    not installed here): the same prompt expansion and image inputs."""

    class ImageProcessor(base):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            # the tokens (and ids) the base __init__ would set (Qwen3-VL's reads the vision start/end too)
            for name, token in QWEN_TOKENS.items():
                setattr(self, name, token)
                setattr(self, name + "_id", tokenizer.convert_tokens_to_ids(token))
            transformers.ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageProcessor


# per family: its transformers classes, the tower and the processor's settings. Qwen2.5-VL: 2
# text layers (qkv biases), a 3-block tower (block 1 full attention, the others windows of 2x2
# merged tokens). Qwen3-VL: 3 text layers (q/k norms, interleaved M-RoPE), a 3-block tower with a
# 4x4 position table and deepstack features after blocks 0 and 1 (joining text layers 0 and 1).
FAMILIES = {
    "qwen2.5-vl": dict(
        config=lambda: transformers.Qwen2_5_VLConfig, model=lambda: transformers.Qwen2_5_VLForConditionalGeneration,
        processor=lambda: transformers.Qwen2_5_VLProcessor, layers=2, rope={}, text={}, pixels=PIXELS,
        vision=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14, spatial_merge_size=2,
                    temporal_patch_size=2, window_size=56, out_hidden_size=64, fullatt_block_indexes=[1])),
    "qwen3-vl": dict(
        config=lambda: transformers.Qwen3VLConfig, model=lambda: transformers.Qwen3VLForConditionalGeneration,
        processor=lambda: transformers.Qwen3VLProcessor, layers=3, rope={"mrope_interleaved": True},
        text={"head_dim": 16},
        pixels=dict(PIXELS, patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3),
        vision=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=16, spatial_merge_size=2,
                    temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                    deepstack_visual_indexes=[0, 1])),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory, fp32_model):
    return write_checkpoint(request.param, tmp_path_factory.mktemp("qwen-vl") / request.param, fp32_model.tokenizer)


def write_checkpoint(name: str, out, tokenizer) -> tuple:
    """(transformers model, its processor, its directory): the real SmolLM2 tokenizer with Qwen's
    vision tokens added; the family's tiny model (FAMILIES, head_dim 16, mrope_section 2/3/3),
    saved with its processor (Pillow image processor, Qwen2.5-VL's published chat template)."""
    fam = FAMILIES[name]
    out.mkdir()
    tokenizer.save_hf(out)
    base = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    base.add_special_tokens({"additional_special_tokens": list(QWEN_TOKENS.values()) + ["<|im_start|>", "<|im_end|>"]})
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, bos_token=base.bos_token,
                                               eos_token=base.eos_token, extra_special_tokens=QWEN_TOKENS)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in QWEN_TOKENS.items()}
    cfg = fam["config"]()(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=fam["layers"],
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, **fam["text"],
                         rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_id, eos_token_id=sorted(tokenizer.eos_ids),
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0,
                                          **fam["rope"]}),
        vision_config=fam["vision"],
        image_token_id=ids["image_token"], video_token_id=ids["video_token"],
        vision_start_token_id=ids["vision_start_token"], vision_end_token_id=ids["vision_end_token"])
    model = fam["model"]()(cfg).eval()
    peak(model)
    model.save_pretrained(out, safe_serialization=True)
    processor = image_only(fam["processor"]())(image_processor=Qwen2VLImageProcessorPil(**fam["pixels"]),
                                               tokenizer=tok, chat_template=QWEN_VL_TEMPLATE)
    processor.save_pretrained(out)
    return model, processor, out


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_model(checkpoint[2], "float32")


def parts(*items) -> list[dict]:
    """A user turn of text and image parts: a str is text, anything else an image."""
    return [{"type": "text", "text": x} if isinstance(x, str) else {"type": "image", "image": x} for x in items]


MESSAGES = [{"role": "user", "content": parts(images()[0], "Describe this one", images()[1], "and compare.")}]


def reference_inputs(proc, messages: list[dict], imgs: list):
    """transformers' processor on the same chat: input_ids, pixel_values, image_grid_thw, mm_token_type_ids."""
    hf = [{**m, "content": [p if p["type"] == "text" else {"type": "image"} for p in m["content"]]}
          if isinstance(m["content"], list) else m for m in messages]
    text = proc.apply_chat_template(hf, add_generation_prompt=True, tokenize=False)
    return proc(text=text, images=imgs, return_tensors="pt")


def test_processor_pixels_equal_transformers():
    ours = QwenImageProcessing(**PIXELS)
    ref = Qwen2VLImageProcessorPil(**PIXELS)(images=images(), return_tensors="pt")
    mine = [preprocess(im, ours) for im in images()]
    assert [g for _, g in mine] == [tuple(g) for g in ref["image_grid_thw"].tolist()] == [(1, 6, 10), (1, 14, 4)]
    assert torch.equal(torch.cat([p for p, _ in mine]), ref["pixel_values"])  # bit-exact
    assert [ours.num_tokens(im.height, im.width) for im in images()] == [15, 14]


def test_processor_settings_from_preprocessor_config():
    hub = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
           "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
    v5 = {"size": {"shortest_edge": 3136, "longest_edge": 12845056}, "patch_size": 14, "merge_size": 2}
    assert QwenImageProcessing.from_hf(hub) == QwenImageProcessing.from_hf(v5) == \
        QwenImageProcessing(max_pixels=12845056)
    with pytest.raises(ValueError, match="aspect ratio"):
        QwenImageProcessing().grid(10, 2100)


def test_tower_equals_transformers(checkpoint, loaded):
    model, proc, _ = checkpoint
    ref = proc.image_processor(images=images(), return_tensors="pt")
    with torch.no_grad():
        out = model.model.visual(ref["pixel_values"], grid_thw=ref["image_grid_thw"])
    want = out.pooler_output
    if getattr(out, "deepstack_features", None):  # Qwen3-VL: [tokens, 1 + deepstack, hidden]
        want = torch.stack([want, *out.deepstack_features], dim=1)
    grids = [tuple(g) for g in ref["image_grid_thw"].tolist()]
    got = loaded.vision.tower(ref["pixel_values"], grids)
    assert got.shape == want.shape and got.shape[0] == sum(t * h * w // 4 for t, h, w in grids)
    assert (got - want).abs().max() < 1e-4 * max(1.0, want.abs().max().item())


def test_pixel_inputs_and_prompt_equal_the_processor(checkpoint, loaded):
    _, proc, _ = checkpoint
    ref = reference_inputs(proc, MESSAGES, images())
    ours = [loaded.vision.prepare(im) for im in images()]
    assert torch.equal(torch.cat([p.pixel_values for p in ours]), ref["pixel_values"])
    assert [p.extra["grid"] for p in ours] == [tuple(g) for g in ref["image_grid_thw"].tolist()]
    prompt = make_engine(loaded).encode_prompt(MESSAGES)
    assert prompt.ids == ref["input_ids"][0].tolist()
    types = ref["mm_token_type_ids"][0].tolist()  # the image tokens, in order
    assert [i for i, t in enumerate(types) if t] == [p for s in prompt.images for p in range(s.offset, s.end)]


def test_mrope_positions_equal_get_rope_index(checkpoint, loaded):
    """The positions of the whole prompt, of any chunk of it and of the tokens after it (index +
    delta: [T] positions, no image in range) equal transformers' get_rope_index / rope_deltas."""
    model, proc, _ = checkpoint
    ref = reference_inputs(proc, MESSAGES, images())
    want, delta = model.model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"],
                                             image_grid_thw=ref["image_grid_thw"])
    want, delta = want[:, 0], int(delta)
    prompt = make_engine(loaded).encode_prompt(MESSAGES)
    T, v = len(prompt.ids), loaded.vision
    assert delta < 0 and torch.equal(v.positions(prompt.images, 0, T), want)
    s0, s1 = prompt.images
    assert torch.equal(v.positions(prompt.images, s0.offset, s1.end - s0.offset), want[:, s0.offset:s1.end])
    assert torch.equal(v.positions(prompt.images, s1.end, T - s1.end), want[0, s1.end:])  # text after the images
    assert torch.equal(v.positions(prompt.images, T + 3, 2), torch.arange(T + 3, T + 5) + delta)
    with pytest.raises(ValueError, match="runs past"):
        mrope_positions(10, [(5, (1, 6, 10))], 2)


def test_logits_equal_transformers_with_images(checkpoint, loaded):
    model, proc, _ = checkpoint
    inputs = reference_inputs(proc, MESSAGES, images())
    with torch.no_grad():
        want = model(**inputs).logits[0]
        # M-RoPE matters here: the same inputs rotated at plain positions
        plain = model(**inputs, position_ids=torch.arange(inputs["input_ids"].shape[1])[None]).logits[0]
    engine = make_engine(loaded)
    got = prefill_logits(engine, engine.encode_prompt(MESSAGES))
    assert (got - want).abs().max() < 1e-3
    assert (plain - want).abs().max() > 1e-2


def generate_reference(model, inputs, n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def run_all(engine, requests: dict) -> dict:
    ids = {engine.add_request(msgs, params): key for key, (msgs, params) in requests.items()}
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[ids[o.request_id]] = o
    return done


def test_greedy_tokens_equal_transformers_batched_with_text(checkpoint, loaded):
    """32 greedy tokens equal transformers' generate (decode at index + rope delta), in one batch
    with a text-only request whose tokens equal its own run alone."""
    model, proc, _ = checkpoint
    want = generate_reference(model, reference_inputs(proc, MESSAGES, images()), 32)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    engine = make_engine(loaded)
    text = [{"role": "user", "content": "Say something about the sea."}]
    alone = [o for o in engine.generate(text, params)][-1].token_ids
    done = run_all(engine, {"image": (MESSAGES, params), "text": (text, params)})
    assert engine.stats["max_batch_size"] == 2
    assert done["image"].token_ids == want
    assert done["text"].token_ids == alone


def test_second_turn_reuses_the_images(checkpoint, loaded):
    """The next turn keeps both images in its history: no second vision forward, its prompt served
    from the prefix cache past the images, its tokens equal transformers' on the whole chat."""
    model, proc, _ = checkpoint
    engine = make_engine(loaded)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reply = [o for o in engine.generate(MESSAGES, params)][-1]
    assert engine.runner.vision_encodes == 2
    turn2 = MESSAGES + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "Which is larger?"}]
    prompt = engine.encode_prompt(turn2)
    last = [o for o in engine.generate(turn2, params)][-1]
    assert engine.runner.vision_encodes == 2
    assert last.num_cached_tokens >= prompt.images[1].end // 16 * 16 > 0
    assert last.token_ids == generate_reference(model, reference_inputs(proc, turn2, images()), 8)


def test_chunked_prefill_positions_follow_the_images(loaded):
    """Chunks of 12 tokens (images of 15 and 14 tokens run whole): the chunks' M-RoPE positions
    are the prompt's, so the tokens equal a one-chunk prefill's."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    whole = [o for o in make_engine(loaded).generate(MESSAGES, params)][-1].token_ids
    engine = make_engine(loaded, max_num_batched_tokens=12)
    assert [o for o in engine.generate(MESSAGES, params)][-1].token_ids == whole


@pytest.mark.slow  # ~13 s a family: a localllm process each (the front end is tests/test_vision_server.py's)
def test_cli_run_with_an_image(checkpoint, loaded, tmp_path):
    """The real `localllm run DIR --image FILE PROMPT` answers as the in-process engine (held to
    transformers above) on the decoded file."""
    photo = tmp_path / "photo.png"
    images()[0].save(photo)
    question = "What is in this picture?"
    msgs = [{"role": "user", "content": parts(Image.open(photo).convert("RGB"), question)}]
    want = [o for o in make_engine(loaded).generate(msgs, SamplingParams(temperature=0, max_tokens=8))][-1].text
    r = subprocess.run([sys.executable, "-m", "localllm.cli", "run", str(checkpoint[2]), "--temperature", "0",
                        "-n", "8", "--image", str(photo), question], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and r.stdout == want + "\n", r.stderr


def test_hub_configs_read_as_transformers():
    """Qwen2.5-VL-3B-Instruct's config.json as published (flat text fields, rope_scaling mrope),
    and the same in transformers 5's nested layout."""
    hub = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
           "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
           "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
           "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 11008,
           "max_position_embeddings": 128000, "max_window_layers": 70, "num_attention_heads": 16,
           "num_hidden_layers": 36, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
           "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
           "use_sliding_window": False, "vocab_size": 151936,
           "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                             "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                             "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                             "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                             "temporal_patch_size": 2},
           "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}
    ref = transformers.Qwen2_5_VLConfig(**hub)
    nested = ref.to_dict()
    for raw in (hub, nested):
        c = ModelConfig.from_hf(json.loads(json.dumps(raw)))
        tc = ref.text_config
        assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size) == \
            (tc.hidden_size, tc.num_hidden_layers, tc.num_attention_heads, tc.num_key_value_heads,
             tc.intermediate_size, tc.vocab_size)
        assert c.head_dim == 128 and c.rope_theta == tc.rope_parameters["rope_theta"] == 1e6
        assert c.mrope_section == tuple(tc.rope_parameters["mrope_section"]) == (16, 24, 24)
        assert c.rope_scaling is None and c.sliding_window is None and c.qkv_bias and c.tie_word_embeddings
        v = QwenVisionConfig.from_hf(raw["vision_config"])
        rv = ref.vision_config
        assert (v.depth, v.hidden_size, v.num_heads, v.out_hidden_size, v.window_size, v.in_channels) == \
            (rv.depth, rv.hidden_size, rv.num_heads, rv.out_hidden_size, rv.window_size, rv.in_channels)
        assert v.fullatt_block_indexes == tuple(rv.fullatt_block_indexes)


def test_qwen3_vl_hub_config_reads_as_transformers():
    """Qwen3-VL-4B-Instruct's config.json as published (nested, rope_scaling with interleaved
    sections, rope_theta beside it)."""
    hub = {"architectures": ["Qwen3VLForConditionalGeneration"], "image_token_id": 151655, "model_type": "qwen3_vl",
           "text_config": {"attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
                           "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
                           "hidden_size": 2560, "initializer_range": 0.02, "intermediate_size": 9728,
                           "max_position_embeddings": 262144, "model_type": "qwen3_vl_text",
                           "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
                           "rms_norm_eps": 1e-06, "rope_scaling": {"mrope_interleaved": True,
                                                                   "mrope_section": [24, 20, 20],
                                                                   "rope_type": "default"},
                           "rope_theta": 5000000, "tie_word_embeddings": True, "use_cache": True,
                           "vocab_size": 151936},
           "tie_word_embeddings": True, "video_token_id": 151656, "vision_end_token_id": 151653,
           "vision_start_token_id": 151652,
           "vision_config": {"deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh",
                             "hidden_size": 1024, "in_channels": 3, "initializer_range": 0.02,
                             "intermediate_size": 4096, "model_type": "qwen3_vl", "num_heads": 16,
                             "num_position_embeddings": 2304, "out_hidden_size": 2560, "patch_size": 16,
                             "spatial_merge_size": 2, "temporal_patch_size": 2}}
    ref = transformers.Qwen3VLConfig(**json.loads(json.dumps(hub)))
    tc, rv = ref.text_config, ref.vision_config
    c = ModelConfig.from_hf(hub)
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == \
        (tc.hidden_size, tc.num_hidden_layers, tc.num_attention_heads, tc.num_key_value_heads, tc.head_dim,
         tc.intermediate_size)
    assert c.rope_theta == tc.rope_parameters["rope_theta"] == 5e6 and c.rope_scaling is None
    assert c.mrope_section == tuple(tc.rope_parameters["mrope_section"]) and c.mrope_interleaved
    assert c.qk_norm and not c.qkv_bias and c.tie_word_embeddings
    v = QwenVisionConfig.from_hf(hub["vision_config"], qwen3=True)
    assert (v.depth, v.hidden_size, v.num_heads, v.out_hidden_size, v.patch_size, v.num_position_embeddings) == \
        (rv.depth, rv.hidden_size, rv.num_heads, rv.out_hidden_size, rv.patch_size, rv.num_position_embeddings)
    assert v.deepstack_visual_indexes == tuple(rv.deepstack_visual_indexes)
    assert v.fullatt_block_indexes == tuple(range(24))  # every layer full attention


def test_mrope_rotation_equals_transformers_on_every_rope_op():
    """[3, T] positions rotate q/k as transformers' Qwen2_5_VLRotaryEmbedding + apply_rotary_pos_emb,
    through the torch op and the Triton kernel (interpreted on CPU); [T] positions stay plain RoPE."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf

    from localllm.model.layers import RotaryEmbedding
    from localllm.model.llama import rope_fused, rope_torch

    cfg = transformers.Qwen2_5_VLTextConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                            rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6],
                                                             "rope_theta": 10000.0})
    T, H, KVH, D = 7, 4, 2, 32
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g)
    pos = torch.stack([torch.tensor([0, 1, 2, 2, 2, 5, 6]), torch.tensor([0, 1, 2, 2, 3, 5, 6]),
                       torch.tensor([0, 1, 2, 3, 2, 5, 6])])
    cos, sin = hf.Qwen2_5_VLRotaryEmbedding(cfg)(qkv, pos[:, None])
    q, k = qkv[:, :H * D].view(T, H, D), qkv[:, H * D:(H + KVH) * D].view(T, KVH, D)
    want_q, want_k = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    rope = RotaryEmbedding(D, 64, 10000.0, None, torch.float32, mrope_section=(4, 6, 6))
    for op in (rope_torch, rope_fused):
        table, p = rope.at(pos)
        got_q, got_k = op(p, q.clone(), k.clone(), table)
        torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    # text positions: the three rows equal, the same as [T] positions through the plain table
    text = torch.arange(T)
    t3, p3 = rope.at(text.expand(3, -1))
    assert rope.at(text)[0] is rope
    assert all(torch.equal(a, b) for a, b in zip(rope_torch(p3, q, k, t3), rope_torch(text, q, k, rope)))
    with pytest.raises(ValueError, match="sums to"):
        RotaryEmbedding(D, 64, 10000.0, None, torch.float32, mrope_section=(4, 6, 5))
