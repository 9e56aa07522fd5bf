"""Time to first token for one 896x896 image: our engine against llama.cpp's mtmd path
(llama-cpp-python's MTMDChatHandler) on the same GGUF + mmproj pair.

    python bench/vision_ttft.py make DIR          # the pair, once (random weights, ~3.6 GB)
    python bench/vision_ttft.py ours DIR [--threads 2]
    python bench/vision_ttft.py llama DIR [--threads 2]
    python bench/vision_ttft.py compare DIR [--threads 2] [--runs 3]   # the two interleaved, medians

The pair: Gemma 3 4B's vision side at its real shape (SigLIP so400m, 27 layers, 896x896 -> 4096
patches, pooled to 256 tokens, projected to 2560) written by transformers with random weights
and converted as tests/vision_gguf.py does (llama.cpp's converter names, F16 mmproj); the text
model is Gemma 3 4B's whole shape (34 layers, hidden 2560, 8 heads, 4 KV heads, head_dim 256,
intermediate 10240, 262,144-token vocabulary) written by bench/make_gguf.py as the default
model is stored (Q4_1 matrices, Q8_0 embedding), with the tests' SmolLM2 tokenizer carrying
Gemma 3's image tokens. One process per measurement (`ours` / `llama`): the model is loaded, a warm-up
request is run on another image, then one request with a fresh image (no image cache hit), one
token out; printed: TTFT wall seconds and the process's CPU seconds over that request.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' checkpoint writers (vision_models, vision_gguf)
sys.path.insert(0, str(ROOT / "bench"))  # make_gguf

LAYERS = 2  # of the transformers checkpoint's text model: only its tokenizer and vision side are kept
PROMPT = "Describe this image."


def image_png(seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (896, 896, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def make(out: Path) -> None:
    import gguf
    import make_gguf
    import torch
    import transformers
    from vision_gguf import write_pair
    from vision_models import GEMMA3_TOKENS, _tokenizer

    from localllm.family_templates import builtin_template
    from localllm.model.loader import load_model
    from localllm.registry import resolve_model

    base = resolve_model("smollm2-135m").local_path
    tokenizer = load_model(base, "float32").tokenizer
    hf = out / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    tokenizer.save_hf(hf)
    tok = _tokenizer(hf, GEMMA3_TOKENS, ["<start_of_turn>", "<end_of_turn>"])
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in GEMMA3_TOKENS.items()}
    text = transformers.Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=2560, intermediate_size=10240, num_hidden_layers=LAYERS,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=4096, rms_norm_eps=1e-6,
        sliding_window=1024, query_pre_attn_scalar=256, eos_token_id=sorted(tokenizer.eos_ids),
        bos_token_id=tokenizer.bos_id, pad_token_id=0, tie_word_embeddings=True)
    vision = transformers.SiglipVisionConfig(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                                             num_attention_heads=16, image_size=896, patch_size=14,
                                             vision_use_head=False)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=256,
                                    boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
                                    image_token_index=ids["image_token"])
    torch.manual_seed(0)
    with torch.no_grad():
        model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    model.save_pretrained(hf)
    del model
    transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 896, "width": 896}), tokenizer=tok,
        chat_template=builtin_template("gemma3"), image_seq_length=256).save_pretrained(hf)
    small, mmproj = write_pair(hf, "gemma3", base, out / "pair")
    text_gguf = out / "pair" / "gemma3-4b-Q4_1.gguf"
    make_gguf.write("gemma3-4b", str(text_gguf), meta=gguf.GGUFReader(small))  # its metadata, 34 layers
    small.unlink()  # the 2-layer F32 text GGUF served for its metadata only (1.3 GB)
    print(json.dumps({"text": str(text_gguf), "mmproj": str(mmproj)}))


def _pair(d: Path) -> tuple[Path, Path]:
    pair = d / "pair"
    return next(pair.glob("gemma3-*.gguf")), next(pair.glob("mmproj-*.gguf"))


def ours(d: Path, threads: int) -> dict:
    import torch

    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine
    from localllm.model.loader import load_model
    from localllm.sampling import SamplingParams

    torch.set_num_threads(threads)
    text, _ = _pair(d)
    engine = LLMEngine(load_model(text, "auto"), EngineConfig(max_model_len=1024, compile=False, background_build=False, num_threads=threads, parallel=1))

    def ask(png: bytes) -> None:
        msgs = [{"role": "user", "content": [{"type": "image", "image": png}, {"type": "text", "text": PROMPT}]}]
        for _ in engine.generate(msgs, SamplingParams(temperature=0, max_tokens=1)):
            pass
    ask(image_png(1))  # warm-up: kernels built, first-call costs paid
    png = image_png(2)
    c0, t0 = time.process_time(), time.perf_counter()
    ask(png)
    return {"engine": "localllm", "ttft_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}


def llama(d: Path, threads: int) -> dict:
    from llama_cpp import Llama
    from llama_cpp.llama_chat_format import MTMDChatHandler

    text, mmproj = _pair(d)
    llm = Llama(model_path=str(text), chat_handler=MTMDChatHandler(clip_model_path=str(mmproj), verbose=False,
                                                                    use_gpu=False),
                n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False)

    def ask(png: bytes) -> None:
        url = "data:image/png;base64," + base64.b64encode(png).decode()
        llm.create_chat_completion(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": PROMPT}]}],
            max_tokens=1, temperature=0)
        llm.reset()  # no prefix reuse between requests (ours has none for a new image either)
    ask(image_png(1))
    png = image_png(2)
    c0, t0 = time.process_time(), time.perf_counter()
    ask(png)
    return {"engine": "llama.cpp", "ttft_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}


def compare(d: Path, threads: int, runs: int) -> dict:
    """ours, llama, ours, llama, ...: one fresh process each, so both see the same load drift."""
    import os
    import statistics
    import subprocess

    rows = {"localllm": [], "llama.cpp": []}
    for i in range(runs):
        for what in ("ours", "llama"):
            load = os.getloadavg()[0]
            out = subprocess.run([sys.executable, __file__, what, str(d), "--threads", str(threads)],
                                 check=True, capture_output=True, text=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            print(json.dumps({"run": i + 1, "load_before": round(load, 2), **row}), flush=True)
            rows[row["engine"]].append(row)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("ttft_s", "cpu_s")} for k, v in rows.items()}
    return {"runs": runs, "threads": threads, "median": med,
            "ttft_ratio_llama_over_ours": med["llama.cpp"]["ttft_s"] / med["localllm"]["ttft_s"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["make", "ours", "llama", "compare"])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    if a.what == "make":
        make(a.dir)
    elif a.what == "compare":
        print(json.dumps(compare(a.dir, a.threads, a.runs)))
    else:
        print(json.dumps((ours if a.what == "ours" else llama)(a.dir, a.threads)))


if __name__ == "__main__":
    main()
