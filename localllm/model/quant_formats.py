"""AWQ and GPTQ checkpoints -> the one internal int4 layout (`Int4Weight`).

Supported: 4-bit AWQ `gemm` (AutoAWQ, `quant_method: awq`, or a legacy `quant_config.json`) and
4-bit GPTQ (AutoGPTQ/GPTQModel, `quant_method: gptq`, or a legacy `quantize_config.json`),
`checkpoint_format` gptq (v1: zeros stored minus one) or gptq_v2, sym or asym, with or without
act-order. Layouts (per linear, prefix `model.layers.i.self_attn.q_proj.`):

  AWQ   qweight int32 [K, N/8]  packed along N, nibble i of word c = column 8c + AWQ_ORDER[i]
        qzeros  int32 [K/g, N/8] same packing;  scales fp16 [K/g, N];  w = (q - z) * s
  GPTQ  qweight int32 [K/8, N]  packed along K, nibble j of row r = input 8r + j
        qzeros  int32 [G, N/8]  packed along N sequentially;  scales [G, N];  g_idx int32 [K]
        w = (q - z) * s[g_idx],  z = nibble + 1 in v1 (as every v1 kernel computes it)

Conversion is exact: internally w = (q - 8) * scale + zero with zero = (8 - z) * s. The CPU/GPU
kernels need contiguous groups of 32/64/128 along K, so a group is re-expressed as several smaller
groups with the same scale when needed (g128 with K = 576 -> g64), and act-order checkpoints get
K sorted by g_idx once here, with the layer gathering its input the same way (`in_perm`). A
module that still cannot be expressed (K not a multiple of 32, N not a multiple of 16) is loaded
dequantized to a dense layer instead, with a warning.

`quant_method: mxfp4` (gpt-oss as published: MXFP4 experts, every other tensor bf16) is read
here as a setting only: hf_weights hands the experts' blocks to the loader in GGUF's MXFP4 layout.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from .errors import ModelLoadError
from .int4 import Int4Weight

log = logging.getLogger("localllm")

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i holds column 8c + AWQ_ORDER[i]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]
KERNEL_GROUPS = (128, 64, 32)  # group sizes the int4 kernels take


class QuantFormatError(ModelLoadError):
    """A quantized checkpoint in a variant we do not load."""


# ---- config ---------------------------------------------------------------------------------
def read_quant_config(path: Path, raw_config: dict) -> dict | None:
    """The checkpoint's quantization settings, normalized and validated, or None (not quantized).

    Looks at config.json `quantization_config`, then the legacy AutoAWQ `quant_config.json` and
    AutoGPTQ `quantize_config.json` files."""
    q = raw_config.get("quantization_config")
    source = "config.json quantization_config"
    if q is None:
        for fname, method in (("quant_config.json", "awq"), ("quantize_config.json", "gptq")):
            f = Path(path) / fname
            if f.is_file():
                try:
                    q = json.loads(f.read_text())
                except json.JSONDecodeError as e:
                    raise QuantFormatError(f"{f}: invalid JSON ({e})") from None
                q.setdefault("quant_method", method)
                source = fname
                break
    if q is None:
        return None
    return normalize_quant_config(q, f"{path}/{source}")


def normalize_quant_config(q: dict, where: str = "quantization_config") -> dict:
    """-> {quant_method, bits, group_size, zero_point|sym, version|checkpoint_format, desc_act,
    modules_to_not_convert}; a clear error naming the field for anything we cannot load."""
    method = str(q.get("quant_method", "")).lower()
    if method == "mxfp4":  # gpt-oss's experts as published (hf_weights reads their blocks)
        return {"quant_method": method, "bits": 4, "group_size": 32,
                "modules_to_not_convert": list(q.get("modules_to_not_convert") or [])}
    if method not in ("awq", "gptq"):
        raise QuantFormatError(f"{where}: quant_method {q.get('quant_method')!r} is not supported "
                               "(supported: awq with version gemm, gptq, mxfp4 for gpt-oss)")
    bits = q.get("bits", q.get("w_bit", 4))
    if bits != 4:
        raise QuantFormatError(f"{where}: bits={bits} is not supported (only 4-bit {method.upper()})")
    group = q.get("group_size", q.get("q_group_size", 128))
    if not isinstance(group, int) or (group != -1 and (group <= 0 or group % 8)):
        raise QuantFormatError(f"{where}: group_size={group!r} is not supported (a multiple of 8, or -1)")
    skip = q.get("modules_to_not_convert") or []
    out = {"quant_method": method, "bits": 4, "group_size": group, "modules_to_not_convert": list(skip)}
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantFormatError(f"{where}: AWQ version {q.get('version')!r} is not supported "
                                   "(only gemm; gemv/gemv_fast/marlin use other layouts)")
        if not q.get("zero_point", True):
            raise QuantFormatError(f"{where}: AWQ zero_point=false is not supported (only asymmetric gemm)")
        out.update(version="gemm", zero_point=True)
        return out
    fmt = str(q.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantFormatError(f"{where}: checkpoint_format {q.get('checkpoint_format')!r} is not supported "
                               "(supported: gptq, gptq_v2; marlin/bitblas/ipex formats are not)")
    if str(q.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise QuantFormatError(f"{where}: pack_dtype {q.get('pack_dtype')!r} is not supported (only int32)")
    dynamic = q.get("dynamic") or {}
    if any(not str(k).startswith("-:") for k in dynamic):
        raise QuantFormatError(f"{where}: GPTQModel 'dynamic' per-module overrides are not supported "
                               "(only '-:' skip rules)")
    out.update(checkpoint_format=fmt, sym=bool(q.get("sym", True)), desc_act=bool(q.get("desc_act", False)),
               lm_head=bool(q.get("lm_head", False)))
    return out


# ---- unpacking --------------------------------------------------------------------------------
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_cols(packed: torch.Tensor, awq_order: bool) -> torch.Tensor:
    """int32 [R, C/8] packed along columns -> int [R, C] nibbles (AWQ order or sequential)."""
    nib = (packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 15  # [R, C/8, 8]: nibble i
    if awq_order:
        nib = nib[..., AWQ_REVERSE_ORDER]
    return nib.reshape(packed.shape[0], -1)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R/8, C] packed along rows (GPTQ qweight) -> int [R, C]."""
    nib = (packed.to(torch.int32).unsqueeze(1) >> _SHIFTS.view(1, 8, 1)) & 15  # [R/8, 8, C]
    return nib.reshape(-1, packed.shape[1])


def _module_prefix(name: str) -> str:
    return name[: -len("weight")] if name.endswith("weight") else name + "."


def is_quantized(weights, name: str) -> bool:
    """Does the checkpoint store `name` (a `.weight`) as a packed int4 module?"""
    q = weights.quant
    prefix = _module_prefix(name)
    if q is None or not weights.has(prefix + "qweight"):
        return False
    return not any(m and m in prefix for m in q.get("modules_to_not_convert", []))


def unpack_module(weights, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (q int32 [K, N], z float32 [G, N], s float32 [G, N], g_idx long [K]): w[k, n] =
    (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n], in the checkpoint's own (logical) K order."""
    spec = weights.quant
    prefix = _module_prefix(name)
    qweight = weights.dense(prefix + "qweight")
    qzeros = weights.dense(prefix + "qzeros")
    scales = weights.dense(prefix + "scales").float()
    if spec["quant_method"] == "awq":
        q = unpack_cols(qweight, awq_order=True)  # [K, N]
        z = unpack_cols(qzeros, awq_order=True).float()
        k = q.shape[0]
        g = k if spec["group_size"] == -1 else spec["group_size"]
        g_idx = torch.arange(k) // g
    else:
        q = unpack_rows(qweight)  # [K, N]
        z = unpack_cols(qzeros, awq_order=False).float()
        if spec["checkpoint_format"] == "gptq":
            z = z + 1  # v1 stores zero - 1; kernels add 1 back without wrapping
        k = q.shape[0]
        if weights.has(prefix + "g_idx"):
            g_idx = weights.dense(prefix + "g_idx").long()
        else:
            g = k if spec["group_size"] == -1 else spec["group_size"]
            g_idx = torch.arange(k) // g
    n = q.shape[1]
    z = z[:, :n]  # qzeros pads N up to a multiple of 8
    if scales.shape[1] != n or z.shape != scales.shape or g_idx.shape != (k,) or \
            int(g_idx.min()) < 0 or int(g_idx.max()) >= scales.shape[0]:
        raise ModelLoadError(f"{weights.path}: {prefix}* tensors have inconsistent shapes (qweight "
                             f"{tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, scales {tuple(scales.shape)}, "
                             f"g_idx {tuple(g_idx.shape)}) for {spec['quant_method'].upper()}")
    return q, z, scales, g_idx


def load_dense(weights, name: str) -> torch.Tensor:
    """A quantized module dequantized to float32 [N, K] (precision float32/bf16/int8, fallbacks)."""
    q, z, s, g_idx = unpack_module(weights, name)
    return ((q.float() - z[g_idx]) * s[g_idx]).t().contiguous()


def load_int4(weights, name: str) -> Int4Weight | None:
    """The module `name` (e.g. model.layers.0.self_attn.q_proj.weight) as an exact Int4Weight, or
    None when the checkpoint keeps it in float (modules_to_not_convert, lm_head, ...) or when the
    int4 kernels cannot take its shape (then the loader dequantizes it to a dense layer)."""
    if not is_quantized(weights, name):
        return None
    q, z, s, g_idx = unpack_module(weights, name)
    k, n = q.shape
    perm = None
    if bool((g_idx[1:] < g_idx[:-1]).any()):  # act-order: make groups contiguous once, here
        perm = torch.argsort(g_idx, stable=True)
        q, g_idx = q[perm], g_idx[perm]
    group = next((g for g in KERNEL_GROUPS if k % g == 0 and bool((g_idx.view(-1, g) == g_idx[::g, None]).all())),
                 None)
    if group is None or n % 16:
        log.warning("%s: %s (K=%d, N=%d, groups of %s) does not fit the int4 kernels; loading it dequantized",
                    weights.path, name, k, n, weights.quant["group_size"])
        return None
    gi = g_idx[::group]
    scales = s[gi].contiguous()  # [K/group, N]
    zeros = ((8.0 - z[gi]) * scales).contiguous()  # (q - z)*s = (q - 8)*s + (8 - z)*s, exact in fp32
    return Int4Weight(q.t().to(torch.uint8).contiguous(), scales, zeros, group, perm)
