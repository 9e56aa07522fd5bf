"""RMSNorm, optionally fused with the residual add before it (one program per row)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
    BLOCK: tl.constexpr, HAS_RES: tl.constexpr, SCALE_FP32: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        # The residual stream is kept in the activation dtype, as the unfused model does.
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    # transformers order: normalise in fp32, cast to the activation dtype, then scale by the weight
    # (Llama); or scale in fp32, then cast (Gemma: SCALE_FP32)
    y = xf * rstd
    if not SCALE_FP32:
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
    scale_in_fp32: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * normalize(x) over the last dim. With residual: h = x + residual, returns
    (rms_norm(h), h) in one pass (the add + norm between decoder sub-blocks). scale_in_fp32:
    the weight scales before the cast to x's dtype (Gemma), not after (Llama)."""
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    assert x2.stride(-1) == 1 and weight.is_contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, n)
        assert r2.stride(-1) == 1
        res_out = torch.empty_like(out)
    else:
        r2 = res_out = out  # unused
    block = triton.next_power_of_2(n)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0), n, eps,
            BLOCK=block, HAS_RES=residual is not None, SCALE_FP32=scale_in_fp32,
            num_warps=min(16, max(1, block // 512)),
        )
    if residual is not None:
        return out.view(shape), res_out.view(shape)
    return out.view(shape)
