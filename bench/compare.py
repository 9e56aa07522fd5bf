"""localllm vs llama.cpp vs transformers on the same GGUF, same threads, same prompts, one run.

    python bench/compare.py [--model PATH.gguf] [--threads 2] [--runs 5] [--eager] [--json]

An engine named ENGINE:KV runs with that KV cache type (localllm's --kv-type; llama.cpp's
type_k/type_v, with flash attention, which its quantized V cache needs), e.g.
--engines localllm,localllm:q8_0,llama.cpp,llama.cpp:q8_0 --no-cold-start; localllm:a8 runs
localllm with --act-bits 8 (8-bit activations in its CPU kernels, llama.cpp's way).

Needs `llama-cpp-python` (pip install -e '.[bench]') and `transformers` + `accelerate`; it
installs nothing. Never part of CI. Each engine lives in its own worker process (so each
reports its own peak RSS and load time) and waits on stdin while the others run: the timed
runs are interleaved round-robin, so a noisy shared machine slows every engine alike and
the per-round ratios stay meaningful. transformers runs fp32 weights dequantized from the
GGUF (the project's correctness oracle); llama.cpp runs the GGUF's own Q4_1 kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ENGINES = ("localllm", "llama.cpp", "transformers")
TOP_P = 0.95  # `localllm run`'s default, with its temperature 0.7 (--sampled)
TEXT = ("The history of computing is a story of people turning ideas about calculation into machines. "
        "Early mechanical calculators could add and subtract; later designs stored programs in memory, "
        "so the same hardware could solve many problems. ")


# ---- workers: one engine each, JSON lines on stdin/stdout ---------------------------------------------
class LocalWorker:
    def __init__(self, path: str, threads: int, compile: bool, kv_type: str = "auto"):
        act_bits = 8 if kv_type == "a8" else 16
        kv_type = "auto" if kv_type == "a8" else kv_type
        import torch

        torch.set_num_threads(threads)
        from localllm.bench import wait_for_compiled
        from localllm.config import EngineConfig
        from localllm.engine.engine import LLMEngine
        from localllm.model.loader import load_model

        t0 = time.perf_counter()
        self.loaded = load_model(path, "auto")  # as `localllm run` loads it: the same compiled packages
        self.load_s = time.perf_counter() - t0
        self.engine = LLMEngine(self.loaded, EngineConfig(max_model_len=4096, enable_prefix_caching=False,
                                                          parallel=1,
                                                          num_threads=threads, compile=compile,
                                                          kv_type=kv_type, act_bits=act_bits))
        self.compile_wait_s = wait_for_compiled(self.engine)

    def bytes_per_token(self) -> dict:
        """What one greedy decode step reads: every layer's weights, the head it ranks with (the
        int4 copy when it has one; the exact rows it rescores are few) and, per token of
        context, K and V of every layer. MoE experts count for the k of E a token uses."""
        from localllm.model.moe import MoE

        model, cfg = self.loaded.model, self.loaded.config
        experts = {t.data_ptr() for m in model.modules() if isinstance(m, MoE)
                   for t in (*m.experts.parameters(), *m.experts.buffers())}
        seen, total = set(), 0
        for part in (*model.layers, model.norm, model.head.fast if model.head.fast is not None else model.head):
            for t in (*part.parameters(), *part.buffers()):
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    n = t.numel() * t.element_size()
                    total += n * cfg.num_experts_per_tok // cfg.num_experts if t.data_ptr() in experts else n
        from localllm.model.attention import kv_value_bytes

        return {"weights": total, "kv_per_token": cfg.kv_bytes_per_token(kv_value_bytes(self.engine.kv_dtype))}

    def prefill(self, ids: list[int]) -> float:
        from localllm.sampling import SamplingParams

        t0 = time.perf_counter()
        self.engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1))
        while self.engine.has_unfinished():
            self.engine.step()
        return time.perf_counter() - t0

    def decode(self, ids: list[int], n: int, temperature: float = 0.0) -> tuple[float, list[int]]:
        from localllm.sampling import SamplingParams

        stamps, last = [], None
        params = SamplingParams(temperature=temperature, top_p=TOP_P, max_tokens=n, ignore_eos=True, seed=0)
        for last in self.engine.generate(ids, params):  # noqa: B007
            stamps.append(time.perf_counter())
        return (n - 1) / (stamps[-1] - stamps[0]), last.token_ids


class LlamaCppWorker:
    KV = {"f16": 1, "q8_0": 8}  # ggml type ids

    def __init__(self, path: str, threads: int, compile: bool, kv_type: str = "auto"):
        from llama_cpp import Llama

        t0 = time.perf_counter()
        kv = {} if kv_type == "auto" else {"type_k": self.KV[kv_type], "type_v": self.KV[kv_type], "flash_attn": True}
        self.llm = Llama(path, n_ctx=4096, n_batch=2048, n_ubatch=512, n_threads=threads,
                         n_threads_batch=threads, verbose=False, **kv)
        self.kv_bytes = 34 / 32 if kv_type == "q8_0" else 2
        self.load_s = time.perf_counter() - t0
        self.path = path

    def bytes_per_token(self) -> dict:
        """Every tensor of the file but the embedding (only its rows are read), unless the
        embedding is also the output matrix (MoE expert stacks: the k of E a token uses); f16 K
        and V per token of context."""
        from localllm.model.weights import open_weights

        weights = open_weights(self.path)
        cfg, tensors = weights.config, weights.file.tensors
        tied = "output.weight" not in tensors
        total = sum(t.data.nbytes * cfg.num_experts_per_tok // cfg.num_experts if "_exps." in n else t.data.nbytes
                    for n, t in tensors.items() if n != "token_embd.weight" or tied)
        return {"weights": total, "kv_per_token": cfg.kv_bytes_per_token(self.kv_bytes)}

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - t0

    def _argmax(self) -> int:
        import numpy as np

        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))
        return int(logits.argmax())

    def decode(self, ids: list[int], n: int, temperature: float = 0.0) -> tuple[float, list[int]]:
        if temperature > 0:  # llama.cpp's own sampler chain, with the same settings as ours
            stamps, toks = [], []
            for tok in self.llm.generate(ids, top_k=0, top_p=TOP_P, min_p=0.0, temp=temperature, reset=True):
                stamps.append(time.perf_counter())
                toks.append(tok)
                if len(toks) == n:
                    break
            return (n - 1) / (stamps[-1] - stamps[0]), toks
        # a plain eval loop: Llama.generate(reset=False) would evaluate the prompt again
        self.llm.reset()
        self.llm.eval(ids)
        toks = [self._argmax()]
        t0 = time.perf_counter()
        for _ in range(n - 1):
            self.llm.eval([toks[-1]])
            toks.append(self._argmax())
        return (n - 1) / (time.perf_counter() - t0), toks


class HFWorker:
    def __init__(self, path: str, threads: int, compile: bool, kv_type: str = "auto"):
        import torch

        torch.set_num_threads(threads)
        from transformers import AutoModelForCausalLM

        self.torch = torch
        t0 = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                          dtype=torch.float32).eval()
        self.load_s = time.perf_counter() - t0

    def prefill(self, ids: list[int]) -> float:
        t0 = time.perf_counter()
        with self.torch.inference_mode():
            self.model(self.torch.tensor([ids]), logits_to_keep=1).logits.argmax(-1)
        return time.perf_counter() - t0

    def decode(self, ids: list[int], n: int, temperature: float = 0.0) -> tuple[float, list[int]]:
        torch = self.torch
        g = torch.Generator().manual_seed(0)

        def pick(logits):  # (no top-p here: transformers is the reference, not a rival, for sampling)
            if temperature == 0:
                return int(logits.argmax())
            return int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g))

        with torch.inference_mode():
            out = self.model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
            toks = [pick(out.logits[0, -1])]
            past = out.past_key_values
            t0 = time.perf_counter()
            for _ in range(n - 1):
                out = self.model(torch.tensor([[toks[-1]]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                toks.append(pick(out.logits[0, -1]))
        return (n - 1) / (time.perf_counter() - t0), toks


WORKERS = {"localllm": LocalWorker, "llama.cpp": LlamaCppWorker, "transformers": HFWorker}


def worker_main(kind: str, path: str, threads: int, compile: bool) -> None:
    base, _, kv_type = kind.partition(":")
    w = WORKERS[base](path, threads, compile, kv_type or "auto")
    print(json.dumps({"ready": True, "load_s": w.load_s}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "prefill":
            res = {"seconds": w.prefill(cmd["ids"])}
        elif cmd["op"] == "decode":
            rate, toks = w.decode(cmd["ids"], cmd["n"], cmd.get("temperature", 0.0))
            res = {"tok_per_s": rate, "tokens": toks}
        elif cmd["op"] == "bytes":
            res = w.bytes_per_token() if hasattr(w, "bytes_per_token") else {}
        else:  # "rss"
            res = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        print(json.dumps(res), flush=True)


# ---- driver ---------------------------------------------------------------------------------------
class Proc:
    def __init__(self, kind: str, path: str, threads: int, compile: bool):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.p = subprocess.Popen([sys.executable, __file__, "--worker", kind, "--model", path, "--threads",
                                   str(threads)] + ([] if compile else ["--eager"]),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.hello = self._read()

    def _read(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError("a benchmark worker died (see its error above)")
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=60)


COLD = {
    "localllm": "import sys, subprocess; subprocess.run([sys.executable, '-m', 'localllm.cli', 'run', '--temperature', "
                "'0', '-n', '2', '-m', {path!r}, 'Hi'])",
    "llama.cpp": "from llama_cpp import Llama; llm = Llama({path!r}, n_ctx=512, n_threads={t}, verbose=False); "
                 "print(llm('Hi', max_tokens=1)['choices'][0]['text'], flush=True)",
    "transformers": "import os, torch; torch.set_num_threads({t}); from transformers import AutoModelForCausalLM, "
                    "AutoTokenizer; d, f = os.path.split({path!r}); "
                    "m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32); "
                    "tok = AutoTokenizer.from_pretrained(d, gguf_file=f); "
                    "print(tok.decode(m.generate(**tok('Hi', return_tensors='pt'), max_new_tokens=1)[0, -1:]), "
                    "flush=True)",
}


def cold_start(kind: str, path: str, threads: int) -> float:
    """Process start to the first generated token on stdout."""
    if kind == "localllm":
        cmd = [sys.executable, "-m", "localllm.cli", "run", "--temperature", "0", "-n", "2", "--threads",
               str(threads), path, "Hi"]
    else:
        cmd = [sys.executable, "-c", COLD[kind].format(path=path, t=threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    first = p.stdout.read(1)
    dt = time.perf_counter() - t0
    p.stdout.read()
    p.wait(timeout=300)
    if not first:
        raise RuntimeError(f"{kind} cold-start command printed nothing: {cmd}")
    return dt


def prompt_ids(n: int, salt: int) -> list[int]:
    from localllm.registry import resolve_model
    from localllm.tokenizer import LLMTokenizer  # noqa: F401  (same tokenizer for all three: one GGUF)

    global _TOK
    if "_TOK" not in globals():
        from localllm.model.weights import open_weights

        _TOK = open_weights(resolve_model(None).local_path if ARGS.model is None else ARGS.model).tokenizer()
    ids = _TOK.encode(TEXT)
    out = (ids * (n // len(ids) + 2))[:n]
    out[0] = 100 + salt  # a different first token per run
    return out


def main(argv=None) -> dict:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="GGUF file (default: the embedded model)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--decode-context", default="32", help="prompt lengths to decode after (e.g. 32,2000)")
    ap.add_argument("--prefill", default="32,512,2048")
    ap.add_argument("--sampled", type=float, default=0.7, help="also decode with sampling at this temperature, "
                    "top-p 0.95 (run's defaults; 0: skip)")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--eager", action="store_true", help="localllm without its compiled step (the default "
                    "compiles: a first run on a model waits for the build)")
    ap.add_argument("--no-cold-start", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ARGS = args = ap.parse_args(argv)
    if args.model is None:
        from localllm.registry import resolve_model

        args.model = str(resolve_model(None).local_path)
    if args.worker:
        worker_main(args.worker, args.model, args.threads, not args.eager)
        return {}
    engines = args.engines.split(",")
    lengths = [int(x) for x in args.prefill.split(",")]

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    res: dict = {"model": args.model, "threads": args.threads, "runs": args.runs, "compile": not args.eager,
                 "engines": {e: {} for e in engines}}
    procs = {}
    for e in engines:  # loaded one after another: load times do not overlap
        log(f"loading {e} ...")
        procs[e] = Proc(e, args.model, args.threads, not args.eager)
        res["engines"][e]["load_s"] = procs[e].hello["load_s"]
    try:
        log("warm-up ...")
        for e in engines:  # first calls: allocation, one-time compiles
            procs[e].ask(op="decode", ids=prompt_ids(32, 99), n=16)
            procs[e].ask(op="prefill", ids=prompt_ids(64, 98))
        for n in lengths:
            log(f"prefill {n} ...")
            times = {e: [] for e in engines}
            for r in range(max(1, args.runs if n <= 512 else args.runs // 2)):
                ids = prompt_ids(n, r)
                for e in engines:
                    times[e].append(procs[e].ask(op="prefill", ids=ids)["seconds"])
            for e in engines:
                s = statistics.median(times[e])
                res["engines"][e][f"prefill_{n}"] = {"seconds": s, "tok_per_s": n / s, "runs": times[e]}
        decodes = [(int(x), 0.0) for x in args.decode_context.split(",")]
        if args.sampled:
            decodes.append((32, args.sampled))
        for ctx, temp in decodes:
            sfx = ("" if ctx == 32 else f"_ctx{ctx}") + ("_sampled" if temp else "")
            log(f"decode {args.decode_tokens} tokens after {ctx} (temperature {temp}) x {args.runs} rounds ...")
            rates = {e: [] for e in engines}
            ids = prompt_ids(ctx, 7)
            for _ in range(args.runs):
                for e in engines:
                    out = procs[e].ask(op="decode", ids=ids, n=args.decode_tokens, temperature=temp)
                    rates[e].append(out["tok_per_s"])
                    res["engines"][e][f"decode_tokens{sfx}"] = out["tokens"][:16]
            for e in engines:
                res["engines"][e][f"decode{sfx}_tok_per_s"] = statistics.median(rates[e])
                res["engines"][e][f"decode{sfx}_runs"] = rates[e]
            if "localllm" in engines:  # per-round ratios cancel the machine's drift
                for e in engines:
                    if e != "localllm":
                        res["engines"][e][f"decode{sfx}_round_ratio"] = statistics.median(
                            a / b for a, b in zip(rates["localllm"], rates[e]))
        for e in engines:
            res["engines"][e]["peak_rss_mb"] = procs[e].ask(op="rss")["peak_rss_mb"]
            res["engines"][e]["bytes"] = procs[e].ask(op="bytes")
    finally:
        for p in procs.values():
            p.close()
    if not args.no_cold_start:
        log("cold start ...")
        cold = {e: [] for e in engines}
        for _ in range(3):
            for e in cold:
                if ":" not in e:  # (a KV type does not change a cold start)
                    cold[e].append(cold_start(e, args.model, args.threads))
        for e in engines:
            if cold[e]:
                res["engines"][e]["cold_start_s"] = statistics.median(cold[e])
    log("read bandwidth ...")
    res["read_gb_s"] = read_bandwidth(args.threads)
    print(json.dumps(res, indent=2) if args.json else render(res))
    return res


def read_bandwidth(threads: int, gib: float = 1.0, runs: int = 7) -> float:
    """This machine's memory read bandwidth with `threads` threads: the median of summing a
    1 GiB fp32 tensor (the roofline decode is measured against)."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(int(gib * 2**28))
    x.sum()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def render(res: dict) -> str:
    eng = res["engines"]
    names = list(eng)
    peers = [e for e in names if e != "localllm"] if "localllm" in names else []
    rows = [("metric", *names, *[f"localllm / {p}" for p in peers])]

    def row(label, key, fmt, higher_better=True):
        vals = [key(eng[e]) for e in names]
        cells = [fmt(v) if v is not None else "-" for v in vals]
        ratios = []
        for p in peers:
            a, b = key(eng["localllm"]), key(eng[p])
            ratios.append("-" if a is None or b is None else f"{(a / b if higher_better else b / a):.2f}x")
        rows.append((label, *cells, *ratios))

    def get(*path):
        def f(d):
            for k in path:
                d = d.get(k) if isinstance(d, dict) else None
            return d
        return f

    row("load (s)", get("load_s"), "{:.2f}".format, False)
    for k in sorted((k for k in eng[names[0]] if k.startswith("prefill_")), key=lambda k: int(k.split("_")[1])):
        row(f"prefill {k.split('_')[1]} (tok/s)", get(k, "tok_per_s"), "{:.0f}".format)
    row("decode batch 1 (tok/s)", get("decode_tok_per_s"), "{:.1f}".format)
    row("decode batch 1, sampled (tok/s)", get("decode_sampled_tok_per_s"), "{:.1f}".format)
    for k in sorted(k for k in eng[names[0]] if k.startswith("decode_ctx") and k.endswith("_tok_per_s")):
        row(f"decode after {k.split('_')[1][3:]} tokens (tok/s)", get(k), "{:.1f}".format)
    bw = res.get("read_gb_s")

    def achieved(ctx_key, ctx):  # GB/s of weights + K/V a decode step reads
        def f(d):
            b, rate = d.get("bytes") or {}, d.get(ctx_key)
            return None if not b or rate is None else (b["weights"] + b["kv_per_token"] * ctx) * rate / 1e9
        return f

    for ctx_key, ctx, label in [("decode_tok_per_s", 32, "32")] + [
            (k, int(k.split("_")[1][3:]), k.split("_")[1][3:]) for k in sorted(eng[names[0]])
            if k.startswith("decode_ctx") and k.endswith("_tok_per_s")]:
        row(f"decode after {label}: weights+KV read (GB/s)", achieved(ctx_key, ctx), "{:.1f}".format)
    row("cold start to 1st token (s)", get("cold_start_s"), "{:.2f}".format, False)
    row("peak RSS (MB)", get("peak_rss_mb"), "{:.0f}".format, False)
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    note = [f"{res['threads']} threads, {res['runs']} interleaved rounds, medians; ratios: > 1 means localllm is "
            "better (faster, or less time / memory)."]
    if bw:
        note.append(f"machine read bandwidth ({res['threads']} threads, 1 GiB sum): {bw:.1f} GB/s = the decode roofline")
    for p in peers:
        for k in (k for k in eng[p] if k.startswith("decode") and k.endswith("_round_ratio")):
            note.append(f"{k.removesuffix('_round_ratio')}, median of per-round ratios localllm / {p}: "
                        f"{eng[p][k]:.2f}x")
    return "\n".join(lines + note)


if __name__ == "__main__":
    main()
