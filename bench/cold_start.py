"""Cold start: wall time of whole processes that load the embedded model and answer one token.

    python bench/cold_start.py [--runs 5] [--model PATH.gguf]

Each command runs once to warm the page cache (and localllm's conversion cache), then --runs
times; prints min / median / max. Rows: `echo hi | localllm run -n 1`; `python -c "import
torch"` (the floor any torch program pays); a llama-cpp-python process doing the same (load +
one token), when llama_cpp is importable (`make bench-setup`).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

LLAMA_CPP = """import sys
from llama_cpp import Llama
m = Llama(sys.argv[1], n_ctx=512, n_threads=2, verbose=False)
print(m.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=1)["choices"][0]["message"]["content"])
"""


def timed(argv: list[str], stdin: bytes | None, runs: int) -> list[float]:
    subprocess.run(argv, input=stdin, capture_output=True, check=True)  # warm
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, input=stdin, capture_output=True, check=True)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--model", help="GGUF file (default: the embedded model)")
    args = ap.parse_args()
    from localllm.registry import resolve_model

    model = args.model or str(resolve_model(None).local_path)
    rows = {"localllm run -n 1": ([sys.executable, "-m", "localllm.cli", "run", model, "-n", "1"], b"hi\n"),
            "python -c 'import torch'": ([sys.executable, "-c", "import torch"], None)}
    try:
        import llama_cpp  # noqa: F401

        rows["llama-cpp-python, load + 1 token"] = ([sys.executable, "-c", LLAMA_CPP, model], None)
    except ImportError:
        print("(llama_cpp not installed: `make bench-setup`)", file=sys.stderr)
    for name, (argv, stdin) in rows.items():
        t = timed(argv, stdin, args.runs)
        print(f"{name:34s} min {min(t):.2f} s  median {statistics.median(t):.2f} s  max {max(t):.2f} s")


if __name__ == "__main__":
    main()
