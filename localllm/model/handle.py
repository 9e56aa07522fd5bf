"""What loading a model hands the engine and the front ends: the model and what goes with it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..tokenizer import LLMTokenizer
from .llama import LlamaModel


@dataclass
class ModelHandle:
    model: LlamaModel
    tokenizer: LLMTokenizer
    config: ModelConfig
    eos_ids: set[int]
    precision: str  # what the weights run in, for display
    kv_dtype: torch.dtype
    source: str  # the checkpoint's path
    max_model_len: int  # the context the model was loaded for (at most its trained one)
    name: str | None = None  # the registry name it was resolved from, when it was
    vision: object | None = None  # the VisionModel of a vision-language checkpoint (localllm.model.vision)
