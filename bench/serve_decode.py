"""Single-stream decode through `localllm serve` against `localllm run`'s engine, default settings.

    python bench/serve_decode.py [--model M] [--threads 2] [--runs 5] [--tokens 128]

The server's engine steps in a thread of its own while uvicorn's event loop holds the main
thread; `run` steps in the main thread. This measures what that costs one streaming client:
tokens/s between the first and the last streamed token of a /v1/completions request (greedy,
ignore_eos), interleaved round by round with the same prompt decoded by an in-process LLM()
in a worker process. Loopback only; never part of CI.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

PROMPT = "Write a long story about a lighthouse keeper and the sea."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_rate(url: str, model: str, n: int) -> float:
    body = {"model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True}
    stamps = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def captured_steps(url: str) -> float:
    from localllm.server.metrics import parse

    return parse(httpx.get(f"{url}/metrics", timeout=5).text).get("localllm_captured_steps_total", 0.0)


WORKER = """
import sys, time, json, torch
from localllm import LLM
from localllm.bench import wait_for_compiled
from localllm.sampling import SamplingParams
llm = LLM({model!r})
wait_for_compiled(llm.engine)
ids = llm.tokenizer.encode({prompt!r})
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    stamps = [time.perf_counter() for _ in llm.engine.generate(ids, SamplingParams(temperature=0, max_tokens=n,
                                                                                  ignore_eos=True))]
    print((len(stamps) - 1) / (stamps[-1] - stamps[0]), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "localllm.cli", "serve", args.model, "--port", str(port),
                               "--threads", str(args.threads)], env=env, stderr=subprocess.DEVNULL)
    worker = subprocess.Popen([sys.executable, "-c", WORKER.format(model=args.model, prompt=PROMPT)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "ready", "the in-process worker died"
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        for _ in range(120):  # until the server decodes through its compiled step (a first start builds it)
            before = captured_steps(url)
            server_rate(url, args.model, 16)
            if captured_steps(url) - before >= 10:
                break
            time.sleep(5)
        rates = {"serve": [], "run": []}
        for _ in range(args.runs):
            rates["serve"].append(server_rate(url, args.model, args.tokens))
            worker.stdin.write(f"{args.tokens}\n")
            worker.stdin.flush()
            rates["run"].append(float(worker.stdout.readline()))
    finally:
        server.terminate()
        worker.stdin.close()
        server.wait(timeout=30)
        worker.wait(timeout=30)
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = statistics.median(a / b for a, b in zip(rates["serve"], rates["run"]))
    print(f"decode tok/s, {args.threads} threads, {args.runs} interleaved rounds of {args.tokens} tokens:")
    print(f"  serve (one streaming client) {med['serve']:.1f}   run engine {med['run']:.1f}   "
          f"serve / run (median of per-round ratios) {ratio:.2f}x")


if __name__ == "__main__":
    main()
