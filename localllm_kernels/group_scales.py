"""The K-quant scale records our CPU GEMMs read (`localllm_kernels/cpu/group_scales.h`: the Super form), built
and read back here for both of them (cpu_int4's Q4_K, cpu_int8's other K-quants).

Per 16-row block and 256 columns, one record: the 16 rows' fp16 super-scales d, (with offsets) their
fp16 -dmin, then int8 sub-scales [256 / group][16] and (with offsets) int8 mins [256 / group][16].
A group's scale is d * sc and its offset -dmin * mn, formed in fp32 by the kernel: exact, so the
values are the file's. Imports only torch.
"""

from __future__ import annotations

import torch

ROWS = 16


def record_bytes(group: int, offsets: bool) -> int:
    """Bytes of one record (16 rows, 256 columns)."""
    return (32 + (256 // group) * ROWS) * (2 if offsets else 1)


def pack(d: torch.Tensor, sc: torch.Tensor, nm: torch.Tensor | None, mn: torch.Tensor | None,
         group: int) -> torch.Tensor:
    """d and nm fp32 [N, K/256] (fp16 values: the file's d and -dmin), sc and mn int8 [N, K/group]
    -> uint8 [N/16, K/256, record_bytes] (N padded to 16 with zero rows)."""
    n, s = d.shape
    gps = 256 // group
    if sc.shape != (n, s * gps) or (nm is None) != (mn is None):
        raise ValueError(f"sub-scales [N, K/group] = {tuple(sc.shape)} do not match super-scales {tuple(d.shape)}")
    halves = [d] if nm is None else [d, nm]
    subs = [sc] if mn is None else [sc, mn]
    h16 = [h.half() for h in halves]
    if not all(torch.equal(a.float(), b) for a, b in zip(h16, halves)):
        raise ValueError("super-scales must be fp16 values (the file's own)")
    pad = -n % ROWS
    nb = (n + pad) // ROWS

    def rows(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t

    head = [rows(h).view(nb, ROWS, s).permute(0, 2, 1).contiguous().view(torch.uint8) for h in h16]  # [nb, s, 32]
    body = [rows(t.to(torch.int8)).view(nb, ROWS, s, gps).permute(0, 2, 3, 1).reshape(nb, s, gps * ROWS)
            .view(torch.uint8) for t in subs]
    return torch.cat(head + body, dim=2).contiguous()


def unpack(rec: torch.Tensor, n: int, group: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The records' group scales and offsets, fp32 [n, K/group] each (offsets None without mins),
    as the kernel forms them."""
    nb, s, size = rec.shape
    gps = 256 // group
    offsets = size == record_bytes(group, True)
    if size != record_bytes(group, offsets):
        raise ValueError(f"a record of {size} bytes is no scale record for groups of {group}")
    k = 1 + offsets
    head = rec[..., :32 * k].reshape(nb, s, k, ROWS * 2).contiguous().view(torch.float16).float()  # [nb, s, k, 16]
    body = rec[..., 32 * k:].reshape(nb, s, k, gps, ROWS).contiguous().view(torch.int8).float()
    prod = head.unsqueeze(3) * body  # [nb, s, k, gps, 16]: fp32 products, exact
    out = prod.permute(2, 0, 4, 1, 3).reshape(k, nb * ROWS, s * gps)[:, :n]
    return out[0], (out[1] if offsets else None)
