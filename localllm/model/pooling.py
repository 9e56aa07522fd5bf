"""Token states -> one vector per input, as sentence-transformers' Pooling and Normalize modules
compute them (CLS, mean over the input's tokens, or its last token), and Matryoshka truncation."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MODES = ("cls", "mean", "last")


@dataclass(frozen=True)
class Pooling:
    mode: str = "mean"
    normalize: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"pooling mode {self.mode!r} is not supported (supported: {', '.join(MODES)})")


def pool(hidden: torch.Tensor, lengths: list[int], pooling: Pooling) -> torch.Tensor:
    """hidden [T, H] of inputs laid end to end with these lengths -> [B, H] in fp32."""
    hidden = hidden.float()
    starts = torch.tensor([0, *lengths[:-1]], device=hidden.device).cumsum(0)
    n = torch.tensor(lengths, device=hidden.device)
    if pooling.mode == "cls":
        out = hidden[starts]
    elif pooling.mode == "last":
        out = hidden[starts + n - 1]
    else:  # the mean over each input's rows: a segment sum, then / length
        seg = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), n)
        out = torch.zeros(len(lengths), hidden.shape[1], device=hidden.device).index_add_(0, seg, hidden)
        out = out / n[:, None].to(out.dtype)
    return F.normalize(out, dim=-1) if pooling.normalize else out


def truncate(vectors: torch.Tensor, dimensions: int | None) -> torch.Tensor:
    """Matryoshka truncation: the first `dimensions` components, scaled to unit length again
    (what OpenAI's `dimensions` returns)."""
    if dimensions is None or dimensions >= vectors.shape[-1]:
        return vectors
    return F.normalize(vectors[..., :dimensions], dim=-1)
