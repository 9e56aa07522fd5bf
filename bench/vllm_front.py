"""What our front costs in front of vLLM: the same streaming workload (bench/load.py's: N clients,
streaming chat, back to back) on vLLM directly and through `localllm serve --engine vllm`, and the
CPU time our front's process spends per streamed token (from /proc: a figure a loaded machine does
not distort the way wall time is). Loopback only.

    localllm serve MODEL --engine vllm --vllm-bin .venv-vllm/bin/vllm --port 8000 ... &
    python bench/vllm_front.py --front http://127.0.0.1:8000 --clients 16 --duration 60

The vLLM server's own URL and our front's pid come from /api/ps; the runs alternate (direct,
front, direct, front, ...) and the medians are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import run  # noqa: E402


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (and of its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def front_pid(port: int) -> int:
    """Our front's pid: the process listening on `port` (the parent of the vLLM child)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        if parts[3] == "0A" and int(parts[1].split(":")[1], 16) == port:
            inode = parts[9]
            break
    else:
        raise SystemExit(f"nothing listens on port {port}")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    return int(pid)
        except OSError:
            continue
    raise SystemExit(f"cannot find the process listening on port {port}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--front", required=True, help="`localllm serve --engine vllm`, e.g. http://127.0.0.1:8000")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    front = args.front.rstrip("/")
    if httpx.URL(front).host not in ("127.0.0.1", "localhost"):
        ap.error("loopback only")
    backend = httpx.get(front + "/api/ps", timeout=10).json()["models"][0]["backend"]
    pid = front_pid(httpx.URL(front).port)
    rows = {"vLLM direct": [], "vLLM behind our front": []}
    for _ in range(args.repeats):
        for label, base in (("vLLM direct", backend["url"]), ("vLLM behind our front", front)):
            opts = SimpleNamespace(clients=args.clients, duration=args.duration, max_tokens=args.max_tokens,
                                   temperature=0.7, model=backend["model"], api_key=None, request_timeout=300.0)
            c0 = cpu_seconds(pid)
            out = asyncio.run(run(opts, base))
            out["front_cpu_ms_per_token"] = (cpu_seconds(pid) - c0) * 1000 / max(1, out["output_tokens"])
            rows[label].append(out)
            print(label, json.dumps({k: out[k] for k in ("requests", "errors", "output_tok_per_s", "ttft_p50_ms",
                                                          "ttft_p99_ms", "front_cpu_ms_per_token")}), flush=True)
    print(f"\n{args.clients} streaming clients, {args.duration:.0f} s, max_tokens {args.max_tokens}, medians of "
          f"{args.repeats}:")
    print(f"{'':24}{'tok/s':>10}{'TTFT p50 ms':>14}{'TTFT p99 ms':>14}{'front CPU ms/token':>20}")
    for label, outs in rows.items():
        med = {k: statistics.median(o[k] for o in outs) for k in ("output_tok_per_s", "ttft_p50_ms", "ttft_p99_ms",
                                                                  "front_cpu_ms_per_token")}
        print(f"{label:24}{med['output_tok_per_s']:>10.1f}{med['ttft_p50_ms']:>14.0f}{med['ttft_p99_ms']:>14.0f}"
              f"{med['front_cpu_ms_per_token']:>20.3f}")


if __name__ == "__main__":
    main()
