"""`localllm bench --json` in CI size: the shape of the report, not speed (eager: building the
real model's compiled packages would take minutes; tests/test_compiled.py covers that path)."""

import json
import subprocess
import sys


def test_bench_quick_json_shape():
    r = subprocess.run([sys.executable, "-m", "localllm.cli", "bench", "--quick", "--json", "--eager"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["model"] == "smollm2-135m" and d["load_s"] > 0 and d["peak_rss_mb"] > 0
    assert set(d["prefill"]) == {"32", "128"} and all(v["tok_per_s"] > 0 for v in d["prefill"].values())
    assert d["decode"]["tok_per_s"] > 0 and d["ttft_s"] > 0
    assert set(d["batch"]) == {"1", "4"} and d["batch"]["1"]["speedup_vs_batch1"] == 1.0
    pc = d["prefix_cache"]
    assert pc["turn2_hit_rate"] > 0.5 and pc["turn2_ttft_s"] > 0  # the second turn reuses the first's KV
    sp = d["speculative_ngram"]
    assert sp["same_tokens"] is True and 0 <= sp["acceptance_rate"] <= 1 and sp["mean_accepted_length"] >= 1
