"""Our `serve` settings -> vLLM's OpenAI server command line, as pure functions: `localllm plan`
prints the command, `localllm serve --engine vllm` runs it, tests/test_vllm_args.py parses it with
vLLM's own argument parser. Nothing here imports vLLM (it runs in its own environment, as a child
process: server/vllm_backend.py).

What maps onto what:
  --ctx N                 -> --max-model-len N
  --quant bf16|fp16|fp32  -> --dtype bfloat16|float16|float32; int8 -> --quantization fp8 (GPUs);
                             awq/gptq -> the registry's pre-quantized repo (vLLM reads its config)
  --max-num-seqs N        -> --max-num-seqs N; prefix caching (always on here) -> --enable-prefix-caching
  --draft MODEL|ngram     -> --speculative-config {"model": ..., "num_speculative_tokens": k} / ngram
  structured output       -> --structured-outputs-config {"backend": "guidance"}: llguidance, ours,
                             so a schema either engine takes, the other takes too
  --tensor-parallel / --pipeline-parallel / --data-parallel -> vLLM's *-size; --ray-address -> Ray
  --api-key               -> VLLM_API_KEY in the child's environment (never on a command line,
                             which `ps` shows to every user)
  --threads / --kv-memory -> on vLLM's CPU backend: VLLM_CPU_OMP_THREADS_BIND / VLLM_CPU_KVCACHE_SPACE;
                             on GPUs --kv-memory is --kv-cache-memory-bytes
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

STRUCTURED_BACKEND = "guidance"  # vLLM's name for llguidance
# our --quant (planner names) -> vLLM flags; awq/gptq load a pre-quantized repo and need none
_PRECISION = {"auto": [], "bfloat16": ["--dtype", "bfloat16"], "float16": ["--dtype", "float16"],
              "float32": ["--dtype", "float32"], "fp8": ["--quantization", "fp8"], "int8": ["--quantization", "fp8"],
              "awq": [], "gptq": []}


class VLLMArgsError(ValueError):
    """A setting vLLM cannot take; the message names our flag."""


@dataclass
class VLLMSettings:
    """What `vllm serve` is asked for, in our terms (the CLI fills it from its flags and the plan)."""

    model: str  # what vLLM loads: a local directory or a hub repo id
    served_names: list[str]  # the first is what /v1/models reports; the rest (aliases) are accepted too
    host: str = "127.0.0.1"
    port: int = 8000
    revision: str | None = None  # for a hub repo id
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    data_parallel: int = 1
    max_model_len: int | None = None
    precision: str = "auto"
    max_num_seqs: int | None = None
    prefix_caching: bool = True
    draft: str | None = None  # a draft model (directory or repo id) or "ngram"
    spec_tokens: int = 4
    ray: bool = False  # --distributed-executor-backend ray (several nodes)
    enforce_eager: bool = False
    kv_memory: int | None = None  # bytes
    cpu: bool = False  # vLLM's CPU backend (vllm-cpu): threads and KV size are environment settings there
    threads: int | None = None
    extra: list[str] = field(default_factory=list)  # passed through as they are (after ours: they win)


def check(s: VLLMSettings) -> None:
    for flag, v in (("--tensor-parallel", s.tensor_parallel), ("--pipeline-parallel", s.pipeline_parallel),
                    ("--data-parallel", s.data_parallel), ("--spec-tokens", s.spec_tokens)):
        if not isinstance(v, int) or v < 1:
            raise VLLMArgsError(f"{flag} must be >= 1, got {v}")
    if s.precision not in _PRECISION:
        what = "int4 on load (use the awq or gptq variant)" if s.precision == "int4" else repr(s.precision)
        raise VLLMArgsError(f"--quant: vLLM has no {what}; one of auto, bf16, fp16, fp32, int8 (fp8), awq, gptq")
    if s.cpu and s.precision in ("fp8", "int8"):
        raise VLLMArgsError("--quant int8 is fp8 in vLLM, which needs a GPU (vLLM's CPU backend: bf16 or fp32)")
    if s.cpu and (s.tensor_parallel > 1 or s.pipeline_parallel > 1) and s.ray:
        raise VLLMArgsError("--ray-address: vLLM's CPU backend runs on one machine")
    if not s.served_names:
        raise VLLMArgsError("a served model name is required")


def speculative_config(s: VLLMSettings) -> dict | None:
    if s.draft is None:
        return None
    if s.draft == "ngram":  # prompt lookup, as ours: n-grams of up to 4 tokens from the prompt
        return {"method": "ngram", "num_speculative_tokens": s.spec_tokens, "prompt_lookup_max": 4,
                "prompt_lookup_min": 1}
    return {"model": s.draft, "num_speculative_tokens": s.spec_tokens}


def serve_args(s: VLLMSettings) -> list[str]:
    """The arguments after `vllm serve MODEL`."""
    check(s)
    args = ["--host", s.host, "--port", str(s.port), "--served-model-name", *s.served_names]
    if s.revision:
        args += ["--revision", s.revision]
    if s.tensor_parallel > 1:
        args += ["--tensor-parallel-size", str(s.tensor_parallel)]
    if s.pipeline_parallel > 1:
        args += ["--pipeline-parallel-size", str(s.pipeline_parallel)]
    if s.data_parallel > 1:
        args += ["--data-parallel-size", str(s.data_parallel)]
    if s.ray:
        args += ["--distributed-executor-backend", "ray"]
    if s.max_model_len:
        args += ["--max-model-len", str(s.max_model_len)]
    args += _PRECISION[s.precision]
    if s.max_num_seqs:
        args += ["--max-num-seqs", str(s.max_num_seqs)]
    args.append("--enable-prefix-caching" if s.prefix_caching else "--no-enable-prefix-caching")
    args += ["--structured-outputs-config", json.dumps({"backend": STRUCTURED_BACKEND}, separators=(",", ":"))]
    spec = speculative_config(s)
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    if s.enforce_eager:
        args.append("--enforce-eager")
    if s.kv_memory and not s.cpu:
        args += ["--kv-cache-memory-bytes", str(s.kv_memory)]
    return args + list(s.extra)


def child_env(s: VLLMSettings, api_key: str | None = None, ray_address: str | None = None) -> dict[str, str]:
    """The variables the vLLM process gets on top of ours."""
    env = {}
    if api_key:
        env["VLLM_API_KEY"] = api_key
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    if s.cpu:
        # vLLM's CPU backend pins its threads to cores by default: with other programs on the
        # machine (ours, a test run) that oversubscribes the pinned cores, so the threads float
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        if s.threads:
            env["OMP_NUM_THREADS"] = str(s.threads)
        if s.kv_memory:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(s.kv_memory / (1 << 30))))
    return env


def command(s: VLLMSettings, vllm: str = "vllm") -> list[str]:
    """`vllm serve MODEL ARGS` (what a user types, and what `localllm plan` prints)."""
    return [vllm, "serve", s.model, *serve_args(s)]


def shell_line(argv: list[str], env: dict[str, str] | None = None) -> str:
    """A command as one shell line; the API key, if any, is shown as a placeholder."""
    shown = {k: ("$LOCALLLM_API_KEY" if k == "VLLM_API_KEY" else v) for k, v in (env or {}).items()}
    prefix = " ".join(f"{k}={shlex.quote(v) if not v.startswith('$') else v}" for k, v in shown.items())
    return (prefix + " " if prefix else "") + shlex.join(argv)


def launch_argv(s: VLLMSettings, vllm_bin: str) -> list[str]:
    """What `serve --engine vllm` runs: `vllm serve` through the interpreter of the environment
    `vllm_bin` is in, when it has one next to it (vllm-cpu 0.32's `vllm` script asks for the
    version of a distribution named vllm, which it is not, and exits), else the script itself."""
    import os

    python = os.path.join(os.path.dirname(os.path.abspath(vllm_bin)), "python")
    if os.path.isfile(python) and os.access(python, os.X_OK):
        return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", s.model, *serve_args(s)]
    return command(s, vllm_bin)
