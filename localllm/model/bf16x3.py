"""Encoder linears on the CPU's bf16 dot products (localllm_kernels.cpu_bf16x3), the bias and the
exact GELU fused into the GEMM's output: on the AMX tile unit, weights and activations each split
into two bf16 parts (three exact products accumulated in fp32, ~1e-5 relative to fp32) or the
weights rounded to bf16; with AVX512-BF16 alone (VDPBF16PS), the weights and the activations
rounded to bf16 (one product, fp32 accumulation).

What the encoder loader asks: which modes run here (`available`: AMX, both; `dot_available`:
the one-part mode) and the linear for a weight (`linear`): a Bf16x3Linear, or torch's fp32
DenseLinear.
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import DenseLinear


def available(device: str = "cpu") -> bool:
    """The kernel loads and this CPU has AMX-BF16 (CPU models only)."""
    if device != "cpu":
        return False
    from localllm_kernels import cpu_bf16x3

    return cpu_bf16x3.available()


def dot_available(device: str = "cpu") -> bool:
    """The one-part mode (weights rounded to bf16) runs here: AMX-BF16 or AVX512-BF16 (CPU models only)."""
    if device != "cpu":
        return False
    from localllm_kernels import cpu_bf16x3

    return cpu_bf16x3.available() or cpu_bf16x3.dot_available()


class Bf16x3Linear(nn.Module):
    """y = act(x W^T + b) on the bf16 kernel; `act` ("none" or "gelu", the erf GELU) is applied
    here, so a layer whose activation this module already applied skips its own."""

    kind = "bf16x3"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, act: str = "none", parts: int = 2):
        from localllm_kernels import cpu_bf16x3

        super().__init__()
        if act not in cpu_bf16x3.ACTS:
            raise ValueError(f"act must be one of {', '.join(cpu_bf16x3.ACTS)}, got {act!r}")
        self.out_features, self.in_features = weight.shape
        self.act = act
        self.weights = weight.numel() + (0 if bias is None else bias.numel())  # held in buffers, not parameters
        self.register_buffer("w", cpu_bf16x3.pack(weight, parts))
        self.register_buffer("b", cpu_bf16x3.pad_bias(bias, self.w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.localllm.bf16x3_gemm(x.reshape(-1, shape[-1]).float(), self.w, self.b, self.out_features,
                                           self.act)
        return y.view(*shape[:-1], self.out_features)


def linear(weight: torch.Tensor, bias: torch.Tensor | None, parts: int, act: str = "none") -> nn.Module:
    """A Bf16x3Linear (act fused) of `parts` weight parts (2: fp32-level, 1: the weights rounded
    to bf16) when parts > 0 (the caller checked `available`), else torch's fp32 DenseLinear (act
    left to the caller)."""
    if parts:
        return Bf16x3Linear(weight, bias, act, parts)
    return DenseLinear(weight.float(), bias)


def count_parameters(model: nn.Module) -> int:
    """The model's parameters, its Bf16x3Linears' weights and biases counted (kept as buffers)."""
    return (sum(p.numel() for p in model.parameters())
            + sum(m.weights for m in model.modules() if isinstance(m, Bf16x3Linear)))
