"""What this machine has: device and free memory."""

from __future__ import annotations

import os

import torch


def pick_device(requested: str = "auto") -> str:
    if requested not in ("auto", "cpu") and not requested.startswith("cuda"):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {requested!r}")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device cuda requested but no CUDA GPU is available")
    return requested


def available_memory(device: str) -> int:
    """Bytes free for weights + KV on `device` (GPU: free VRAM; CPU: MemAvailable)."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def physical_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
