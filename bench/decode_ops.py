"""Eager decode with the plain torch ops vs our fused CPU ops (localllm.model.cpu_ops) called one
by one from Python vs the same ops as one C++ call per layer (the default) vs the compiled step, in
one process, interleaved: CPU time and wall time per token (issue 31, item 1).

    python bench/decode_ops.py [--model PATH] [--threads 1] [--tokens 64] [--rounds 7] [--profile]

CPU time is the process's (every thread), so a loaded machine inflates wall time more than it.
The compiled row appears when the model's package for this thread count is already built
(nothing is built here). --profile prints torch.profiler's per-op table for each eager op set.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine
    from localllm.model.cpu_ops import fused_cpu_ops
    from localllm.model.llama import Ops
    from localllm.model.loader import load_model
    from localllm.registry import resolve_model
    from localllm.sampling import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model or resolve_model(None).local_path, "auto")
    model = loaded.model
    msgs = [{"role": "user", "content": "Tell me a story about a robot."}]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    engines = {}
    for name, fused in (("eager, torch ops", False), ("eager, fused ops one by one", "ops"),
                        ("eager, fused ops, one call per layer", True)):
        engines[name] = (LLMEngine(loaded, EngineConfig(num_kv_blocks=64, compile=False)), fused)
    step = LLMEngine(loaded, EngineConfig(num_kv_blocks=64, compile=True, background_build=False))
    if step.runner.captured is not None and step.runner.captured._runner("d1") is not None:
        engines["compiled step"] = (step, True)

    def run(name: str) -> tuple[float, float, list[int]]:
        eng, fused = engines[name]
        model.use_attention("torch", fused_cpu=bool(fused))
        if fused == "ops":
            model.ops = fused_cpu_ops(Ops.for_backend("torch"), one_call_layers=False)
        c0 = w0 = last = None
        for last in eng.generate(msgs, params):  # noqa: B007 (the last output holds the tokens)
            if c0 is None:  # the first token is out: the prefill is behind us
                c0, w0 = time.process_time(), time.perf_counter()
        n = args.tokens - 1
        return (time.process_time() - c0) / n, (time.perf_counter() - w0) / n, last.token_ids

    times: dict[str, list[tuple[float, float]]] = {n: [] for n in engines}
    tokens = {}
    for _ in range(args.rounds):
        for name in engines:
            c, w, toks = run(name)
            times[name].append((c, w))
            tokens.setdefault(name, toks)
    ref = tokens["eager, torch ops"]
    print(f"decode steps after the first token, {args.tokens} tokens per run, {args.rounds} rounds, "
          f"{args.threads} thread(s); medians")
    print("| step | CPU ms/token | wall ms/token | tok/s (wall) | tokens equal to torch ops' |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        c = statistics.median(t[0] for t in ts) * 1e3
        w = statistics.median(t[1] for t in ts) * 1e3
        print(f"| {name} | {c:.2f} | {w:.2f} | {1e3 / w:.1f} | {tokens[name] == ref} |")
    model.use_attention("torch", fused_cpu=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name in ("eager, fused ops one by one", "eager, fused ops, one call per layer"):
            with profile(activities=[ProfilerActivity.CPU]) as p:
                run(name)
            print(f"\n{name}:\n" + p.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
