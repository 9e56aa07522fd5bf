"""Which reader opens a checkpoint: a `.gguf` file or a Hugging Face directory."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ModelLoadError
from .gguf_weights import GGUFWeights
from .hf_weights import HFWeights

Weights = GGUFWeights | HFWeights


def reads_blocks(weights: Weights) -> bool:
    """Weights the loader takes as stored, block by block (each matrix on its type's kernel), and whose
    conversions the cache keeps: a GGUF file's, and gpt-oss's published checkpoints (MXFP4 experts,
    bf16 elsewhere)."""
    return isinstance(weights, GGUFWeights) or (isinstance(weights, HFWeights) and weights.mxfp4)


def open_weights(path: str | os.PathLike) -> Weights:
    path = Path(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path}: unsupported model file (expected a .gguf file or a model directory)")
        return GGUFWeights(path)
    if path.is_dir():
        return HFWeights(path)
    raise ModelLoadError(f"{path}: no such file or directory")

