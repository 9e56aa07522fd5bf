"""What a JSON schema costs decode speed: constrained vs free decoding, same engine, same prompt.

    python bench/structured_cost.py [--model M] [--runs 5] [--temperature 0.7]

In-process LLM() with the default settings (the compiled step when its packages exist). Each
round decodes the prompt under a nested schema (objects in an array, enums, numbers, strings) until
the grammar completes, then the same prompt free (ignore_eos) for as many tokens, at the same
sampling settings; tok/s is measured from the first to the last token. Rounds interleave; the
ratio reported is the median of per-round ratios (goal: >= 0.9).
"""

from __future__ import annotations

import argparse
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {"type": "array", "minItems": 2, "maxItems": 3, "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 20},
                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                           "job": {"enum": ["teacher", "doctor", "farmer", "artist"]},
                           "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
            "required": ["name", "age", "job", "skills"], "additionalProperties": False}},
        "summary": {"type": "string", "maxLength": 80},
    },
    "required": ["people", "summary"], "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
PROMPT = [{"role": "user", "content": "Describe three people as JSON, with their jobs and skills."}]


def rate(llm, params) -> tuple[float, int]:
    first = last = None
    n = 0
    for o in llm.engine.generate(PROMPT, params):
        now = time.perf_counter()
        first = first or now
        last, n = now, len(o.token_ids)
    return (n - 1) / (last - first) if n > 1 and last > first else 0.0, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args()
    from localllm.llm import LLM
    from localllm.sampling import SamplingParams
    from localllm.structured import Constraint

    llm = LLM(args.model)
    schema = Constraint.make("json_schema", SCHEMA)
    kw = dict(temperature=args.temperature, top_p=0.95)
    rate(llm, SamplingParams(max_tokens=16, **kw))  # warm up (kernels, the grammar tokenizer below)
    rate(llm, SamplingParams(max_tokens=16, constraint=schema, **kw))
    ratios, cons, free = [], [], []
    for r in range(args.runs):
        c, n = rate(llm, SamplingParams(max_tokens=400, seed=r, constraint=schema, **kw))
        f, _ = rate(llm, SamplingParams(max_tokens=n, seed=r, ignore_eos=True, **kw))
        cons.append(c)
        free.append(f)
        ratios.append(c / f)
        print(f"round {r}: {n} tokens, constrained {c:.1f} tok/s, free {f:.1f} tok/s, ratio {c / f:.2f}", flush=True)
    print(f"median: constrained {statistics.median(cons):.1f} tok/s, free {statistics.median(free):.1f} tok/s, "
          f"per-round ratio {statistics.median(ratios):.2f}x (temperature {args.temperature})")


if __name__ == "__main__":
    main()
