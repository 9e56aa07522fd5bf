"""fp32 linears for encoders on the AMX tile unit (localllm_kernels.cpu_bf16x3): weights and
activations each split into two bf16 parts, three exact products accumulated in fp32 (~1e-5
relative to fp32), the bias and the exact GELU fused into the GEMM's output.

What the encoder loader asks: whether the kernel runs here (`available`) and the linear for a
weight (`linear`): a Bf16x3Linear where the CPU has AMX-BF16, torch's fp32 DenseLinear elsewhere.
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


class Bf16x3Linear(nn.Module):
    """y = act(x W^T + b) on the tile unit; `act` ("none" or "gelu", the erf GELU) is applied
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
