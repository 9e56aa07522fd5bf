"""Embedding throughput, side by side: sentences/s of 128-token sentences at batch 1 and batch 64,
our engine vs sentence-transformers vs llama.cpp's embedding mode (llama-cpp-python,
`Llama(path, embedding=True)`, with a context sized to each batch, and with a context of a few
sentences, which its embed() fills and decodes in turn), all on all-MiniLM-L6-v2's weights (ours and sentence-transformers
on the embedded HF directory, llama.cpp on the same weights written as an F32 GGUF by
bench/make_embed_gguf.py; ours also on that GGUF), the same threads each.

    python bench/embed_throughput.py [--threads 2] [--runs 5] [--batches 1,64]

Prints a markdown table: the median wall time of `--runs` calls per engine and batch (after one
warm-up call; the engines' calls interleaved, A B C A B C ..., so load changes hit all alike), as
sentences/s, and the process CPU seconds per sentence (what a loaded machine distorts least).
Our engine also runs as `--precision float32` (torch's fp32 linears: what CPUs without bf16 dot
products run by default) and, where the CPU has AMX, `bf16x3` (fp32-level: weights and
activations in two bf16 parts). Without llama-cpp-python installed its rows are left out (said in the output). Every engine embeds the same texts; the script checks each sentence is exactly
128 tokens for all three tokenizers and that the engines agree (cosine >= 0.9999).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the quick brown fox jumps over a lazy dog while people watch from the old stone bridge near "
         "river and children play in park under bright blue sky with white clouds moving slowly across "
         "city during warm summer afternoon").split()


def sentences(n: int, tokens: int, tokenizer) -> list[str]:
    """n different texts of exactly `tokens` tokens ([CLS] and [SEP] included): words that are one
    token each, in a different order per text."""
    import random

    rng = random.Random(0)
    out = []
    for _ in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(tokens - 2))
        assert len(tokenizer(text)) == tokens, (len(tokenizer(text)), text)
        out.append(text)
    return out


def timed(fns: dict, runs: int) -> dict[str, tuple[float, float]]:
    """name -> (median wall seconds, median process CPU seconds) of fns[name]() over `runs`
    calls, after a warm-up each; the calls interleaved (one of each engine per round)."""
    for fn in fns.values():
        fn()
    walls = {name: [] for name in fns}
    cpus = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            w, c = time.perf_counter(), time.process_time()
            fn()
            walls[name].append(time.perf_counter() - w)
            cpus[name].append(time.process_time() - c)
    return {name: (statistics.median(walls[name]), statistics.median(cpus[name])) for name in fns}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--llama-ubatch", type=int, default=4, help="sentences per llama.cpp decode in its second row")
    ap.add_argument("--skip-llama-full-context", action="store_true",
                    help="leave out llama.cpp's whole-batch context above --llama-ubatch sentences (its slowest row: "
                         "~3 s a sentence at batch 64, 8192-square attention)")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import numpy as np
    import torch

    torch.set_num_threads(a.threads)
    from make_embed_gguf import write_bert_gguf

    from localllm.engine.embedder import Embedder
    from localllm.model import bf16x3
    from localllm.model.encoder_loader import load_encoder
    from localllm.registry import resolve_model

    src = resolve_model("all-minilm").local_path
    gguf_path = Path(tempfile.mkdtemp(prefix="embed-bench-")) / "all-minilm-f32.gguf"
    write_bert_gguf(src, gguf_path)
    ours = Embedder(load_encoder(src))
    ours_gguf = Embedder(load_encoder(gguf_path))
    ours_fp32 = Embedder(load_encoder(src, precision="float32"))
    ours_x3 = Embedder(load_encoder(src, precision="bf16x3")) if bf16x3.available() else None
    batches = [int(b) for b in a.batches.split(",")]
    texts = sentences(max(batches), a.tokens, lambda t: ours.tokenize([t]).ids[0])

    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(src), device="cpu")
    assert all(len(st.tokenizer(t)["input_ids"]) == a.tokens for t in texts)
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
        print("llama-cpp-python is not installed: no llama.cpp rows", file=sys.stderr)

    @functools.cache
    def llama(n_ctx: int):
        # n_ctx = n_batch = n_ubatch: llama.cpp's encoder takes a decode's tokens in one ubatch (a
        # GGML_ASSERT otherwise) and attends over the whole ubatch with a mask across sequences (an
        # n_ubatch-square score matrix per head), so the context is sized per run, never larger
        return llama_cpp.Llama(str(gguf_path), embedding=True, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                               n_threads=a.threads, n_threads_batch=a.threads, verbose=False)

    assert llama_cpp is None or all(len(llama(a.tokens).tokenize(t.encode())) == a.tokens for t in texts)

    engines = {
        "localllm (HF dir)": lambda b: ours.embed(ours.tokenize(texts[:b])),
        "localllm (GGUF)": lambda b: ours_gguf.embed(ours_gguf.tokenize(texts[:b])),
        "localllm (HF dir, --precision float32: torch's linears)": lambda b: ours_fp32.embed(
            ours_fp32.tokenize(texts[:b])),
        **({"localllm (HF dir, --precision bf16x3: fp32-level, AMX)": lambda b: ours_x3.embed(ours_x3.tokenize(texts[:b]))}
           if ours_x3 is not None else {}),
        "sentence-transformers": lambda b: st.encode(texts[:b], batch_size=b, convert_to_numpy=True),
        # the context sized to the batch (one decode of all its sentences)
        "llama.cpp, n_ctx = batch tokens": lambda b: llama(b * a.tokens).embed(texts[:b], normalize=True),
        # its best setting at batch 64 on this machine: a few sentences per decode (less masked attention)
        f"llama.cpp, n_ctx = {a.llama_ubatch} sentences": lambda b: llama(min(b, a.llama_ubatch) * a.tokens).embed(
            texts[:b], normalize=True),
    }
    if llama_cpp is None:
        engines = {name: fn for name, fn in engines.items() if not name.startswith("llama.cpp")}
    ref = np.asarray(engines["sentence-transformers"](8))
    for name, fn in engines.items():
        v = np.asarray(fn(8), dtype=np.float32)
        cos = (v * ref).sum(1) / np.linalg.norm(v, axis=1) / np.linalg.norm(ref, axis=1)
        assert cos.min() >= 0.9999, (name, cos.min())
    rows = {}
    load_start = os.getloadavg()[0]
    for b in batches:
        same = f"llama.cpp, n_ctx = {a.llama_ubatch}"  # at batch <= its sentences: the first llama.cpp row
        full = "llama.cpp, n_ctx = batch tokens"
        fns = {name: functools.partial(fn, b) for name, fn in engines.items()
               if not (name.startswith(same) and b <= a.llama_ubatch)
               and not (name == full and b > a.llama_ubatch and a.skip_llama_full_context)}
        for name, (wall, cpu) in timed(fns, a.runs).items():
            rows[(name, b)] = (b / wall, cpu / b)
            print(f"  {name}, batch {b}: {b / wall:.1f} sentences/s, {cpu / b * 1e3:.1f} CPU ms/sentence",
                  file=sys.stderr, flush=True)  # progress: the table comes at the end
        for name in engines:
            if (name, b) not in rows:
                rows[(name, b)] = rows.get((full, b), (float("nan"), float("nan")))  # the same setting, or skipped
    version = llama_cpp.__version__ if llama_cpp is not None else "not installed"
    print(f"{a.tokens}-token sentences, {a.threads} threads, median of {a.runs} interleaved calls (torch "
          f"{torch.__version__}, llama-cpp-python {version}); load average {load_start:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end\n")
    head = "| engine | " + " | ".join(f"batch {b}: sentences/s | CPU ms/sentence" for b in batches) + " |"
    print(head)
    print("|---|" + "---|---|" * len(batches))
    for name in engines:
        cells = " | ".join(f"{rows[(name, b)][0]:.1f} | {rows[(name, b)][1] * 1e3:.1f}" for b in batches)
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
