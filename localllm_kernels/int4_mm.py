"""int4 weight-only matmul in localllm's one internal int4 layout.

qweight uint8 [N, K//2]: row n is output channel n; byte j holds k=2j (low nibble) and k=2j+1
(high nibble). scales, zeros [K//group, N] in the activation dtype.
    w[n, k] = (q[n, k] - 8) * scales[k // group, n] + zeros[k // group, n]
(torch's _weight_int4pack_mm_for_cpu convention). y = x @ w.T.

Small M (decode, speculative verify): fused dequant-GEMM, the weight tile is unpacked in
registers and fed to tl.dot; split-K adds programs when M*N alone cannot fill the GPU.
Large M: dequantize once to a dense [N, K] weight and use torch's matmul (compute-bound there).
"""

import functools

import torch
import triton
import triton.language as tl

FUSED_MAX_M = 64  # above this the dense matmul on a dequantized weight wins


@triton.jit
def _dequant_tile(qw_ptrs, s_ptrs, z_ptrs, n_mask):
    # [BN, BK//2] packed bytes -> [BN, BK] fp32; the tile lies in one quantization group.
    packed = tl.load(qw_ptrs, mask=n_mask[:, None], other=0)
    q = tl.interleave(packed & 0xF, packed >> 4).to(tl.float32)  # k=2j low nibble, 2j+1 high
    s = tl.load(s_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    # (q - 8) * s + z == q * s + (z - 8 s): one FMA per element
    return q * s[:, None] + (z - 8.0 * s)[:, None]


@triton.jit
def _int4_mm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_qn, stride_sg, stride_ym, stride_ysplit,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    qw_rows = qw_ptr + offs_n.to(tl.int64)[:, None] * stride_qn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # Split s takes K tiles s, s + SPLIT_K, ... (no divisibility requirement on the tile count).
    for t in range(pid_k, K // BLOCK_K, SPLIT_K):
        k0 = t * BLOCK_K
        x = tl.load(x_rows + k0 + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        g = k0 // GROUP
        w = _dequant_tile(qw_rows + k0 // 2 + offs_kb[None, :],
                          s_ptr + g * stride_sg + offs_n, z_ptr + g * stride_sg + offs_n, n_mask)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PREC)
    y_ptrs = y_ptr + pid_k * stride_ysplit + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _int4_dequant_kernel(
    qw_ptr, s_ptr, z_ptr, w_ptr, N,
    stride_qn, stride_sg, stride_wn,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_kb = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    n_mask = offs_n < N
    g = (pid_k * BLOCK_K) // GROUP
    w = _dequant_tile(qw_ptr + offs_n.to(tl.int64)[:, None] * stride_qn + offs_kb[None, :],
                      s_ptr + g * stride_sg + offs_n, z_ptr + g * stride_sg + offs_n, n_mask)
    tl.store(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :],
             w.to(w_ptr.dtype.element_ty), mask=n_mask[:, None])


def _num_sms(device: torch.device) -> int:
    # Only used to size split counts; off-GPU (interpreter, meta tensors) any small number works.
    return _cuda_sms(device.index or 0) if device.type == "cuda" else 4


@functools.lru_cache(maxsize=8)
def _cuda_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _check(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> tuple[int, int]:
    n, k_half = qweight.shape
    k = 2 * k_half
    assert qweight.dtype == torch.uint8 and qweight.stride(-1) == 1
    assert group_size in (32, 64, 128) and k % group_size == 0, "K must be a multiple of group_size"
    assert scales.shape == zeros.shape == (k // group_size, n)
    assert scales.stride(-1) == 1 and zeros.stride() == scales.stride()
    return n, k


def int4_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """Expand qweight [N, K//2] to a dense w [N, K] in scales' dtype."""
    n, k = _check(qweight, scales, zeros, group_size)
    w = torch.empty(n, k, dtype=scales.dtype, device=qweight.device)
    block_k = group_size
    block_n = 128
    _int4_dequant_kernel[(triton.cdiv(n, block_n), k // block_k)](
        qweight, scales, zeros, w, n,
        qweight.stride(0), scales.stride(0), w.stride(0),
        GROUP=group_size, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    return w


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, *, split_k: int | None = None, block_n: int = 64, num_warps: int = 4,
                num_stages: int = 3) -> torch.Tensor:
    """y [..., N] = x [..., K] @ w.T, w the dequantized qweight. Fused kernel for M <= 64 rows,
    dequantize + dense matmul above. split_k / block_n / num_warps / num_stages override the
    fused kernel's launch configuration (tests, `bench/gpu_kernels.py --sweep-int4`)."""
    n, k = _check(qweight, scales, zeros, group_size)
    assert x.shape[-1] == k and x.dtype == scales.dtype
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m > FUSED_MAX_M:
        return (x2 @ int4_dequantize(qweight, scales, zeros, group_size).t()).reshape(*lead, n)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_k = group_size if x.element_size() <= 2 else min(group_size, 64)  # K tile within one group
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    k_tiles = k // block_k
    if split_k is None:
        # Aim for ~2 programs per SM when M*N alone is too few (decode shapes).
        sms = _num_sms(x.device)
        split_k = max(1, min(16, k_tiles, triton.cdiv(2 * sms, tiles)))
    split_k = max(1, min(split_k, k_tiles))
    if split_k == 1:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        y = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    if m > 0:
        _int4_mm_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m), split_k)](
            x2, qweight, scales, zeros, y,
            m, n, k,
            x2.stride(0), qweight.stride(0), scales.stride(0), n, m * n,
            GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
            DOT_PREC="tf32x3" if x.dtype == torch.float32 else "tf32",
            num_warps=num_warps, num_stages=num_stages,
        )
    if split_k > 1:
        y = y.sum(0).to(x.dtype)
    return y.reshape(*lead, n)
