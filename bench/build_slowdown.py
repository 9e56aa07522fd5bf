"""How much a background build of the compiled step slows the foreground decode.

    .venv/bin/python bench/build_slowdown.py [--threads 2] [--runs 5] [--tokens 128]

A first `run`/`chat` on a model answers eagerly while `python -m localllm.model.compiled` builds
the packages at idle CPU priority (SCHED_IDLE). This measures eager decode tok/s of the embedded
model alone, then with a builder working in a fresh LOCALLLM_HOME (so it really builds),
interleaving runs while the builder is alive. --policy normal builds at normal priority instead,
for comparison.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--policy", choices=("idle", "normal"), default="idle")
    args = ap.parse_args()
    os.environ["LOCALLLM_HOME"] = tempfile.mkdtemp(prefix="build_slowdown_")
    import torch

    torch.set_num_threads(args.threads)
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine
    from localllm.model import compiled
    from localllm.model.loader import load_model
    from localllm.registry import resolve_model
    from localllm.sampling import SamplingParams

    loaded = load_model(resolve_model(None).local_path, "auto")
    eng = LLMEngine(loaded, EngineConfig(compile=False, num_kv_blocks=64, enable_prefix_caching=False))
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def rate(salt: int) -> float:
        stamps = [time.perf_counter() for _ in eng.generate([100 + salt] + list(range(200, 231)), params)]
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    rate(0)  # warm-up
    alone = [rate(i) for i in range(args.runs)]
    spec = {"origin": loaded.model.origin, "kv_dtype": str(loaded.kv_dtype).removeprefix("torch."),
            "threads": args.threads}
    if args.policy == "normal":  # the same builder without lowering its priority
        code = ("import json, sys; from localllm.model import compiled; "
                "sys.exit(compiled._builder_main(json.loads(sys.argv[1])))")
        import json

        proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(spec)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    else:
        proc = compiled.spawn_builder(spec["origin"], loaded.kv_dtype, args.threads,
                                      compiled.cache_dir() / "build.log")
    time.sleep(3.0)  # past its imports: loading the model and exporting
    during = []
    t0 = time.perf_counter()
    while proc.poll() is None and len(during) < 4 * args.runs:
        during.append(rate(100 + len(during)))
    build_s = time.perf_counter() - t0
    proc.kill()
    proc.wait()
    a, d = statistics.median(alone), statistics.median(during) if during else float("nan")
    print(f"eager decode, {args.threads} threads, {args.tokens} tokens: alone {a:.1f} tok/s (runs {[round(x, 1) for x in alone]})")
    print(f"while a {args.policy}-priority build runs: {d:.1f} tok/s over {len(during)} runs in {build_s:.0f} s "
          f"(runs {[round(x, 1) for x in during]})")
    print(f"foreground slowdown: {1 - d / a:+.1%}")


if __name__ == "__main__":
    main()
