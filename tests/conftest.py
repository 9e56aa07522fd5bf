import os

# Triton's interpreter must be chosen before any @triton.jit decorator runs, i.e. before
# localllm_kernels is imported anywhere; without a GPU the kernels can only run interpreted.
if not os.environ.get("CUDA_VISIBLE_DEVICES_FORCE_NATIVE"):
    try:
        import torch

        _has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        _has_cuda = False
    if not _has_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
