"""Qwen2.5-VL against transformers (fp32) on a tiny random checkpoint written by transformers with
its own config classes: the image processor's pixel inputs for two images of different sizes,
the vision tower, the M-RoPE positions and the language model rotating with them, and greedy
decoding with the images in the prompt."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from localllm.config import ModelConfig
from localllm.model.attention import describe_batch
from localllm.model.hf_weights import HFWeights
from localllm.model.loader import load_model
from localllm.model.vision.qwen_vl import QwenVisionConfig, load_qwen_vision, mrope_positions
from localllm.model.vision.qwen_vl_processor import QwenImageProcessing, preprocess

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

IMAGE, VIDEO, START, END = 49150, 49151, 49148, 49149  # placeholder ids inside the real tokenizer's vocabulary
# small enough for a fast tower, big enough that both images span several attention windows
PIXELS = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 40)


def images() -> list[Image.Image]:
    """Two images of different sizes and aspect ratios, one with transparency."""
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (90, 130, 3), dtype=np.uint8)),
            Image.fromarray(rng.integers(0, 256, (200, 64, 4), dtype=np.uint8), "RGBA")]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, fp32_model):
    """(transformers model, its directory): 2 text layers (head_dim 16, mrope_section 2/3/3), a
    3-block tower (block 1 full attention, the others windows of 2x2 merged tokens)."""
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=56, out_hidden_size=64,
                           fullatt_block_indexes=[1]),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # peaked logits (no greedy near-ties), norms away from 1
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name or "ln_q" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) * (2 if "language_model" in name else 1) / fan_in ** 0.5)
    out = tmp_path_factory.mktemp("qwen-vl") / "tiny-qwen2.5-vl"
    model.save_pretrained(out, safe_serialization=True)
    fp32_model.tokenizer.save_hf(out)
    return model, out


def reference_inputs(grids: list) -> tuple[list[int], list[int]]:
    """A prompt with both images (each vision_start, its placeholder run, vision_end) between text
    tokens, and where each run starts."""
    ids, starts = [1, 300, 301], []
    for n, (t, h, w) in enumerate(grids):
        ids.append(START)
        starts.append(len(ids))
        ids += [IMAGE] * (t * h * w // 4) + [END, 400 + n, 401 + n]
    return ids + [500, 501, 502], starts


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


def test_tower_equals_transformers(checkpoint):
    model, path = checkpoint
    ref = Qwen2VLImageProcessorPil(**PIXELS)(images=images(), return_tensors="pt")
    tower = load_qwen_vision(HFWeights(path))
    with torch.no_grad():
        want = model.model.visual(ref["pixel_values"], grid_thw=ref["image_grid_thw"]).pooler_output
    got = tower(ref["pixel_values"], [tuple(g) for g in ref["image_grid_thw"].tolist()])
    assert got.shape == want.shape == (15 + 14, 64)
    assert (got - want).abs().max() < 1e-4 * max(1.0, want.abs().max().item())


def test_mrope_positions_equal_get_rope_index(checkpoint):
    model = checkpoint[0]
    grids = [(1, 6, 10), (1, 14, 4)]
    ids, starts = reference_inputs(grids)
    t = torch.tensor([ids])
    want, delta = model.model.get_rope_index(t, (t == IMAGE).int(), image_grid_thw=torch.tensor(grids))
    got, d = mrope_positions(len(ids), list(zip(starts, grids)), 2)
    assert torch.equal(got, want[:, 0]) and d == delta.item() < 0
    with pytest.raises(ValueError, match="runs past"):
        mrope_positions(10, [(5, (1, 6, 10))], 2)


def run_prompt(loaded, embeds: torch.Tensor, positions: torch.Tensor, kv, blocks: torch.Tensor) -> torch.Tensor:
    """The model's layers on given input embeddings with a fresh cache (what the engine's embed
    step hands them for a prompt with images) -> logits [T, V]."""
    m = loaded.model
    T = embeds.shape[0]
    _, meta = describe_batch(blocks, [T], [T], 16)
    x, residual = embeds, None
    for layer, c in zip(m.layers, kv):
        x, residual = m.run_layer(layer, x, residual, positions, meta, c)
    return m.logits(m.ops.add_norm(x, residual, m.norm)[0])


def test_language_model_with_images_equals_transformers(checkpoint):
    """Logits with both images in the prompt within 1e-3 of transformers (our tower's embeddings at
    the placeholders, [3, T] M-RoPE positions), then 32 greedy tokens equal to its generate(),
    decoding at text positions + rope delta ([T] positions, the plain RoPE path)."""
    model, path = checkpoint
    loaded = load_model(path, "float32")
    assert loaded.config.mrope_section == (2, 3, 3) and loaded.config.qkv_bias
    ref_in = Qwen2VLImageProcessorPil(**PIXELS)(images=images(), return_tensors="pt")
    grids = [tuple(g) for g in ref_in["image_grid_thw"].tolist()]
    ids, starts = reference_inputs(grids)
    t = torch.tensor([ids])
    with torch.no_grad():
        want = model(input_ids=t, pixel_values=ref_in["pixel_values"], image_grid_thw=ref_in["image_grid_thw"],
                     mm_token_type_ids=(t == IMAGE).int()).logits[0]
        gen = model.generate(input_ids=t, pixel_values=ref_in["pixel_values"], image_grid_thw=ref_in["image_grid_thw"],
                             mm_token_type_ids=(t == IMAGE).int(), attention_mask=torch.ones_like(t),
                             max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    tower = load_qwen_vision(HFWeights(path))
    m = loaded.model
    embeds = m.embed_tokens(t[0])
    embeds[t[0] == IMAGE] = tower(ref_in["pixel_values"], grids)
    positions, delta = mrope_positions(len(ids), list(zip(starts, grids)), 2)
    kv = m.new_kv_cache(16, 16, torch.float32)
    blocks = torch.arange(1, 16).view(1, -1)
    logits = run_prompt(loaded, embeds, positions, kv, blocks)
    assert (logits - want).abs().max() < 1e-3
    out = [int(logits[-1].argmax())]
    while len(out) < 32:
        n = len(ids) + len(out)
        pos, meta = describe_batch(blocks, [1], [n], 16)
        hidden = m(torch.tensor(out[-1:]), pos + delta, meta, kv)
        out.append(int(m.logits(hidden)[-1].argmax()))
    assert out == gen


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
