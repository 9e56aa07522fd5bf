"""Fill-in-the-middle autocomplete latency: time to first token after one keystroke, through
`localllm serve` and through llama.cpp (llama-cpp-python) on the same GGUF file.

    python bench/fim_latency.py [--model smollm2-135m] [--threads 1] [--prefix-tokens 1000]
                                [--suffix-tokens 100] [--keystrokes 8] [--runs 3]

An editor sends the whole file on every keystroke: the text before the cursor grows by one
character, the text after it stays. Both engines keep the previous request's KV and reuse the
longest common prefix (ours: the prefix cache, whole 16-token blocks; llama-cpp-python: its
token-level prefix match, what llama.cpp's /infill gets from cache_prompt), so each keystroke
recomputes the block holding the cursor plus the suffix. The first request of a run fills the
cache and is not counted.

The embedded SmolLM2 GGUF has no FIM tokens, so the prompts are raw token ids in the layout of a
FIM prompt, [PRE] prefix [SUF] suffix [MID], with three of its special tokens (<repo_name>,
<file_sep>, <filename>) standing in for the FIM tokens; both engines get exactly the same ids
(/v1/completions with a token-id prompt; create_completion(prompt=ids)). TTFT: ours from sending
the request to the first streamed token on the client; llama.cpp's from calling create_completion
to its first streamed chunk, in-process (no HTTP); and the CPU time each spent on it (the whole
server process, HTTP included; llama.cpp's process). Keystrokes alternate between the two
engines, so that a busy machine slows both alike. Loopback only; never part of CI.
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

CODE = '''def parse_{i}(line: str) -> dict:
    """Split one log line into its fields."""
    stamp, level, *rest = line.split(" ", 2)
    return {{"stamp": stamp, "level": level.strip("[]"), "text": rest[0] if rest else ""}}

'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def file_ids(tok, prefix_tokens: int, suffix_tokens: int) -> tuple[str, list[int]]:
    """(prefix text of about `prefix_tokens` tokens, suffix ids)."""
    text, i = "", 0
    while len(tok.encode(text)) < prefix_tokens:
        text += CODE.format(i=i)
        i += 1
    suffix = tok.encode("".join(CODE.format(i=1000 + j) for j in range(8)))[:suffix_tokens]
    return text + "def tail(x):\n    return ", suffix


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (all its threads), from /proc."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ours_ttft(url: str, model: str, ids: list[int]) -> float:
    body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text") is not None:
                    return time.perf_counter() - t0
    raise RuntimeError("no token streamed")


def ours_rate(url: str, model: str, ids: list[int], n: int) -> float:
    """Decode tokens/s of one infill: between the first and the last streamed token."""
    body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    stamps = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def llama_rate(llm, ids: list[int], n: int) -> float:
    # llama-cpp-python has no ignore_eos: should it stop early, the rate is of the tokens it made
    stamps = [time.perf_counter() for _ in llm.create_completion(prompt=ids, max_tokens=n, temperature=0,
                                                                 stream=True)]
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def llama_ttft(llm, ids: list[int]) -> float:
    t0 = time.perf_counter()
    for _ in llm.create_completion(prompt=ids, max_tokens=1, temperature=0, stream=True):
        return time.perf_counter() - t0
    raise RuntimeError("no token streamed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--suffix-tokens", type=int, default=100)
    ap.add_argument("--keystrokes", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--decode-tokens", type=int, default=32, help="tokens of one infill per run, for tokens/s")
    args = ap.parse_args()

    import llama_cpp

    from localllm.models_cli import local_path
    from localllm.registry import resolve_model
    from localllm.tokenizer import LLMTokenizer

    path = local_path(resolve_model(args.model))
    if path is None or path.suffix != ".gguf":
        sys.exit(f"{args.model}: needs a local .gguf file (both engines read the same one)")
    from localllm.model.gguf import read_gguf

    tok = LLMTokenizer.from_gguf(read_gguf(path).metadata)
    pre, suf, mid = (tok.tok.token_to_id(t) for t in ("<repo_name>", "<file_sep>", "<filename>"))
    prefix, suffix_ids = file_ids(tok, args.prefix_tokens, args.suffix_tokens)

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "localllm.cli", "serve", str(path), "--host", "127.0.0.1",
                               "--port", str(port), "--threads", str(args.threads), "--ctx", "4096"], env=env,
                              stderr=subprocess.DEVNULL)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=4096, n_threads=args.threads, n_threads_batch=args.threads,
                          n_batch=512, verbose=False)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        times: dict[str, list[float]] = {"localllm": [], "llama.cpp": []}
        cpu: dict[str, list[float]] = {"localllm": [], "llama.cpp": []}
        cold: dict[str, list[float]] = {"localllm": [], "llama.cpp": []}
        rate: dict[str, list[float]] = {"localllm": [], "llama.cpp": []}
        prompt_len = 0
        for run in range(args.runs):
            # a different file per run: the first request of a run meets an empty cache on both
            text = f"# run {run}\n" + prefix
            for k in range(args.keystrokes + 1):
                ids = [pre, *tok.encode(text + "abcdefghijklmnop"[:k]), suf, *suffix_ids, mid]
                prompt_len = len(ids)
                c0 = cpu_seconds(server.pid)
                a = ours_ttft(url, str(path), ids)
                c1, p0 = cpu_seconds(server.pid), time.process_time()
                b = llama_ttft(llm, ids)
                p1 = time.process_time()
                if not k:  # the first request of a file fills the caches
                    cold["localllm"].append(a)
                    cold["llama.cpp"].append(b)
                    continue
                times["localllm"].append(a)
                times["llama.cpp"].append(b)
                cpu["localllm"].append(c1 - c0)
                cpu["llama.cpp"].append(p1 - p0)
            if args.decode_tokens > 1:  # the infill itself, after the last keystroke (its prompt cached)
                rate["localllm"].append(ours_rate(url, str(path), ids, args.decode_tokens))
                rate["llama.cpp"].append(llama_rate(llm, ids, args.decode_tokens))
    finally:
        server.terminate()
        server.wait(timeout=30)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ratios = [a / b for a, b in zip(times["localllm"], times["llama.cpp"])]
    cmed = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
    fill = {k: statistics.median(v) * 1e3 for k, v in cold.items()}
    print(f"FIM keystroke TTFT, {args.model} ({path.name}), {args.threads} thread(s), prompt {prompt_len} tokens "
          f"({args.prefix_tokens} prefix + {args.suffix_tokens} suffix), {args.runs} runs x {args.keystrokes} "
          "keystrokes:")
    print(f"  localllm serve {med['localllm']:.1f} ms   llama.cpp (llama-cpp-python {llama_cpp.__version__}) "
          f"{med['llama.cpp']:.1f} ms   ratio (median of per-keystroke ratios) {statistics.median(ratios):.2f}x")
    print(f"  CPU time per keystroke (server process / llama.cpp's process): {cmed['localllm']:.0f} ms vs "
          f"{cmed['llama.cpp']:.0f} ms, {cmed['localllm'] / cmed['llama.cpp']:.2f}x")
    print(f"  first request of a file (nothing cached): {fill['localllm']:.0f} ms vs {fill['llama.cpp']:.0f} ms")
    if rate["localllm"]:
        r = {k: statistics.median(v) for k, v in rate.items()}
        print(f"  infill decode ({args.decode_tokens} tokens, greedy, ignore_eos): {r['localllm']:.1f} vs "
              f"{r['llama.cpp']:.1f} tok/s")


if __name__ == "__main__":
    main()
