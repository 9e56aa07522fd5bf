"""`localllm plan` (GPU planning) and our settings -> vLLM's command line (localllm/vllm_args.py).

The fast tests check the planner's splits and the exact arguments we generate; the last one parses
every generated command with vLLM's own parser (`vllm serve`'s: make_arg_parser, then
AsyncEngineArgs.from_cli_args), in the vLLM environment `make setup-vllm` makes (one subprocess for
all cases), so the multi-GPU commands are checked on a machine without GPUs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from localllm.planner import (
    KNOWN_SHAPES,
    Fleet,
    ModelFacts,
    PlanError,
    parse_gpus,
    plan_gpus,
    shape_config,
)
from localllm.vllm_args import VLLMArgsError, VLLMSettings, child_env, command, launch_argv, serve_args

REPO = Path(__file__).resolve().parent.parent
LLAMA70B = "meta-llama/llama-3.1-70b-instruct"
LLAMA8B = "meta-llama/llama-3.1-8b-instruct"
VARIANTS = {"awq": "org/m-AWQ", "gptq": "org/m-GPTQ"}


def facts(repo: str, context: int = 131072, variants: dict | None = None) -> ModelFacts:
    return ModelFacts.from_config(repo, shape_config(KNOWN_SHAPES[repo], context), variants=variants or {})


def vllm_bin() -> str:
    """The vLLM environment's `vllm` (make setup-vllm), or the one LOCALLLM_VLLM_BIN names."""
    return os.environ.get("LOCALLLM_VLLM_BIN") or str(REPO / ".venv-vllm" / "bin" / "vllm")


# ---- the planner ----------------------------------------------------------------------------------
def test_parse_gpus():
    f = parse_gpus("8xh100", 2)
    assert (f.per_node, f.kind, f.memory, f.nodes, f.total, f.bf16) == (8, "h100", 81559 << 20, 2, 16, True)
    assert parse_gpus("4x80GiB").memory == 80 << 30
    assert parse_gpus("2xt4").bf16 is False
    assert parse_gpus("4", local=("NVIDIA H200", 140 << 30)).memory == 140 << 30
    for bad, msg in (("4", "no GPU to take the kind from"), ("8xh900", "unknown GPU kind 'h900'"),
                     ("0xh100", "expected COUNT"), ("many", "expected COUNT")):
        with pytest.raises(PlanError, match=msg):
            parse_gpus(bad)
    with pytest.raises(PlanError, match="--nodes must be >= 1"):
        parse_gpus("8xh100", 0)


# (model, gpus, nodes, quant, ctx) -> (precision, tp, pp, dp)
CASES = [
    (LLAMA70B, "8xh100", 1, "auto", None, ("bfloat16", 4, 1, 2)),  # 2 x 4 GPUs: a second replica
    (LLAMA70B, "8xh100", 1, "auto", 4096, ("bfloat16", 2, 1, 4)),
    (LLAMA70B, "4xl40s", 1, "auto", None, ("fp8", 4, 1, 1)),  # bf16's 131 GiB + KV do not fit 4 x 45 GiB
    (LLAMA70B, "8xl4", 2, "auto", None, ("bfloat16", 8, 2, 1)),  # one node is not enough: PP over two
    (LLAMA70B, "8xl4", 2, "awq", None, ("awq", 8, 1, 1)),
    (LLAMA70B, "8xv100", 1, "auto", 32768, ("float16", 8, 1, 1)),  # no bf16 before compute capability 8.0
    (LLAMA8B, "1xh100", 1, "auto", None, ("bfloat16", 1, 1, 1)),
    (LLAMA8B, "1xl4", 1, "auto", 32768, ("fp8", 1, 1, 1)),  # at 128k the KV alone is 16 GiB
]


@pytest.mark.parametrize("repo, gpus, nodes, quant, ctx, want", CASES)
def test_plan_gpus(repo, gpus, nodes, quant, ctx, want):
    p = plan_gpus(facts(repo, variants=VARIANTS), parse_gpus(gpus, nodes), quant, ctx)
    s = p.chosen
    assert s is not None, p.reason
    assert (s.precision, s.tp, s.pp, s.dp) == want
    assert s.weights + s.kv + s.runtime <= s.budget and s.sequences >= 1
    # the split's per-GPU share: the decoder's weights over tp x pp, the KV heads (8) over tp
    assert s.variant == ("org/m-AWQ" if quant == "awq" else None)


def test_plan_gpus_refuses_with_what_each_precision_needs():
    p = plan_gpus(facts(LLAMA70B), parse_gpus("1xh100"))
    assert p.chosen is None
    assert p.reason.startswith("meta-llama/llama-3.1-70b-instruct does not fit 1 x h100 (79.65 GiB each) at ctx "
                               "131072: bfloat16 needs 175.35 GiB per GPU even on 1 GPU (TP 1, PP 1)")
    with pytest.raises(PlanError, match="GGUF file: vLLM serves Hugging Face checkpoints"):
        plan_gpus(ModelFacts("x.gguf", 1, 1, 1, 1, native="gguf"), Fleet(1, "h100", 80 << 30))
    with pytest.raises(PlanError, match="fp8 needs compute capability"):
        plan_gpus(facts(LLAMA8B), parse_gpus("1xt4"), "int8")


def test_tensor_parallel_respects_the_heads():
    """vLLM splits the heads evenly: a 6-GPU node runs TP 4 (9 heads of SmolLM2: TP 1 or 3 only)."""
    smol = ModelFacts.from_config("smol", shape_config(KNOWN_SHAPES["huggingfacetb/smollm2-135m-instruct"], 8192))
    p = plan_gpus(smol, Fleet(4, "x", 16 << 30))
    assert (p.chosen.tp, p.chosen.dp) == (1, 4)


# ---- the arguments --------------------------------------------------------------------------------
def test_serve_args_exactly():
    s = VLLMSettings("meta-llama/Llama-3.1-70B-Instruct", ["llama3.1-70b", "llama3.1:70b"], port=9000,
                     tensor_parallel=8, pipeline_parallel=2, ray=True, max_model_len=32768, precision="fp8",
                     max_num_seqs=64, draft="/models/llama-1b", spec_tokens=5, kv_memory=8 << 30)
    assert serve_args(s) == [
        "--host", "127.0.0.1", "--port", "9000", "--served-model-name", "llama3.1-70b", "llama3.1:70b",
        "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2", "--distributed-executor-backend", "ray",
        "--max-model-len", "32768", "--quantization", "fp8", "--max-num-seqs", "64", "--enable-prefix-caching",
        "--structured-outputs-config", '{"backend":"guidance"}',
        "--speculative-config", '{"model":"/models/llama-1b","num_speculative_tokens":5}',
        "--kv-cache-memory-bytes", str(8 << 30)]
    assert command(s)[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-70B-Instruct"]
    # the API key never reaches a command line (ps shows those to every user)
    env = child_env(s, api_key="sk-secret", ray_address="10.0.0.1:6379")
    assert env == {"VLLM_API_KEY": "sk-secret", "RAY_ADDRESS": "10.0.0.1:6379"}
    assert "sk-secret" not in " ".join(command(s))


def test_cpu_backend_settings_go_to_its_environment():
    s = VLLMSettings("/m", ["m"], cpu=True, threads=2, kv_memory=3 << 30, precision="bfloat16")
    assert child_env(s) == {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "2",
                            "VLLM_CPU_KVCACHE_SPACE": "3"}
    assert "--kv-cache-memory-bytes" not in serve_args(s)
    with pytest.raises(VLLMArgsError, match="is fp8 in vLLM, which needs a GPU"):
        serve_args(VLLMSettings("/m", ["m"], cpu=True, precision="int8"))
    with pytest.raises(VLLMArgsError, match="no int4 on load"):
        serve_args(VLLMSettings("/m", ["m"], precision="int4"))
    with pytest.raises(VLLMArgsError, match="--tensor-parallel must be >= 1"):
        serve_args(VLLMSettings("/m", ["m"], tensor_parallel=0))


def test_launch_argv_uses_the_environments_interpreter(tmp_path):
    s = VLLMSettings("/m", ["m"])
    (tmp_path / "bin").mkdir()
    for name in ("vllm", "python"):
        (tmp_path / "bin" / name).write_text("#!/bin/sh\n")
        (tmp_path / "bin" / name).chmod(0o755)
    assert launch_argv(s, str(tmp_path / "bin" / "vllm"))[:5] == [
        str(tmp_path / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    (tmp_path / "bin" / "python").unlink()
    assert launch_argv(s, str(tmp_path / "bin" / "vllm"))[:3] == [str(tmp_path / "bin" / "vllm"), "serve", "/m"]


def test_cli_plan_prints_the_commands():
    r = subprocess.run([sys.executable, "-m", "localllm.cli", "plan", "llama3.1-70b", "--gpus", "8xl4", "--nodes",
                        "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "choice: bfloat16, tensor parallel 8, pipeline parallel 2" in out
    assert ("vllm serve meta-llama/Llama-3.1-70B-Instruct --host 127.0.0.1 --port 8000 --served-model-name "
            "llama3.1-70b --tensor-parallel-size 8 --pipeline-parallel-size 2 --distributed-executor-backend ray "
            "--max-model-len 131072 --dtype bfloat16") in out
    assert ("localllm serve llama3.1-70b --engine vllm --ctx 131072 --tensor-parallel 8 --pipeline-parallel 2 "
            "--ray-address HEAD:6379") in out
    assert "ray start --head --port 6379" in out
    r = subprocess.run([sys.executable, "-m", "localllm.cli", "plan", "llama3.1-70b", "--gpus", "1xh100"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "does not fit: llama3.1-70b does not fit 1 x h100" in r.stdout
    r = subprocess.run([sys.executable, "-m", "localllm.cli", "plan", "smollm2", "--gpus", "2xh900"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "unknown GPU kind 'h900'" in r.stderr


# ---- vLLM's own parser ----------------------------------------------------------------------------
_PARSE = r"""
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.engine.arg_utils import AsyncEngineArgs
out = []
for argv in json.load(sys.stdin):
    ns = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    if ns.model_tag:  # `vllm serve MODEL` puts it here
        ns.model = ns.model_tag
    ea = AsyncEngineArgs.from_cli_args(ns)
    out.append({"model": ea.model, "served": ea.served_model_name, "tp": ea.tensor_parallel_size,
                "pp": ea.pipeline_parallel_size, "dp": ea.data_parallel_size, "executor": ea.distributed_executor_backend,
                "max_model_len": ea.max_model_len, "dtype": ea.dtype, "quantization": ea.quantization,
                "prefix": ea.enable_prefix_caching, "max_num_seqs": ea.max_num_seqs, "spec": ea.speculative_config,
                "structured": ea.structured_outputs_config.backend, "eager": ea.enforce_eager,
                "kv_bytes": ea.kv_cache_memory_bytes, "host": ns.host, "port": ns.port})
print(json.dumps(out))
"""

VARIANT_CASES = [  # (settings, what vLLM must read from them)
    (VLLMSettings("meta-llama/Llama-3.1-70B-Instruct", ["llama3.1-70b"], tensor_parallel=8, max_model_len=131072,
                  precision="bfloat16"), {"tp": 8, "pp": 1, "dtype": "bfloat16", "max_model_len": 131072}),
    (VLLMSettings("meta-llama/Llama-3.1-70B-Instruct", ["llama3.1-70b"], tensor_parallel=8, pipeline_parallel=2,
                  ray=True), {"tp": 8, "pp": 2, "executor": "ray"}),
    (VLLMSettings("meta-llama/Llama-3.1-70B-Instruct", ["llama3.1-70b"], tensor_parallel=4, data_parallel=2,
                  precision="fp8"), {"tp": 4, "dp": 2, "quantization": "fp8"}),
    (VLLMSettings("hugging-quants/Meta-Llama-3.1-70B-Instruct-AWQ-INT4", ["llama3.1-70b"], tensor_parallel=2,
                  precision="awq"), {"tp": 2, "quantization": None, "dtype": "auto"}),
    (VLLMSettings("meta-llama/Llama-3.1-8B-Instruct", ["llama3.1-8b", "llama3.1"], draft="/m/llama3.2-1b",
                  spec_tokens=4, max_num_seqs=32, kv_memory=4 << 30),
     {"spec": {"model": "/m/llama3.2-1b", "num_speculative_tokens": 4}, "max_num_seqs": 32,
      "served": ["llama3.1-8b", "llama3.1"], "kv_bytes": 4 << 30}),
    (VLLMSettings("/models/smol", ["smol"], draft="ngram", spec_tokens=3, enforce_eager=True, prefix_caching=False),
     {"spec": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 1},
      "eager": True, "prefix": False}),
]


def test_generated_arguments_parse_with_vllms_own_parser():
    vllm = vllm_bin()
    python = Path(vllm).parent / "python"
    assert python.is_file(), f"no vLLM environment at {vllm}: `make setup-vllm` (or set LOCALLLM_VLLM_BIN)"
    argvs = []
    for s, _ in VARIANT_CASES:
        argvs.append(command(s)[2:])  # `vllm serve MODEL ARGS` as typed
        argvs.append(launch_argv(s, vllm)[3:])  # `--model MODEL ARGS`, as serve --engine vllm runs it
    r = subprocess.run([str(python), "-c", _PARSE], input=json.dumps(argvs), capture_output=True, text=True,
                       timeout=300, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert r.returncode == 0, r.stderr[-3000:]
    parsed = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(parsed) == 2 * len(VARIANT_CASES)
    for i, (s, want) in enumerate(VARIANT_CASES):
        for got in parsed[2 * i: 2 * i + 2]:
            assert got["model"] == s.model and got["host"] == "127.0.0.1" and got["port"] == 8000
            assert got["served"] == s.served_names and got["structured"] == "guidance"
            defaults = {"pp": 1, "dp": 1, "prefix": True, "eager": False, "spec": None}
            for key, value in {**defaults, **want}.items():
                assert got[key] == value, (i, key, got)


# ---- serve --engine vllm's mistakes and a child that fails (no vLLM needed) ------------------------
def test_serve_vllm_flag_mistakes():
    def serve(*args):
        return subprocess.run([sys.executable, "-m", "localllm.cli", "serve", *args, "--port", "1"],
                              capture_output=True, text=True, timeout=120)
    r = serve("smollm2", "--tensor-parallel", "2")
    assert r.returncode == 2 and "Error: --tensor-parallel needs --engine vllm" in r.stderr
    r = serve("--engine", "vllm")
    assert r.returncode == 2 and "--engine vllm needs a MODEL" in r.stderr
    r = serve("smollm2", "--engine", "vllm", "--vllm-bin", "/nonexistent/vllm")
    assert r.returncode == 1 and "Error: vLLM is not installed here (/nonexistent/vllm): `make setup-vllm`" in r.stderr
    r = serve("smollm2", "--engine", "sglang")
    assert r.returncode == 2 and "--engine: 'sglang' is not one of localllm, vllm" in r.stderr


def test_a_failing_vllm_is_one_line_and_ends_the_server(tmp_path):
    """vLLM that dies while starting: our server says why in one line (the log's error, where the
    log is) and exits 1; the log is kept under LOCALLLM_HOME."""
    from server_proc import free_port

    bin_ = tmp_path / "venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "vllm").write_text("#!/bin/sh\nexit 0\n")
    (bin_ / "python").write_text("#!/bin/sh\necho 'INFO starting'\necho 'RuntimeError: no device found' >&2\nexit 3\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    model = tmp_path / "model"  # what vLLM would load: it fails before anything is read
    model.mkdir()
    (model / "config.json").write_text("{}")
    home = tmp_path / "home"
    port = free_port()
    r = subprocess.run([sys.executable, "-m", "localllm.cli", "serve", str(model), "--engine", "vllm",
                        "--vllm-bin", str(bin_ / "vllm"), "--port", str(port)], capture_output=True, text=True,
                       timeout=180, env={**os.environ, "LOCALLLM_HOME": str(home), "OMP_NUM_THREADS": "1"})
    log = home / "logs" / f"vllm-{port}.log"
    assert r.returncode == 1, r.stderr
    assert (f"vLLM exited with code 3: RuntimeError: no device found (its log: {log})") in r.stderr
    text = log.read_text()
    assert "-m vllm.entrypoints.openai.api_server --model" in text and "RuntimeError: no device found" in text


# ---- a GGUF handed to vLLM: an HF checkpoint written from it once ---------------------------------
def test_a_gguf_is_written_once_as_an_hf_checkpoint(tiny_gguf, tmp_path, monkeypatch):
    import torch
    import transformers

    from localllm.model import export
    from localllm.model.weights import open_weights
    from localllm.models_cli import remove
    from localllm.paths import cache_home

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    cache = cache_home() / "vllm-checkpoints"  # where `serve --engine vllm` writes it
    out, written = export.hf_checkpoint_of(tiny_gguf, cache)
    assert written and (out / "config.json").is_file() and [p.name for p in cache.iterdir()] == [out.name]
    again, written = export.hf_checkpoint_of(tiny_gguf, cache)
    assert (again, written) == (out, False)
    # the file's dequantized weights, rounded to bf16 once, as transformers reads them
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    want = open_weights(tiny_gguf).dense("model.layers.0.self_attn.q_proj.weight").to(torch.bfloat16).float()
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight.detach(), want)
    # `localllm rm FILE` removes what was written from it; the file itself stays
    assert any("HF checkpoint written for vLLM" in line for line in remove(str(tiny_gguf)))
    assert not out.exists() and tiny_gguf.is_file()

    # an export that fails halfway leaves no folder a later run would take for whole
    def broken(src, tmp, dtype):
        (Path(tmp) / "model.safetensors").parent.mkdir(parents=True)
        (Path(tmp) / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")
    monkeypatch.setattr(export, "export_hf", broken)
    with pytest.raises(OSError, match="disk full"):
        export.hf_checkpoint_of(tiny_gguf, tmp_path / "other")
    assert list((tmp_path / "other").iterdir()) == []
