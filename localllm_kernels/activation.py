"""SiLU(gate) * up on the fused gate_up projection's output, one pass (one program per row tile)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    # rounded to the activation dtype before the product, as F.silu(g) * u does in that dtype
    s = (g * tl.sigmoid(g)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2F] (gate first, then up) -> silu(gate) * up [..., F]."""
    shape = gate_up.shape
    f = shape[-1] // 2
    x = gate_up.reshape(-1, 2 * f)
    assert x.stride(-1) == 1
    out = torch.empty((x.shape[0], f), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(f))
    if x.shape[0]:
        _silu_mul_kernel[(x.shape[0], triton.cdiv(f, block))](x, out, x.stride(0), out.stride(0), f, BLOCK=block,
                                                              num_warps=4 if block >= 512 else 1)
    return out.view(*shape[:-1], f)
