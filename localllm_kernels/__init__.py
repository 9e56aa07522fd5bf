"""Kernels of localllm (installed as ``localllm_kernels``; imports only torch/triton).

Triton GPU kernels, and ``cpu_int4``: the C++ int4 GEMM used on CPU (AVX-512 VNNI or AVX2). Names load on
first use, so the CPU path (``localllm_kernels.cpu_int4``) never pays for importing triton.
Under ``TRITON_INTERPRET=1`` (set before a Triton kernel is first used) they run on CPU tensors
in Triton's interpreter, which is how the unit tests check them on machines without a GPU.
"""

import importlib

_WHERE = {
    "apply_rope": "rope",
    "default_num_splits": "paged_decode",
    "flash_attn_varlen_paged": "flash_attention",
    "int4_dequantize": "int4_mm",
    "int4_matmul": "int4_mm",
    "paged_decode_attention": "paged_decode",
    "rms_norm": "rmsnorm",
    "silu_and_mul": "activation",
    "store_kv": "kv_store",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value
