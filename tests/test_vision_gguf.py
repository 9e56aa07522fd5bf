"""The four vision families from a GGUF + mmproj pair (what users pull from Ollama or the hub's
*-GGUF repos): each tiny random checkpoint of tests/test_vision.py and tests/test_vision_qwen.py
written as llama.cpp's converter writes it (tests/vision_gguf.py: the text model's GGUF, an F16
mmproj beside it), loaded by `load_model(text.gguf)` (the mmproj found beside it), against
transformers fp32 on the same (F16-rounded) weights."""

from __future__ import annotations

import shutil

import pytest
import test_vision
import test_vision_qwen
import torch
import transformers
from conftest import make_engine
from vision_gguf import write_mmproj, write_pair
from vision_models import gemma3, idefics3, prefill_logits

from localllm.model.errors import ModelLoadError
from localllm.model.loader import load_model
from localllm.model.vision.mmproj import Mmproj, load_mmproj
from localllm.sampling import SamplingParams

# family -> (checkpoint writer: (dir, tokenizer) -> (transformers class, processor), its chat, its images)
FAMILIES = {
    "gemma3": (lambda d, tok: (transformers.Gemma3ForConditionalGeneration, None, gemma3(d, tok)),
               test_vision.MESSAGES, test_vision.IMAGES),
    "idefics3": (lambda d, tok: (transformers.Idefics3ForConditionalGeneration, None, idefics3(d, tok)),
                 test_vision.MESSAGES, test_vision.IMAGES),
    **{name: (lambda d, tok, name=name: (test_vision_qwen.FAMILIES[name]["model"](),
                                         *test_vision_qwen.write_checkpoint(name, d, tok)[1:]),
              test_vision_qwen.MESSAGES, test_vision_qwen.images()) for name in test_vision_qwen.FAMILIES},
}
# the default run holds one family end to end; the other three run in the slow suite
FAST = "gemma3"


def family_params():
    return [pytest.param(f, marks=() if f == FAST else pytest.mark.slow) for f in FAMILIES]


@pytest.fixture(scope="module", params=family_params())
def pair(request, tmp_path_factory, fp32_model, gguf_path):
    """(family, transformers model on the files' weights, its processor, our model loaded from the
    text GGUF, the mmproj's path, the chat, the images)."""
    name = request.param
    write, messages, images = FAMILIES[name]
    root = tmp_path_factory.mktemp("vision-gguf")
    cls, proc, hf_dir = write(root / "hf", fp32_model.tokenizer)
    text, mmproj = write_pair(hf_dir, name, gguf_path, root / "gguf")
    ref = cls.from_pretrained(hf_dir).eval()
    proc = proc or transformers.AutoProcessor.from_pretrained(hf_dir)
    return name, ref, proc, load_model(text, "float32"), mmproj, messages, images


def test_pixel_inputs_and_prompt_equal_the_processor(pair):
    """The mmproj's sizes and mean/std give the processor's pixels; the text GGUF's tokenizer and
    template the processor's prompt ids."""
    name, _, proc, loaded, _, messages, images = pair
    assert loaded.vision is not None and loaded.vision.family == name.replace(".", "_").replace("-", "_")
    ref = test_vision.reference_inputs(proc, messages, images)
    ours = torch.cat([loaded.vision.prepare(im).pixel_values for im in images])
    assert torch.equal(ours, ref["pixel_values"].reshape(ours.shape))
    assert make_engine(loaded).encode_prompt(messages).ids == ref["input_ids"][0].tolist()


def test_logits_equal_transformers_with_images(pair):
    _, ref, proc, loaded, _, messages, images = pair
    inputs = test_vision.reference_inputs(proc, messages, images)
    with torch.no_grad():
        want = ref(**inputs).logits[0].float()
    engine = make_engine(loaded)
    got = prefill_logits(engine, engine.encode_prompt(messages))
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)


def test_greedy_tokens_equal_transformers_batched_with_text(pair):
    """32 greedy tokens equal transformers' generate, in one batch with a text-only request whose
    tokens equal its own run alone."""
    _, ref, proc, loaded, _, messages, images = pair
    want = test_vision_qwen.generate_reference(ref, test_vision.reference_inputs(proc, messages, images), 32)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    engine = make_engine(loaded)
    text = [{"role": "user", "content": "Say something about the sea."}]
    alone = [o for o in engine.generate(text, params)][-1].token_ids
    done = test_vision_qwen.run_all(engine, {"image": (messages, params), "text": (text, params)})
    assert engine.stats["max_batch_size"] == 2
    assert done["image"].token_ids == want
    assert done["text"].token_ids == alone


def test_second_turn_reuses_the_images(pair):
    """The next turn keeps the images in its history: no second vision forward (counted), its
    prompt served from the prefix cache past them."""
    _, _, _, loaded, _, messages, images = pair
    engine = make_engine(loaded)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reply = [o for o in engine.generate(messages, params)][-1]
    assert engine.runner.vision_encodes == len(images)
    turn2 = messages + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "Which is larger?"}]
    prompt = engine.encode_prompt(turn2)
    last = [o for o in engine.generate(turn2, params)][-1]
    assert engine.runner.vision_encodes == len(images)
    assert last.num_cached_tokens >= prompt.images[-1].end // 16 * 16 > 0


def test_mmproj_errors_name_the_problem(pair, tmp_path):
    name, _, _, loaded, mmproj, _, _ = pair
    text = loaded.source
    with pytest.raises(ModelLoadError, match="is not an mmproj file"):
        load_model(text, "float32", mmproj=text)
    mm = Mmproj(mmproj)
    other = "llama" if mm.text_arch != "llama" else "gemma3"
    with pytest.raises(ModelLoadError, match=f"is not for a '{other}' text model"):
        load_mmproj(mmproj, other, loaded.config.hidden_size, loaded.tokenizer, "cpu", torch.float32)
    with pytest.raises(ModelLoadError, match="projects to width"):
        load_mmproj(mmproj, mm.text_arch, loaded.config.hidden_size + 1, loaded.tokenizer, "cpu", torch.float32)
    shutil.copy(text, tmp_path / "model.gguf")
    for n in ("mmproj-a.gguf", "mmproj-b.gguf"):
        shutil.copy(mmproj, tmp_path / n)
    with pytest.raises(ModelLoadError, match="holds 2 mmproj files"):
        load_model(tmp_path / "model.gguf", "float32")
    # named explicitly, one of them loads
    assert load_model(tmp_path / "model.gguf", "float32", mmproj=tmp_path / "mmproj-a.gguf").vision.family == \
        loaded.vision.family


def test_q8_0_mmproj_reads_as_gguf_py_dequantizes(pair, tmp_path):
    """Q8_0 matrices (some mmproj files are): each tensor equal to gguf-py's own reader's
    dequantization; the tower built from them embeds images close to the F16 file's."""
    import gguf

    name, _, proc, loaded, mmproj, _, images = pair
    from vision_gguf import image_processor_config

    hf_dir = next(mmproj.parent.parent.glob("hf*"))
    q8 = write_mmproj(hf_dir, name, tmp_path / "mmproj-q8.gguf", image_processor_config(hf_dir), qtype="Q8_0")
    ours = Mmproj(q8)
    reader = gguf.GGUFReader(str(q8))
    kinds = set()
    for t in reader.tensors:
        kinds.add(t.tensor_type.name)
        want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(ours.tensor(t.name).shape)
        assert torch.equal(ours.tensor(t.name), want.float()), t.name
    assert "Q8_0" in kinds
    v8 = load_mmproj(q8, ours.text_arch, loaded.config.hidden_size, loaded.tokenizer, "cpu", torch.float32)
    pixels = [v8.prepare(images[0])]
    a, b = v8.encode(pixels)[0], loaded.vision.encode(pixels)[0]
    assert not torch.equal(a, b) and torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99


def test_show_names_the_mmproj(pair, tmp_path):
    """`localllm show` (and /api/show's vision capability) on the text GGUF: images in, by the
    mmproj beside it; the text GGUF alone is a text model."""
    from localllm.models_cli import describe, format_show

    _, _, _, loaded, mmproj, _, _ = pair
    info = describe(loaded.source)
    assert info["vision"] is True and info["mmproj"] == str(mmproj)
    assert f"images in (the vision tower of {mmproj})" in format_show(info)
    alone = tmp_path / "text.gguf"
    shutil.copy(loaded.source, alone)
    assert describe(str(alone))["vision"] is False and load_model(alone, "float32").vision is None


@pytest.mark.slow  # ~15 s: a localllm process
def test_cli_run_with_mmproj_and_an_image(pair, tmp_path):
    """The real `localllm run MODEL.gguf --mmproj FILE --image PHOTO PROMPT`, the text GGUF moved
    away from its mmproj, answers as the in-process engine (held to transformers above)."""
    import os
    import subprocess
    import sys

    from PIL import Image

    _, _, _, loaded, mmproj, _, images = pair
    model = tmp_path / "model.gguf"
    shutil.copy(loaded.source, model)
    photo = tmp_path / "photo.png"
    images[0].save(photo)
    question = "What is in this picture?"
    msgs = [{"role": "user", "content": test_vision.parts(Image.open(photo).convert("RGB"), question)}]
    want = [o for o in make_engine(loaded).generate(msgs, SamplingParams(temperature=0, max_tokens=8))][-1].text
    r = subprocess.run([sys.executable, "-m", "localllm.cli", "run", str(model), "--mmproj", str(mmproj),
                        "--quant", "float32", "--temperature", "0", "-n", "8", "--image", str(photo), question],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == want.strip()
    r = subprocess.run([sys.executable, "-m", "localllm.cli", "run", str(model), "--image", str(photo), question],
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode != 0 and "takes no images" in r.stderr


def held_bytes(obj, seen: set | None = None) -> int:
    """Bytes of the distinct tensor storages reachable from obj's attributes (modules, lists,
    dicts): what a loaded VisionModel holds."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        s = obj.untyped_storage()
        if s.data_ptr() in seen:
            return 0
        seen.add(s.data_ptr())
        return s.nbytes()
    if isinstance(obj, torch.nn.Module):
        return sum(held_bytes(t, seen) for t in (*obj.parameters(recurse=False), *obj.buffers(recurse=False))) + \
            sum(held_bytes(v, seen) for k, v in vars(obj).items() if not k.startswith("_")) + \
            sum(held_bytes(m, seen) for m in obj.children())
    if isinstance(obj, (list, tuple)):
        return sum(held_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(held_bytes(x, seen) for x in obj.values())
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("localllm.model.vision"):
        return sum(held_bytes(v, seen) for v in vars(obj).values())
    return 0


def test_planner_counts_the_vision_tower(pair):
    """The planner's vision bytes (the mmproj's tensors for the GGUF, the checkpoint's vision
    tensors for the HF directory; fp32 on CPU) equal what the loaded tower holds (Qwen's rotary
    frequency table aside, computed, not read), and a plan's weights count them."""
    from localllm.planner import facts_for_path, vision_bytes, weight_bytes

    _, _, _, loaded, mmproj, _, _ = pair
    v = loaded.vision
    computed = v.tower.inv_freq.nbytes if hasattr(v.tower, "inv_freq") else 0
    gguf = facts_for_path(loaded.source)
    hf = facts_for_path(next(mmproj.parent.parent.glob("hf*")))
    assert gguf.vision_params == hf.vision_params > 0
    assert vision_bytes(gguf, "auto", "cpu") == held_bytes(v) - computed
    assert vision_bytes(gguf, "bfloat16", "cpu") * 2 == vision_bytes(gguf, "auto", "cpu")
    text_only = facts_for_path(loaded.source, mmproj=None)
    text_only.vision_params = 0
    assert weight_bytes(gguf, "auto", "cpu") - weight_bytes(text_only, "auto", "cpu") == held_bytes(v) - computed
