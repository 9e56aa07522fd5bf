"""`localllm embed` end to end (the real executable): JSON lines against sentence-transformers on the
same files, texts from arguments or stdin, and its errors."""

import json
import subprocess
import sys

import torch
import torch.nn.functional as F
from embed_reference import SENTENCES, st_vectors

EXE = [sys.executable, "-m", "localllm.cli", "embed"]


def run(args, stdin=None, timeout=180):
    return subprocess.run(EXE + args, input=stdin, capture_output=True, text=True, timeout=timeout)


def minilm_dir():
    from localllm.registry import resolve_model

    return resolve_model("all-minilm").local_path


def test_arguments_and_stdin_lines_match_sentence_transformers():
    texts = SENTENCES[:4]
    ref = st_vectors(minilm_dir(), texts)
    r = run(texts)  # no MODEL: the default embedding model, all-minilm
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["index"] for row in rows] == [0, 1, 2, 3]
    assert F.cosine_similarity(torch.tensor([row["embedding"] for row in rows]), ref).min().item() >= 0.9999
    # MODEL first, texts one per line on stdin (the blank line is skipped), Matryoshka dimensions
    r = run(["all-minilm", "--dimensions", "32"], stdin=f"{texts[0]}\n\n{texts[1]}\n")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(rows) == 2 and len(rows[0]["embedding"]) == 32
    want = F.normalize(ref[:2, :32], dim=-1)
    assert F.cosine_similarity(torch.tensor([row["embedding"] for row in rows]), want).min().item() >= 0.9999


def test_errors_are_one_line():
    r = run([], stdin="")
    assert r.returncode == 2 and r.stderr.startswith("Error: no text") and r.stdout == ""
    r = run(["smollm2-135m", "hello"])
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip() == ("Error: smollm2-135m is not an embedding model (it is a text generation model); "
                                "embedding models run by localllm: BERT-family checkpoints such as all-minilm")


def test_run_with_an_embedding_model_says_what_it_is():
    r = subprocess.run([sys.executable, "-m", "localllm.cli", "run", "all-minilm", "hi"], capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == ("Error: all-minilm is an embedding model, not a text generation model: use "
                                "`localllm embed`, or /v1/embeddings and /api/embed of `localllm serve`")


def test_precision_fp32_is_the_exact_path_and_a_decoder_quant_is_refused():
    """`--precision fp32`: torch's fp32 linears, the vectors of load_encoder(precision="float32")
    (to JSON's float printing); auto may round the linears to bf16 (within cosine 0.9999 above);
    a quantization only decoders have is a usage error naming what an embedding model takes."""
    from localllm.engine.embedder import Embedder
    from localllm.model.encoder_loader import load_encoder

    texts = SENTENCES[:3]
    r = run(["--precision", "fp32", *texts])
    assert r.returncode == 0, r.stderr
    got = torch.tensor([json.loads(line)["embedding"] for line in r.stdout.splitlines()])
    emb = Embedder(load_encoder(minilm_dir(), precision="float32"))
    assert torch.allclose(got, emb.embed(emb.tokenize(texts)), atol=1e-6, rtol=0)
    r = run(["--precision", "int4", "hello"])
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == "Error: invalid value for --quant: an embedding model takes auto, fp32 or bf16, got 'int4'"
