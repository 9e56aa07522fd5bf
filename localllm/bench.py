"""`localllm bench`: what a user compares engines on, measured through the engine's own API.

Every figure is the median of several runs. Prefill and decode use an engine with prefix
caching off (repeated prompts would otherwise be served from the cache); the cache figure uses
one with it on.
"""

from __future__ import annotations

import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from .config import EngineConfig
from .engine.engine import LLMEngine
from .sampling import SamplingParams

TEXT = (
    "The history of computing is a story of people turning ideas about calculation into machines. "
    "Early mechanical calculators could add and subtract; later designs stored programs in memory, "
    "so the same hardware could solve many problems. Each generation made machines smaller, faster "
    "and cheaper, and each opened new uses: weather forecasts, airline bookings, spreadsheets, the web. "
)
CODE_EDIT = ("Rewrite this code with one change: rename the variable total to result.\n\n"
             "def summarize(values):\n    total = 0\n    for v in values:\n        total += v\n"
             "    average = total / len(values)\n    print('total', total)\n    print('average', average)\n"
             "    return total, average\n")


@dataclass
class BenchConfig:
    prefill_lengths: tuple[int, ...] = (32, 512, 2048)
    decode_tokens: int = 128
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64)
    batch_tokens: int = 64
    runs: int = 5
    system_prompt_tokens: int = 1000
    cold_start: bool = True
    speculative: bool = True
    draft_model: bool = True  # fp32 target with the int4 model as its draft (loads a second copy)

    @classmethod
    def quick(cls) -> BenchConfig:
        return cls(prefill_lengths=(32, 128), decode_tokens=16, batch_sizes=(1, 4), batch_tokens=8, runs=2,
                   system_prompt_tokens=200, cold_start=False, speculative=True, draft_model=False)


def _tokens(engine: LLMEngine, n: int, salt: int = 0) -> list[int]:
    ids = engine.tokenizer.encode(TEXT)
    out = (ids * (n // len(ids) + 2))[:n]
    out[0] = 100 + salt  # distinct prompts: no run reuses another's KV
    return out


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def bench_prefill(engine: LLMEngine, lengths, runs: int) -> dict:
    out = {}
    for n in lengths:
        if n >= engine.max_model_len:
            continue
        times = []
        for r in range(runs):
            ids = _tokens(engine, n, r)
            t0 = time.perf_counter()
            engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1))
            _drain(engine)
            times.append(time.perf_counter() - t0)
        out[str(n)] = {"seconds": _median(times), "tok_per_s": n / _median(times)}
    return out


def _timed(engine: LLMEngine, prompt, params: SamplingParams):
    """-> (time to first output, time from first to last output, last output)."""
    t0 = time.perf_counter()
    first = last = None
    for out in engine.generate(prompt, params):
        first = first or time.perf_counter()
        last = out
    return first - t0, time.perf_counter() - first, last


def bench_decode(engine: LLMEngine, tokens: int, runs: int, prompt_len: int = 32) -> dict:
    rates, ttfts = [], []
    for r in range(runs):
        p = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        ttft, dt, _ = _timed(engine, _tokens(engine, prompt_len, 50 + r), p)
        ttfts.append(ttft)
        rates.append((tokens - 1) / dt)
    return {"tok_per_s": _median(rates), "ttft_s": _median(ttfts), "runs": rates}


def bench_batches(engine: LLMEngine, sizes, tokens: int, runs: int) -> dict:
    out = {}
    for b in sizes:
        rates = []
        # a warm-up per batch shape: the first calls of a shape stay out of the timing
        for i in range(b):
            engine.add_request(_tokens(engine, 32, 900 + i), SamplingParams(temperature=0, max_tokens=3))
        _drain(engine)
        for r in range(runs):
            for i in range(b):
                engine.add_request(_tokens(engine, 32, 1000 * (r + 1) + i),
                                   SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
            t0 = time.perf_counter()
            _drain(engine)
            rates.append(b * tokens / (time.perf_counter() - t0))
        out[str(b)] = {"aggregate_tok_per_s": _median(rates), "per_seq_tok_per_s": _median(rates) / b}
    base = out.get("1", {}).get("aggregate_tok_per_s")
    for v in out.values():
        v["speedup_vs_batch1"] = v["aggregate_tok_per_s"] / base if base else None
    return out


def bench_prefix_cache(engine: LLMEngine, system_tokens: int, runs: int) -> dict:
    """TTFT of a chat's second turn vs its first, with a long system prompt."""
    words = (TEXT * (system_tokens // 40 + 2)).split()
    t1s, t2s, hits = [], [], []
    for r in range(runs):
        sys_ids = engine.tokenizer.encode(f"Session {r}. " + " ".join(words))[:system_tokens]
        turn1 = [{"role": "system", "content": engine.tokenizer.decode(sys_ids)},
                 {"role": "user", "content": "Summarize in one line."}]
        ttft1, _, reply = _timed(engine, turn1, SamplingParams(temperature=0, max_tokens=16))
        turn2 = turn1 + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "Now in French."}]
        ttft2, _, out = _timed(engine, turn2, SamplingParams(temperature=0, max_tokens=1))
        t1s.append(ttft1)
        t2s.append(ttft2)
        hits.append(out.num_cached_tokens / out.num_prompt_tokens)
    return {"system_prompt_tokens": system_tokens, "turn1_ttft_s": _median(t1s), "turn2_ttft_s": _median(t2s),
            "ttft_ratio": _median(t2s) / _median(t1s), "turn2_hit_rate": _median(hits)}


def bench_speculative(engine_plain: LLMEngine, engine_spec: LLMEngine, tokens: int, runs: int) -> dict:
    """Decode speed on a code-edit prompt (n-gram lookup shines there), with and without."""
    msgs = [{"role": "user", "content": CODE_EDIT}]
    p = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    plain, spec = [], []
    for _ in range(runs):
        _, dt, out_plain = _timed(engine_plain, msgs, p)
        plain.append((len(out_plain.token_ids) - 1) / dt)
        _, dt, out_spec = _timed(engine_spec, msgs, p)
        spec.append((len(out_spec.token_ids) - 1) / dt)
    st = engine_spec.cache_stats()["speculative"]
    return {"plain_tok_per_s": _median(plain), "spec_tok_per_s": _median(spec),
            "speedup": _median(spec) / _median(plain), "same_tokens": out_plain.token_ids == out_spec.token_ids,
            **{k: st[k] for k in ("acceptance_rate", "mean_accepted_length")}}


def cold_start(model: str | None, runs: int) -> dict:
    """Process start to first streamed token of `localllm run`."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "localllm.cli", "run", "--temperature", "0", "-n", "2"]
        proc = subprocess.Popen(cmd + ([model] if model else []) + ["Hi"], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
        proc.stdout.read(1)
        times.append(time.perf_counter() - t0)
        proc.wait(timeout=120)
    return {"seconds": _median(times), "runs": times}


def wait_for_compiled(engine: LLMEngine) -> float | None:
    """Seconds spent waiting for the engine's compiled CPU step (a first run on a model builds it
    in the background; later runs load it), or None when the engine has none."""
    from .engine.compiled_step import CompiledStep

    step = engine.runner.captured
    if not isinstance(step, CompiledStep):
        return None
    t0 = time.perf_counter()
    if not step.wait():
        raise RuntimeError("the compiled step could not be built; see ~/.cache/localllm/aoti/build.log")
    return time.perf_counter() - t0


def run_bench(model: str | None = None, precision: str = "auto", cfg: BenchConfig | None = None,
              threads: int | None = None, log=print, eager: bool = False) -> dict:
    from .hardware import pick_device
    from .llm import _load

    cfg = cfg or BenchConfig()
    t0 = time.perf_counter()
    ref, loaded = _load(model, precision, pick_device("auto"), None)
    load_s = time.perf_counter() - t0
    result = {"model": ref.name, "precision": loaded.precision, "threads": threads or _threads(),
              "load_s": load_s, "compiled": not eager}
    max_seqs = max(cfg.batch_sizes)
    ctx = max(max(cfg.prefill_lengths) + 64, cfg.system_prompt_tokens + 200, 512)
    ctx = min(ctx, loaded.max_model_len)

    def engine(**kw) -> LLMEngine:
        base = dict(max_model_len=ctx, num_threads=threads, max_num_seqs=max_seqs,
                    max_num_batched_tokens=max(2048, max(cfg.prefill_lengths)),
                    num_kv_blocks=(max_seqs * 160 + ctx) // 16 + 8, compile=not eager)
        return LLMEngine(loaded, EngineConfig(**{**base, **kw}))

    plain = engine(enable_prefix_caching=False)
    waited = wait_for_compiled(plain)
    if waited is not None and waited > 1:
        log(f"waited {waited:.0f} s for the compiled step to be built (once per model)")
    result["compile_wait_s"] = waited
    log("prefill ...")
    result["prefill"] = bench_prefill(plain, cfg.prefill_lengths, cfg.runs)
    log("decode ...")
    result["decode"] = bench_decode(plain, cfg.decode_tokens, cfg.runs)
    result["ttft_s"] = result["decode"]["ttft_s"]
    log("batches ...")
    result["batch"] = bench_batches(plain, cfg.batch_sizes, cfg.batch_tokens, max(1, cfg.runs // 2))
    log("prefix cache ...")
    result["prefix_cache"] = bench_prefix_cache(engine(), cfg.system_prompt_tokens, cfg.runs)
    if cfg.speculative:
        log("speculative (n-gram) ...")
        spec = engine(enable_prefix_caching=False, speculative="ngram")
        result["speculative_ngram"] = bench_speculative(plain, spec, cfg.decode_tokens, cfg.runs)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if cfg.speculative and cfg.draft_model:
        log("speculative (draft model: fp32 target, this model as draft) ...")
        _, target = _load(model, "float32", pick_device("auto"), None)
        fp32 = LLMEngine(target, EngineConfig(max_model_len=ctx, num_threads=threads, enable_prefix_caching=False,
                                              compile=not eager))
        wait_for_compiled(fp32)
        spec = LLMEngine(target, EngineConfig(max_model_len=ctx, num_threads=threads, enable_prefix_caching=False,
                                              speculative="draft", compile=not eager), draft=loaded)
        wait_for_compiled(spec)
        result["speculative_draft"] = bench_speculative(fp32, spec, cfg.decode_tokens, cfg.runs)
    if cfg.cold_start:
        log("cold start ...")
        result["cold_start"] = cold_start(model, min(cfg.runs, 3))
    return result


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def render(result: dict) -> str:
    mode = "compiled" if result.get("compiled") else "eager"
    rows = [("model", f"{result['model']} ({result['precision']}, {result['threads']} threads, {mode})"),
            ("load", f"{result['load_s']:.2f} s")]
    for n, v in result["prefill"].items():
        rows.append((f"prefill {n} tokens", f"{v['tok_per_s']:.0f} tok/s ({v['seconds'] * 1000:.0f} ms)"))
    rows.append(("decode, batch 1", f"{result['decode']['tok_per_s']:.1f} tok/s"))
    rows.append(("TTFT (32-token prompt)", f"{result['ttft_s'] * 1000:.0f} ms"))
    for b, v in result["batch"].items():
        rows.append((f"aggregate, {b} streams", f"{v['aggregate_tok_per_s']:.1f} tok/s "
                                                f"({v['speedup_vs_batch1']:.2f}x batch 1)"))
    pc = result["prefix_cache"]
    rows.append((f"chat turn 2 TTFT / turn 1 ({pc['system_prompt_tokens']}-token system prompt)",
                 f"{pc['turn2_ttft_s'] * 1000:.0f} / {pc['turn1_ttft_s'] * 1000:.0f} ms = {pc['ttft_ratio']:.1%}, "
                 f"hit rate {pc['turn2_hit_rate']:.0%}"))
    for key, label in (("speculative_ngram", "n-gram speculation (code edit)"),
                       ("speculative_draft", "fp32 target + this model as draft")):
        if key in result:
            sp = result[key]
            rows.append((label, f"{sp['spec_tok_per_s']:.1f} vs {sp['plain_tok_per_s']:.1f} tok/s = "
                                f"{sp['speedup']:.2f}x, acceptance {sp['acceptance_rate']:.0%}, "
                                f"{sp['mean_accepted_length']:.2f} tokens/step, same tokens: {sp['same_tokens']}"))
    if "cold_start" in result:
        rows.append(("cold start to first token", f"{result['cold_start']['seconds']:.2f} s"))
    rows.append(("peak RSS", f"{result['peak_rss_mb']:.0f} MB"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
