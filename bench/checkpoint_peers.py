"""An HF checkpoint at first contact, side by side: our engine (`LLM(path)`, default settings, an empty
LOCALLLM_HOME: what a new user gets after `make setup`, which compiled our C++ kernels into the
machine's kernel cache, LOCALLLM_KERNEL_CACHE, shared here), vLLM's CPU backend (`vllm.LLM`, run in the vLLM environment
`make setup-vllm` makes) and transformers (`generate`, the checkpoint's own dtype), each in its own
process, rounds interleaved, the same threads.

    python bench/checkpoint_peers.py DIR [DIR ...] [--threads 2] [--rounds 3] [--tokens 32]

The workload: prompts of 32 token ids (the same ids for every engine), greedy, `--tokens` new tokens
with EOS ignored. Per process: load time, then the time of a first request (1 stream, 1 token: the
first answer, warm-ups included), then, medians of 3 calls: TTFT at 1 stream (1 new token), decode
tok/s at 1 stream ((tokens - 1) / (t(tokens) - t(1))), and the aggregate tok/s of 16 streams
(16 x tokens / t). Prints a markdown table of the medians over rounds and the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
ENGINES = ("localllm", "vllm", "transformers")
STREAMS = 16


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(100, min(vocab, 20000)) for _ in range(length)] for _ in range(n)]


def _localllm(path: str, threads: int):
    from localllm.llm import LLM
    from localllm.sampling import SamplingParams

    llm = LLM(path, num_threads=threads)
    vocab = llm.tokenizer.vocab_size

    def gen(batch: list[list[int]], tokens: int) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        return [len(o.token_ids) for o in llm.generate(batch, params)]
    return gen, vocab, llm.engine.loaded.precision


def _vllm(path: str, threads: int):
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=path, enforce_eager=True, max_num_seqs=STREAMS, max_model_len=512, seed=0)
    vocab = llm.get_tokenizer().vocab_size

    def gen(batch: list[list[int]], tokens: int) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outs]
    return gen, vocab, str(llm.llm_engine.model_config.dtype) + (
        f" {llm.llm_engine.model_config.quantization}" if llm.llm_engine.model_config.quantization else "")


def _transformers(path: str, threads: int):
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()
    vocab = model.config.vocab_size

    def gen(batch: list[list[int]], tokens: int) -> list[int]:
        ids = torch.tensor(batch)  # equal lengths: no padding
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                 min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        return [out.shape[1] - ids.shape[1]] * len(batch)
    return gen, vocab, str(model.dtype)


def worker(engine: str, path: str, threads: int, tokens: int) -> dict:
    t0 = time.perf_counter()
    gen, vocab, held = {"localllm": _localllm, "vllm": _vllm, "transformers": _transformers}[engine](path, threads)
    load = time.perf_counter() - t0
    ps = prompts(STREAMS, 32, vocab)
    t0 = time.perf_counter()
    gen(ps[:1], 1)
    first = time.perf_counter() - t0

    def timed(batch, n):
        t = time.perf_counter()
        got = gen(batch, n)
        assert got == [n] * len(batch), (engine, got)
        return time.perf_counter() - t
    gen(ps, 2)  # the 16-stream shapes' first call stays out of the timing
    ttft, dec, agg = [], [], []
    for _ in range(3):
        t1, tn = timed(ps[:1], 1), timed(ps[:1], tokens)
        ttft.append(t1)
        dec.append((tokens - 1) / max(tn - t1, 1e-9))
        agg.append(STREAMS * tokens / timed(ps, tokens))
    rss = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM"))) / 1024
    return {"engine": engine, "held": held, "load_s": load, "first_answer_s": first,
            "ttft_ms": statistics.median(ttft) * 1e3, "decode_tok_s": statistics.median(dec),
            "aggregate16_tok_s": statistics.median(agg), "peak_rss_mb": rss}


def run_one(engine: str, path: Path, threads: int, tokens: int) -> dict:
    python = str(VLLM_PYTHON) if engine == "vllm" else sys.executable
    with tempfile.TemporaryDirectory() as home:  # a new user's empty home: no package, no cache
        kernels = os.environ.get("LOCALLLM_KERNEL_CACHE") or str(Path.home() / ".cache" / "localllm" / "kernels")
        env = {**os.environ, "LOCALLLM_HOME": home, "LOCALLLM_KERNEL_CACHE": kernels, "OMP_NUM_THREADS": str(threads),
               "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
               "PYTHONPATH": str(ROOT)}
        r = subprocess.run([python, __file__, "--worker", engine, str(path), "--threads", str(threads),
                            "--tokens", str(tokens)], env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:  # reported in the table (transformers needs autoawq/gptqmodel for those formats)
        print(f"{engine} on {path} failed:\n{r.stderr[-2000:]}", file=sys.stderr, flush=True)
        last = (r.stderr.strip().splitlines() or ["?"])[-1][:120]
        return {"engine": engine, "held": f"failed: {last}", "load_s": float("nan"), "first_answer_s": float("nan"),
                "ttft_ms": float("nan"), "decode_tok_s": float("nan"), "aggregate16_tok_s": float("nan"),
                "peak_rss_mb": float("nan")}
    # vLLM writes to stdout too (at exit): the worker's line is marked
    return json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))[7:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, str(args.dirs[0]), args.threads, args.tokens)), flush=True)
        return
    engines = args.engines.split(",")
    rows: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(args.rounds):
        for d in args.dirs:
            for e in engines:
                r = run_one(e, d, args.threads, args.tokens)
                rows.setdefault((d.name, e), []).append(r)
                print(f"round {rnd + 1}: {d.name} {json.dumps(r)}", flush=True)
    keys = ("load_s", "first_answer_s", "ttft_ms", "decode_tok_s", "aggregate16_tok_s", "peak_rss_mb")
    print("| checkpoint | engine | held as | load s | first answer s | TTFT ms | decode tok/s, 1 stream "
          "| 16 streams tok/s | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    out = []
    for (name, e), rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in keys}
        out.append({"checkpoint": name, "engine": e, "held": rs[0]["held"], **med, "runs": rs})
        print(f"| {name} | {e} | {rs[0]['held']} | {med['load_s']:.1f} | {med['first_answer_s']:.2f} | "
              f"{med['ttft_ms']:.0f} | {med['decode_tok_s']:.1f} | {med['aggregate16_tok_s']:.1f} | "
              f"{med['peak_rss_mb']:.0f} |")
    print(json.dumps({"threads": args.threads, "tokens": args.tokens, "rounds": args.rounds, "rows": out}))


if __name__ == "__main__":
    main()
