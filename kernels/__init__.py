"""Triton GPU kernels of localllm (installed as ``localllm_kernels``; imports only torch/triton).

Under ``TRITON_INTERPRET=1`` (set before this package is imported) they run on CPU tensors in
Triton's interpreter, which is how the unit tests check them on machines without a GPU.
"""

from .activation import silu_and_mul
from .flash_attention import flash_attn_varlen_paged
from .int4_matmul import int4_dequantize, int4_matmul
from .kv_store import store_kv
from .paged_decode import default_num_splits, paged_decode_attention
from .rmsnorm import rms_norm
from .rope import apply_rope

__all__ = [
    "apply_rope",
    "default_num_splits",
    "flash_attn_varlen_paged",
    "int4_dequantize",
    "int4_matmul",
    "paged_decode_attention",
    "rms_norm",
    "silu_and_mul",
    "store_kv",
]
