"""Images in, text out, on the engine: tiny random Gemma3ForConditionalGeneration and
Idefics3ForConditionalGeneration (SmolVLM) checkpoints written by transformers (their config
classes, models and processors) against transformers fp32 itself."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import make_engine
from vision_models import gemma3, huge_png, idefics3, png_bytes, prefill_logits, random_image

from localllm.model.loader import load_model
from localllm.model.vision import ImageInputError
from localllm.model.vision.images import decode_image
from localllm.sampling import SamplingParams

# two images of different sizes and shapes (the processor resizes both to the tower's 64x64)
IMAGES = [random_image(0, 70, 50), random_image(1, 40, 90)]


def parts(*items) -> list[dict]:
    """A user turn of text and image parts: a str is text, anything else an image."""
    return [{"type": "text", "text": x} if isinstance(x, str) else {"type": "image", "image": x} for x in items]


def hf_parts(content: list[dict]) -> list[dict]:
    return [p if p["type"] == "text" else {"type": "image"} for p in content]


FAMILIES = {"gemma3": (gemma3, transformers.Gemma3ForConditionalGeneration),
            "idefics3": (idefics3, transformers.Idefics3ForConditionalGeneration)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def g3(request, tmp_path_factory, fp32_model):
    """(HF dir, transformers model, its processor, our loaded model) of one family."""
    write, cls = FAMILIES[request.param]
    d = write(tmp_path_factory.mktemp("vision") / request.param, fp32_model.tokenizer)
    ref = cls.from_pretrained(d).eval()
    return d, ref, transformers.AutoProcessor.from_pretrained(d), load_model(d, "float32")


def reference_inputs(proc, messages: list[dict], images: list):
    hf = [{**m, "content": hf_parts(m["content"])} if isinstance(m["content"], list) else m for m in messages]
    text = proc.apply_chat_template(hf, add_generation_prompt=True, tokenize=False)
    return proc(text=text, images=images, return_tensors="pt")


MESSAGES = [{"role": "user", "content": parts(IMAGES[0], "Describe this one", IMAGES[1], "and compare.")}]


def test_pixel_inputs_and_prompt_equal_the_processor(g3):
    d, _, proc, loaded = g3
    ref = reference_inputs(proc, MESSAGES, IMAGES)
    ours = torch.cat([loaded.vision.prepare(im).pixel_values for im in IMAGES])
    want = ref["pixel_values"].reshape(ours.shape)  # Idefics3's: [1, tiles of both images, 3, S, S]
    assert ours.dtype == want.dtype and torch.equal(ours, want)
    prompt = make_engine(loaded).encode_prompt(MESSAGES)
    assert prompt.ids == ref["input_ids"][0].tolist()
    if "token_type_ids" in ref:  # Gemma 3: the spans are the token_type_ids == 1 runs
        types = ref["token_type_ids"][0].tolist()
        assert [i for i, t in enumerate(types) if t] == [p for s in prompt.images for p in range(s.offset, s.end)]
    else:  # Idefics3: an image's tiles, and its tile markers between them
        assert len(prompt.images) == 2 and prompt.images[0].length > prompt.images[0].pixels.n_tokens


def test_logits_equal_transformers_with_images(g3):
    _, ref, proc, loaded = g3
    inputs = reference_inputs(proc, MESSAGES, IMAGES)
    with torch.no_grad():
        want = ref(**inputs).logits[0].float()
    got = prefill_logits(make_engine(loaded), make_engine(loaded).encode_prompt(MESSAGES))
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    if "token_type_ids" in inputs:  # Gemma 3's bidirectional mask matters (its window is 8, an image 16)
        with torch.no_grad():
            causal = ref(**{k: v for k, v in inputs.items() if k != "token_type_ids"}).logits[0].float()
        assert (causal - want).abs().max() > 1e-2


def test_images_on_a_q8_0_kv_cache(g3):
    """--kv-type q8_0: the image spans' dense pass reads the 8-bit blocks (dequantized) as the
    kernels do: logits close to the fp32 cache's (q8_0 rounding only; 8-bit values of this tiny
    model's peaked K/V move its logits by up to ~1%). A head dim q8_0 cannot block is refused."""
    _, _, _, loaded = g3
    if loaded.config.head_dim % 32:  # the tiny SmolVLM's 16
        with pytest.raises(ValueError, match="multiple of 32"):
            make_engine(loaded, kv_type="q8_0")
        return
    f32 = prefill_logits(make_engine(loaded, kv_type="f32"), make_engine(loaded).encode_prompt(MESSAGES))
    q8 = prefill_logits(make_engine(loaded, kv_type="q8_0"), make_engine(loaded).encode_prompt(MESSAGES))
    assert torch.nn.functional.cosine_similarity(q8, f32, dim=-1).min() > 0.995
    assert (q8 - f32).abs().max() > 0  # the cache really held 8-bit values


def test_greedy_tokens_equal_transformers_batched_with_text(g3):
    """32 greedy tokens equal transformers' generate, alone and in one batch with a text-only
    request (whose tokens equal its own run alone)."""
    _, ref, proc, loaded = g3
    inputs = reference_inputs(proc, MESSAGES, IMAGES)
    with torch.no_grad():
        out = ref.generate(**inputs, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    want = out[0, inputs["input_ids"].shape[1]:].tolist()
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    engine = make_engine(loaded)
    text = [{"role": "user", "content": "Say something about the sea."}]
    alone = [o for o in engine.generate(text, params)][-1].token_ids
    a = engine.add_request(MESSAGES, params)
    b = engine.add_request(text, params)
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    assert engine.stats["max_batch_size"] == 2
    assert done[a] == want
    assert done[b] == alone


def test_second_turn_reuses_the_image(g3):
    """The next chat turn keeps the image in its history: no second vision forward, and its
    prompt is served from the prefix cache past the image."""
    _, _, _, loaded = g3
    engine = make_engine(loaded)
    params = SamplingParams(temperature=0, max_tokens=8)
    turn1 = [{"role": "user", "content": parts(IMAGES[0], "What is this?")}]
    reply = [o for o in engine.generate(turn1, params)][-1]
    assert engine.runner.vision_encodes == 1
    turn2 = turn1 + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "And its colour?"}]
    prompt = engine.encode_prompt(turn2)
    last = [o for o in engine.generate(turn2, params)][-1]
    assert engine.runner.vision_encodes == 1 and engine.cache_stats()["vision_encodes"] == 1
    assert last.num_cached_tokens >= prompt.images[0].end // 16 * 16 > 0


def test_a_different_image_shares_no_kv(g3):
    """The same placeholder ids behind another image: the prefix cache stops at the image."""
    _, _, _, loaded = g3
    engine = make_engine(loaded)
    params = SamplingParams(temperature=0, max_tokens=4)
    first = [o for o in engine.generate([{"role": "user", "content": parts(IMAGES[0], "What?")}], params)][-1]
    msgs = [{"role": "user", "content": parts(IMAGES[1], "What?")}]
    prompt = engine.encode_prompt(msgs)
    second = [o for o in engine.generate(msgs, params)][-1]
    assert second.num_cached_tokens <= prompt.images[0].offset
    assert engine.runner.vision_encodes == 2
    fresh = make_engine(loaded)  # and its tokens are its own, as on an empty cache
    assert [o for o in fresh.generate(msgs, params)][-1].token_ids == second.token_ids != first.token_ids


def test_chunked_prefill_keeps_images_whole(g3):
    """A 20-token budget (a Gemma image is 16 tokens, an Idefics3 one 54 or 90): chunks end before
    an image or run to its end, and the tokens equal a one-chunk prefill's."""
    _, _, _, loaded = g3
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    whole = [o for o in make_engine(loaded).generate(MESSAGES, params)][-1].token_ids
    engine = make_engine(loaded, max_num_batched_tokens=20)
    rid = engine.add_request(MESSAGES, params)
    seq = engine._seqs[rid]
    chunks, out = [], None
    while out is None:
        before = seq.num_computed_tokens
        for o in engine.step():
            out = o if o.finished else out
        if before < seq.num_prompt_tokens:
            chunks.append((before, seq.num_computed_tokens))
    assert len(chunks) > 2
    for a, e in chunks:
        assert not any(im.offset < e < im.end or im.offset < a < im.end for im in seq.images)
    assert out.token_ids == whole


def test_text_only_model_refuses_images(fp32_model):
    with pytest.raises(ImageInputError, match="takes no images"):
        make_engine(fp32_model).encode_prompt([{"role": "user", "content": parts(IMAGES[0], "What?")}])


def test_bad_images_name_the_problem():
    png = png_bytes(IMAGES[0])
    with pytest.raises(ImageInputError, match="truncated or corrupt"):
        decode_image(png[: len(png) // 2])
    with pytest.raises(ImageInputError, match="not an image"):
        decode_image(b"hello, this is text")
    with pytest.raises(ImageInputError, match="too large: Image size \\(400000000 pixels\\)"):
        decode_image(huge_png(20000, 20000))  # Pillow's own guard
    with pytest.raises(ImageInputError, match="too large: 9000x9000 pixels"):
        decode_image(huge_png(9000, 9000))  # under Pillow's guard, over ours
    assert decode_image(png).size == (70, 50)


def test_image_paths_in_a_prompt(tmp_path):
    """Ollama's CLI convention: a word that is an existing image file is taken out and attached."""
    from localllm.model.vision.images import images_in_prompt

    photo = tmp_path / "photo.png"
    photo.write_bytes(png_bytes(IMAGES[0]))
    assert images_in_prompt(f"What is in {photo}? And in '{photo}'") == ("What is in ? And in", [str(photo)])
    assert images_in_prompt(f"What is in {tmp_path / 'none.png'}?") == (f"What is in {tmp_path / 'none.png'}?", [])
