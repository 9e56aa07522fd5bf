"""What a background build of the compiled step costs a chat session's foreground decode.

    .venv/bin/python bench/build_slowdown.py [--threads 2] [--tokens 128] [--think 10]

A first `run`/`chat` on a model answers eagerly while `python -m localllm.model.compiled` builds
the packages at idle CPU priority; the engine stops the builder while it has work and continues
it when idle. This plays a chat on the embedded model in a fresh LOCALLLM_HOME (so it really
builds): replies of --tokens greedy tokens, each followed by --think seconds of the user reading
and typing, until the replies run compiled. Printed: eager decode alone (before any build), each
reply's tok/s while the build is pending, the first compiled reply, how long the build took, and
eager decode alone again once every package is built (the baseline is both "alone" sets).
--no-pause lets the builder run beside the decode (a builder this script starts itself, which
the engine does not stop): what the pause avoids.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--think", type=float, default=10.0, help="idle seconds between replies")
    ap.add_argument("--max-replies", type=int, default=60)
    ap.add_argument("--no-pause", action="store_true")
    args = ap.parse_args()
    os.environ["LOCALLLM_HOME"] = tempfile.mkdtemp(prefix="build_slowdown_")
    import torch

    torch.set_num_threads(args.threads)
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine
    from localllm.model import build_queue, compiled
    from localllm.model.loader import load_model
    from localllm.registry import resolve_model
    from localllm.sampling import SamplingParams

    loaded = load_model(resolve_model(None).local_path, "auto")
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def reply(eng, salt: int) -> float:
        stamps = [time.perf_counter() for _ in eng.generate([100 + salt] + list(range(200, 231)), params)]
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    eager = LLMEngine(loaded, EngineConfig(compile=False, parallel=1, enable_prefix_caching=False))
    reply(eager, 0)  # warm-up
    alone = [reply(eager, i) for i in range(5)]
    del eager
    eng = LLMEngine(loaded, EngineConfig(compile=True, parallel=1, enable_prefix_caching=False))
    step = eng.runner.captured
    if args.no_pause:  # a worker outside the build queue (builder.json does not name it): never stopped
        step.background = False
        job = compiled.cache_dir() / "no-pause-job.json"
        job.parent.mkdir(parents=True, exist_ok=True)
        job.write_text(json.dumps(compiled.job_spec(loaded.model, loaded.kv_dtype)))
        build_queue.spawn_worker(job, compiled.cache_dir() / "build.log")
    t0 = time.perf_counter()
    pending, first_compiled = [], None
    for i in range(args.max_replies):
        before = step.steps
        r = reply(eng, 10 + i)
        if step.steps - before >= args.tokens // 2:
            first_compiled = (i, r, time.perf_counter() - t0)
            break
        pending.append(r)
        time.sleep(args.think)
    # the machine drifts: "alone" is measured before the build and again after it has finished
    step.wait(timeout=1800)
    eager = LLMEngine(loaded, EngineConfig(compile=False, parallel=1, enable_prefix_caching=False))
    after = [reply(eager, 100 + i) for i in range(5)]
    print(f"eager decode alone, {args.threads} threads, {args.tokens} tokens: before the build "
          f"{statistics.median(alone):.1f} tok/s (runs {[round(x, 1) for x in alone]}), after it "
          f"{statistics.median(after):.1f} (runs {[round(x, 1) for x in after]})")
    alone = alone + after
    if pending:
        print(f"replies while the build was pending ({'builder running beside them' if args.no_pause else 'builder stopped during replies'}"
              f", {args.think:.0f} s idle between): median {statistics.median(pending):.1f} tok/s, "
              f"runs {[round(x, 1) for x in pending]}")
        print(f"foreground slowdown vs eager alone: {1 - statistics.median(pending) / statistics.median(alone):+.1%}")
    if first_compiled:
        i, r, t = first_compiled
        print(f"reply {i + 1} ran compiled: {r:.1f} tok/s, {t:.0f} s after the session started")
    else:
        print(f"no compiled reply within {args.max_replies} replies")


if __name__ == "__main__":
    main()
