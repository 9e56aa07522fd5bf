"""Prometheus text exposition for `localllm serve` (GET /metrics), without a client library.

Server-side observations (TTFT, end-to-end latency, finished requests, error answers) live here
and are only touched from the asyncio thread; engine numbers come from a snapshot of
`LLMEngine.cache_stats()` taken by the engine loop thread after each step.
"""

from __future__ import annotations

import bisect
from collections import Counter

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _num(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * len(buckets)  # per bucket, not cumulative
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.buckets):
            self.counts[i] += 1
        self.count += 1
        self.sum += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cum = 0
        for b, c in zip(self.buckets, self.counts):
            cum += c
            lines.append(f'{self.name}_bucket{{le="{b}"}} {cum}')
        lines += [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {_num(self.sum)}",
                  f"{self.name}_count {self.count}"]
        return lines


class ServerMetrics:
    def __init__(self):
        self.ttft = Histogram("localllm_time_to_first_token_seconds",
                              "Seconds from request arrival to its first generated token.", TTFT_BUCKETS)
        self.e2e = Histogram("localllm_e2e_request_latency_seconds",
                             "Seconds from request arrival to its last token.", E2E_BUCKETS)
        self.finished: Counter[str] = Counter()  # engine requests by finish reason
        self.errors: Counter[int] = Counter()  # error answers by HTTP status
        self.http_requests = 0

    def render(self, engine: dict | None, extra: dict[str, float], models_loaded: int | None = None) -> str:
        """engine: a cache_stats() snapshot (None while the model loads, or when another server runs
        it: then `models_loaded` says whether it is up); extra: server gauges."""
        out: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]):
            out.append(f"# HELP {name} {help}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{labels} {_num(v)}" for labels, v in samples)

        metric("localllm_http_requests_total", "counter", "Generation requests received (chat + completions).",
               [("", self.http_requests)])
        reasons = {"stop", "length", "abort", "error", *self.finished}
        metric("localllm_requests_total", "counter", "Engine requests finished, by finish reason.",
               [(f'{{finish_reason="{r}"}}', self.finished[r]) for r in sorted(reasons)])
        metric("localllm_request_errors_total", "counter", "Error answers, by HTTP status.",
               [(f'{{code="{c}"}}', n) for c, n in sorted(self.errors.items())])
        out += self.ttft.render() + self.e2e.render()
        for name, v in extra.items():
            metric(f"localllm_{name}", "gauge", name.replace("_", " ") + ".", [("", v)])
        loaded = models_loaded if models_loaded is not None else 0 if engine is None else engine.get("models_loaded", 1)
        metric("localllm_model_loaded", "gauge", "Models loaded (1 once a pinned model is ready).", [("", loaded)])
        if engine is not None:
            for name, kind, text, key in _ENGINE_METRICS:
                metric(name, kind, text, [("", engine[key])])
            spec = engine.get("speculative")
            if spec is not None:  # only when serving with --draft
                for name, kind, text, key in _SPEC_METRICS:
                    metric(name, kind, text, [("", spec[key])])
        return "\n".join(out) + "\n"


def combined_stats(stats: list[dict]) -> dict | None:
    """The engine stats of several loaded models (`serve` without MODEL) as one engine's: counts
    and gauges added up, the largest batch, the hit rate over all prompt tokens; None: none loaded."""
    if not stats:
        return None
    out = {key: sum(s[key] for s in stats) for _, _, _, key in _ENGINE_METRICS if key not in ("hit_rate",)}
    out["max_batch_size"] = max(s["max_batch_size"] for s in stats)
    out["hit_rate"] = out["cached_tokens"] / out["prompt_tokens"] if out["prompt_tokens"] else 0.0
    specs = [s["speculative"] for s in stats if s.get("speculative")]
    out["speculative"] = specs[0] if len(specs) == 1 else None
    out["models_loaded"] = len(stats)
    return out


# (name, type, help, key in engine.cache_stats())
_ENGINE_METRICS = [
    ("localllm_prompt_tokens_total", "counter", "Prompt tokens admitted.", "prompt_tokens"),
    ("localllm_generation_tokens_total", "counter", "Tokens generated.", "generated_tokens"),
    ("localllm_prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache.",
     "cached_tokens"),
    ("localllm_prefix_cache_hit_rate", "gauge", "Cached prompt tokens / prompt tokens.", "hit_rate"),
    ("localllm_num_requests_running", "gauge", "Requests in the running batch.", "running"),
    ("localllm_num_requests_waiting", "gauge", "Requests waiting for a batch slot or KV blocks.", "waiting"),
    ("localllm_kv_blocks_used", "gauge", "KV cache blocks held by live requests.", "kv_blocks_used"),
    ("localllm_kv_blocks_total", "gauge", "KV cache blocks in the pool.", "kv_blocks_total"),
    ("localllm_engine_steps_total", "counter", "Engine steps run.", "steps"),
    ("localllm_captured_steps_total", "counter", "Steps run by the captured step (the compiled CPU package or "
     "CUDA graphs) instead of eagerly.", "captured_steps"),
    ("localllm_max_batch_size", "gauge", "Largest batch (sequences in one step) so far.", "max_batch_size"),
    ("localllm_preemptions_total", "counter", "Sequences preempted for lack of KV blocks.", "preemptions"),
]
# the same for cache_stats()["speculative"]
_SPEC_METRICS = [
    ("localllm_spec_proposed_tokens_total", "counter", "Speculative tokens proposed.", "proposed"),
    ("localllm_spec_accepted_tokens_total", "counter", "Speculative tokens accepted by the target.", "accepted"),
    ("localllm_spec_mean_accepted_length", "gauge", "Tokens produced per verify step.", "mean_accepted_length"),
]


def parse(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} (for tests and bench/load.py)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, v = line.rpartition(" ")
            values[key] = float(v)
    return values
