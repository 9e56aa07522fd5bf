"""Load test for `localllm serve`: N concurrent streaming chat clients for T seconds (loopback only).

    python bench/load.py --start --clients 16 --duration 30            # starts its own server
    python bench/load.py --url http://127.0.0.1:8000 --clients 64 --duration 120

Each client sends streaming /v1/chat/completions requests back to back until the time is up (then
finishes the one in flight; stops by itself). Prints output tokens/s, TTFT p50/p99, end-to-end
latency, errors, the engine's largest batch, and leaked KV blocks: /metrics once every request
has finished, where `localllm_kv_blocks_used` must be back to 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

SYSTEM = "You are a helpful assistant. Answer briefly and clearly."  # shared prefix: prefix-cache hits
TOPICS = ["the sea", "mountains", "coffee", "bicycles", "libraries", "volcanoes", "owls", "trains", "rain",
          "chess", "bread", "comets", "gardens", "bridges", "music", "maps"]


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0
    errors: list[str] = field(default_factory=list)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def one_request(http: httpx.AsyncClient, body: dict, res: Result) -> None:
    t0 = time.perf_counter()
    first = None
    usage = None
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.errors.append(f"stream error: {chunk['error'].get('message')}")
                    return
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for c in chunk.get("choices", []):
                    if first is None and c["delta"].get("content"):
                        first = time.perf_counter()
            if not done or usage is None:
                res.errors.append("stream ended without [DONE] or usage")
                return
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.errors.append(f"{type(e).__name__}: {e}")
        return
    end = time.perf_counter()
    res.requests += 1
    res.tokens += usage["completion_tokens"]
    res.e2e.append(end - t0)
    if first is not None:
        res.ttft.append(first - t0)


async def client_loop(i: int, http: httpx.AsyncClient, args, deadline: float, res: Result) -> None:
    k = 0
    while time.perf_counter() < deadline:
        topic = TOPICS[(i + k) % len(TOPICS)]
        body = {"model": args.model, "max_tokens": args.max_tokens, "temperature": args.temperature,
                "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"Client {i}, request {k}: tell me about {topic}."}]}
        await one_request(http, body, res)
        k += 1


async def metrics(http: httpx.AsyncClient) -> dict[str, float]:
    r = await http.get("/metrics")
    r.raise_for_status()
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            out[k] = float(v)
    return out


async def run(args, base: str) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    timeout = httpx.Timeout(args.request_timeout, connect=10)
    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=timeout) as http:
        if args.model is None:
            args.model = (await http.get("/v1/models")).json()["data"][0]["id"]
        before = await metrics(http)
        res = Result()
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(i, http, args, t0 + args.duration, res) for i in range(args.clients)))
        wall = time.perf_counter() - t0
        # every request has returned; the engine must hold no blocks once it has noticed
        settle = time.perf_counter() + 10
        while True:
            after = await metrics(http)
            idle = after.get("localllm_num_requests_running", 0) == 0 and after.get("localllm_num_requests_waiting", 0) == 0
            if idle or time.perf_counter() > settle:
                break
            await asyncio.sleep(0.1)
    return {
        "clients": args.clients, "duration_s": args.duration, "wall_s": round(wall, 1),
        "requests": res.requests, "errors": len(res.errors), "error_samples": res.errors[:5],
        "output_tokens": res.tokens, "output_tok_per_s": round(res.tokens / wall, 1),
        "ttft_p50_ms": round(pct(res.ttft, 50) * 1000), "ttft_p99_ms": round(pct(res.ttft, 99) * 1000),
        "e2e_p50_s": round(pct(res.e2e, 50), 2), "e2e_p99_s": round(pct(res.e2e, 99), 2),
        "max_batch_size": after.get("localllm_max_batch_size"),
        "prefix_cache_hit_rate": round(after.get("localllm_prefix_cache_hit_rate", 0.0), 3),
        "preemptions": after.get("localllm_preemptions_total", 0) - before.get("localllm_preemptions_total", 0),
        "leaked_kv_blocks": after.get("localllm_kv_blocks_used"),
        "running_after": after.get("localllm_num_requests_running"),
        "waiting_after": after.get("localllm_num_requests_waiting"),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(serve_args: list[str]) -> tuple[subprocess.Popen, str, tempfile._TemporaryFileWrapper]:
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="localllm-load-", suffix=".log")
    proc = subprocess.Popen([sys.executable, "-m", "localllm.cli", "serve", "--host", "127.0.0.1",
                             "--port", str(port), *serve_args], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            sys.exit(f"server exited with {proc.returncode}:\n{log.read()}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base, log
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    sys.exit("server did not become ready in 300 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (loopback only), e.g. http://127.0.0.1:8000")
    ap.add_argument("--start", action="store_true", help="start `localllm serve` on a free loopback port")
    ap.add_argument("--serve-args", default="--kv-memory 0.5", help="extra `localllm serve` arguments (--start)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds during which new requests start")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--model", default=None, help="model name to send (default: the server's)")
    ap.add_argument("--api-key", default=os.environ.get("LOCALLLM_API_KEY"))
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--json", action="store_true", help="print the result as JSON only")
    args = ap.parse_args()
    if args.start == bool(args.url):
        ap.error("give exactly one of --url or --start")
    if not (1 <= args.clients <= 512 and 0 < args.duration <= 3600):
        ap.error("--clients must be 1..512 and --duration 0..3600 s")
    proc = log = None
    if args.start:
        proc, base, log = start_server(shlex.split(args.serve_args))
    else:
        base = args.url.rstrip("/")
        if urlparse(base).hostname not in ("127.0.0.1", "localhost", "::1"):
            ap.error("load tests only run against a loopback server (127.0.0.1 / localhost)")
    try:
        out = asyncio.run(run(args, base))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                out_rc = proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                out_rc = None
            log.close()
    if proc is not None:
        out["server_exit_code"] = out_rc
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['clients']} streaming clients, {out['duration_s']:.0f} s (+ drain: {out['wall_s']} s wall), "
          f"max_tokens {args.max_tokens}")
    print(f"  requests ok     {out['requests']}   errors {out['errors']}")
    print(f"  output tokens   {out['output_tokens']}   throughput {out['output_tok_per_s']} tok/s")
    print(f"  TTFT            p50 {out['ttft_p50_ms']} ms   p99 {out['ttft_p99_ms']} ms")
    print(f"  end-to-end      p50 {out['e2e_p50_s']} s   p99 {out['e2e_p99_s']} s")
    print(f"  engine          max batch {out['max_batch_size']:.0f}   prefix-cache hit rate "
          f"{out['prefix_cache_hit_rate']:.0%}   preemptions {out['preemptions']:.0f}")
    print(f"  leaked KV blocks {out['leaked_kv_blocks']:.0f} (running {out['running_after']:.0f}, "
          f"waiting {out['waiting_after']:.0f} after the run)")
    if out["error_samples"]:
        print("  first errors:", *out["error_samples"], sep="\n    ")
    if "server_exit_code" in out:
        print(f"  server exit code after SIGTERM: {out['server_exit_code']}")
    if out["errors"] or out["leaked_kv_blocks"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
