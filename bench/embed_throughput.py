"""Embedding throughput, side by side: sentences/s of 128-token sentences at batch 1 and batch 64,
our engine vs sentence-transformers vs llama.cpp's embedding mode (llama-cpp-python,
`Llama(path, embedding=True)`, with a context sized to each batch, and with a context of a few
sentences, which its embed() fills and decodes in turn), all on all-MiniLM-L6-v2's weights (ours and sentence-transformers
on the embedded HF directory, llama.cpp on the same weights written as an F32 GGUF by
bench/make_embed_gguf.py; ours also on that GGUF), the same threads each.

    python bench/embed_throughput.py [--threads 2] [--runs 5] [--batches 1,64]

Prints a markdown table: the median wall time of `--runs` calls per engine and batch (after one
warm-up call), as sentences/s, and the process CPU seconds per sentence (what a loaded machine
distorts least). Every engine embeds the same texts; the script checks each sentence is exactly
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


def timed(fn, runs: int) -> tuple[float, float]:
    """(median wall seconds, median process CPU seconds) of fn() over `runs` calls, after a warm-up."""
    fn()
    walls, cpus = [], []
    for _ in range(runs):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--llama-ubatch", type=int, default=4, help="sentences per llama.cpp decode in its second row")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import numpy as np
    import torch

    torch.set_num_threads(a.threads)
    from make_embed_gguf import write_bert_gguf

    from localllm.engine.embedder import Embedder
    from localllm.model.encoder_loader import load_encoder
    from localllm.registry import resolve_model

    src = resolve_model("all-minilm").local_path
    gguf_path = Path(tempfile.mkdtemp(prefix="embed-bench-")) / "all-minilm-f32.gguf"
    write_bert_gguf(src, gguf_path)
    ours = Embedder(load_encoder(src))
    ours_gguf = Embedder(load_encoder(gguf_path))
    batches = [int(b) for b in a.batches.split(",")]
    texts = sentences(max(batches), a.tokens, lambda t: ours.tokenize([t]).ids[0])

    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(src), device="cpu")
    assert all(len(st.tokenizer(t)["input_ids"]) == a.tokens for t in texts)
    import llama_cpp

    @functools.cache
    def llama(n_ctx: int):
        # n_ctx = n_batch = n_ubatch: llama.cpp's encoder takes a decode's tokens in one ubatch (a
        # GGML_ASSERT otherwise) and attends over the whole ubatch with a mask across sequences (an
        # n_ubatch-square score matrix per head), so the context is sized per run, never larger
        return llama_cpp.Llama(str(gguf_path), embedding=True, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                               n_threads=a.threads, n_threads_batch=a.threads, verbose=False)

    assert all(len(llama(a.tokens).tokenize(t.encode())) == a.tokens for t in texts)

    engines = {
        "localllm (HF dir)": lambda b: ours.embed(ours.tokenize(texts[:b])),
        "localllm (GGUF)": lambda b: ours_gguf.embed(ours_gguf.tokenize(texts[:b])),
        "sentence-transformers": lambda b: st.encode(texts[:b], batch_size=b, convert_to_numpy=True),
        # the context sized to the batch (one decode of all its sentences)
        "llama.cpp, n_ctx = batch tokens": lambda b: llama(b * a.tokens).embed(texts[:b], normalize=True),
        # its best setting at batch 64 on this machine: a few sentences per decode (less masked attention)
        f"llama.cpp, n_ctx = {a.llama_ubatch} sentences": lambda b: llama(min(b, a.llama_ubatch) * a.tokens).embed(
            texts[:b], normalize=True),
    }
    ref = np.asarray(engines["sentence-transformers"](8))
    for name, fn in engines.items():
        v = np.asarray(fn(8), dtype=np.float32)
        cos = (v * ref).sum(1) / np.linalg.norm(v, axis=1) / np.linalg.norm(ref, axis=1)
        assert cos.min() >= 0.9999, (name, cos.min())
    rows = {}
    for b in batches:
        for name, fn in engines.items():
            if name.startswith(f"llama.cpp, n_ctx = {a.llama_ubatch}") and b <= a.llama_ubatch:
                rows[(name, b)] = rows[("llama.cpp, n_ctx = batch tokens", b)]  # the same setting
                continue
            wall, cpu = timed(functools.partial(fn, b), a.runs)
            rows[(name, b)] = (b / wall, cpu / b)
            print(f"  {name}, batch {b}: {b / wall:.1f} sentences/s, {cpu / b * 1e3:.1f} CPU ms/sentence",
                  file=sys.stderr, flush=True)  # progress: the table comes at the end
    print(f"{a.tokens}-token sentences, {a.threads} threads, median of {a.runs} calls (torch {torch.__version__}, "
          f"llama-cpp-python {llama_cpp.__version__}); load average {os.getloadavg()[0]:.1f} at the end\n")
    head = "| engine | " + " | ".join(f"batch {b}: sentences/s | CPU ms/sentence" for b in batches) + " |"
    print(head)
    print("|---|" + "---|---|" * len(batches))
    for name in engines:
        cells = " | ".join(f"{rows[(name, b)][0]:.1f} | {rows[(name, b)][1] * 1e3:.1f}" for b in batches)
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
