"""What a one-shot `localllm run` imports: only what answering needs (torch, the tokenizer, the
chat template's jinja2, typer), never the server, the hub client, GPU compilers or transformers
(each costs a cold start tens to hundreds of ms; BENCHMARKS.md, "Cold start"). The real run path,
end to end, on the embedded model: not a timing test."""

import json
import os
import subprocess
import sys

# a module here on the run path is a regression: import it where it is used
NOT_ON_THE_RUN_PATH = {"fastapi", "uvicorn", "starlette", "httpx", "requests", "transformers", "triton",
                       "huggingface_hub", "rich", "llguidance", "gguf", "sympy", "torch._inductor",
                       "torch._dynamo", "localllm.server", "localllm.ollama_api", "localllm.model_pool",
                       "localllm.repl", "localllm.quant"}

CODE = """
import atexit, json, runpy, sys
atexit.register(lambda: print("MODULES " + json.dumps(sorted(sys.modules)), file=sys.stderr))
sys.argv = ["localllm", "run", "--temperature", "0", "-n", "2", "hi"]
runpy.run_module("localllm.cli", run_name="__main__")
"""


def test_run_imports_only_what_it_needs(tmp_path):
    env = {**os.environ, "LOCALLLM_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()  # it answered
    line = next(x for x in r.stderr.splitlines() if x.startswith("MODULES "))
    modules = set(json.loads(line.removeprefix("MODULES ")))
    assert {"torch", "tokenizers", "jinja2", "localllm.engine.engine"} <= modules  # it did run the model
    assert sorted(NOT_ON_THE_RUN_PATH & modules) == []
