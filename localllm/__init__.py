"""localllm: run large language models locally, fast."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "LLMEngine", "EngineConfig", "__version__"]


def __getattr__(name):  # lazy: `localllm --help` should not pay for importing torch
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "SamplingParams":
        from .sampling import SamplingParams

        return SamplingParams
    if name == "LLMEngine":
        from .engine.engine import LLMEngine

        return LLMEngine
    if name == "EngineConfig":
        from .config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
