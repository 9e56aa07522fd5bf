"""16-bit weights kept as stored on CPU: GGUF F16/BF16 tensors and HF bf16/fp16 safetensors.

What the loader asks: which checkpoints store their linears in 16 bits (`stored_dtype`), a
tensor's 16-bit values exactly as stored (`tensor16`), and the W16Linear over a fused layer's
parts (`linear`): localllm_kernels.cpu_bf16's kernel computes on those values in fp32, so the
results are an fp32 model's on the upcast weights (up to summation order) from half the bytes.
"""

from __future__ import annotations

import torch

from .layers import DenseLinear, W16Linear

GGUF_KINDS = {"F16": torch.float16, "BF16": torch.bfloat16}
DTYPES = (torch.bfloat16, torch.float16)


def kernel_available() -> bool:
    from localllm_kernels import cpu_bf16

    return cpu_bf16.load()


def stored_dtype(weights, name: str) -> torch.dtype | None:
    """The 16-bit dtype `name` is stored in (a GGUF F16/BF16 tensor, an HF bf16/fp16 one); None
    for any other storage (fp32, quantized)."""
    # an AWQ / GPTQ checkpoint: the loader's int4 path holds it (its float tensors as before)
    if getattr(weights, "quant", None) is not None and weights.quant["quant_method"] != "mxfp4":
        return None
    return GGUF_KINDS.get(weights.kind(name))  # (HF's safetensors dtypes have GGUF's names)


def tensor16(weights, name: str) -> torch.Tensor:
    """`name`'s values as stored, bf16 or fp16 [N, K], in the row order the loader uses (GGUF
    llama q/k into rotate_half order)."""
    if hasattr(weights, "file"):  # GGUFWeights
        t = weights._tensor(name)
        w = torch.from_numpy(weights.file.read(t)).view(GGUF_KINDS[t.qtype.name]).view(*t.shape)
        perm = weights._perm(name)
        return w[perm] if perm is not None else w
    return weights.dense(name)


def linear(weights, names: list[str], bias: torch.Tensor | None) -> torch.nn.Module:
    """One W16Linear over the parts `names` (rows stacked), in their stored dtype; an fp32
    DenseLinear when the parts are not all stored in one 16-bit dtype or the kernel cannot load."""
    dtypes = {stored_dtype(weights, n) for n in names}
    if len(dtypes) != 1 or dtypes.pop() not in DTYPES or not kernel_available():
        return DenseLinear(torch.cat([weights.dense(n).float() for n in names]), bias)
    parts = [tensor16(weights, n) for n in names]
    return W16Linear(parts[0] if len(parts) == 1 else torch.cat(parts), bias)  # (one part: no copy)


def isa() -> str:
    """The path the kernel takes here ("amx", "avx512", "avx2", "generic")."""
    from localllm_kernels import cpu_bf16

    return cpu_bf16.isa()


def describe(layers: list[torch.nn.Module]) -> str:
    """What the plan and `show` say of a model whose linears are kept in 16 bits."""
    dtypes = sorted({str(m.w.dtype).removeprefix("torch.") for layer in layers for m in layer.modules()
                     if isinstance(m, W16Linear)})
    if not dtypes:  # the kernel could not load: the fp32 copy
        return "float32"
    names = "/".join({"bfloat16": "bf16", "float16": "fp16"}[d] for d in dtypes)
    return f"16-bit weights ({names} as stored, our kernel, {isa()}), fp32 activations"
