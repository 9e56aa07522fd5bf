"""The one internal int4 layout every 4-bit format (GGUF Q4_0/Q4_1, AWQ, GPTQ) is converted into.

w[n, k] = (q[n, k] - 8) * scales[k // g, n] + zeros[k // g, n],  q in 0..15.

This is torch's `_weight_int4pack_mm_for_cpu` convention (so the CPU path needs no conversion
of scales) and the layout of the Triton kernel `localllm_kernels.int4_matmul`
(qweight uint8 [N, K/2], element 2j in the low nibble of byte j).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Int4Weight:
    q: torch.Tensor  # uint8 [N, K], values 0..15
    scales: torch.Tensor  # [K // group_size, N] float32
    zeros: torch.Tensor  # [K // group_size, N] float32
    group_size: int
    # act-order (GPTQ desc_act): K was permuted at load so groups are contiguous; the layer must
    # feed x[..., in_perm]. dequantize() returns the matrix in that permuted column order.
    in_perm: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.q.shape
        g = self.group_size
        q = self.q.view(n, k // g, g).to(torch.float32) - 8.0
        w = q * self.scales.t().unsqueeze(-1) + self.zeros.t().unsqueeze(-1)
        return w.reshape(n, k).to(dtype)

    def packed(self) -> torch.Tensor:
        """uint8 [N, K/2]: element 2j in the low nibble, 2j+1 in the high nibble."""
        return (self.q[:, 0::2] | (self.q[:, 1::2] << 4)).contiguous()

    def permute_rows(self, perm: torch.Tensor) -> Int4Weight:
        return Int4Weight(self.q[perm], self.scales[:, perm], self.zeros[:, perm], self.group_size, self.in_perm)

    def dequantize_logical(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight W with y = x @ W.T in the checkpoint's own column order (undoes in_perm)."""
        w = self.dequantize(dtype)
        return w if self.in_perm is None else w[:, torch.argsort(self.in_perm)]

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """Concatenate along the output dim (fused qkv / gate_up). Parts must share the group size
        and the input permutation (see `can_cat`)."""
        g = parts[0].group_size
        assert Int4Weight.can_cat(parts)
        return Int4Weight(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts], 1),
                          torch.cat([p.zeros for p in parts], 1), g, parts[0].in_perm)

    @staticmethod
    def can_cat(parts: list[Int4Weight]) -> bool:
        p0 = parts[0]
        same_perm = all((p.in_perm is None) == (p0.in_perm is None) and
                        (p.in_perm is None or torch.equal(p.in_perm, p0.in_perm)) for p in parts)
        return same_perm and all(p.group_size == p0.group_size for p in parts)


def quantize_rtn(w: torch.Tensor, group_size: int = 32) -> Int4Weight:
    """Round-to-nearest asymmetric int4 per group (min/max), in the internal layout."""
    n, k = w.shape
    wg = w.float().reshape(n, k // group_size, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-10)
    q = torch.round((wg - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
    # w = q*scale + lo = (q - 8)*scale + (lo + 8*scale)
    return Int4Weight(q.reshape(n, k), scale.t().contiguous(), (lo + 8 * scale).t().contiguous(), group_size)
