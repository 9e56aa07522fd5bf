"""The CPU int4 GEMM (`kernels/cpu/int4_gemm.cpp`, AVX-512 VNNI): build, load and weight packing.

The C++ source is compiled once per machine with the system C++ compiler against torch's headers
(~7 s) into a shared library cached under ~/.cache/localllm/kernels (LOCALLLM_KERNEL_CACHE),
keyed by the source, torch and the flags; it registers ``torch.ops.localllm.int4_gemm``. A CPU
without AVX-512 VNNI, a missing compiler or LOCALLLM_CPU_KERNELS=0 leaves ``load()`` False and
callers on torch's own int4 kernel. Imports only torch.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "cpu" / "int4_gemm.cpp"
ROWS = 16  # output rows per block: the kernel's N must be a multiple
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c")
CXXFLAGS = ["-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w"]


def supported() -> bool:
    """This CPU can run the kernel and it is not switched off."""
    if os.environ.get("LOCALLLM_CPU_KERNELS", "1").lower() in ("0", "false", "no", "off"):
        return False
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return False
    return set(CPU_FLAGS) <= set(flags.split())


def cache_dir() -> Path:
    override = os.environ.get("LOCALLLM_KERNEL_CACHE")
    if override:
        return Path(override)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "localllm" / "kernels"


def library_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update(f"{torch.__version__}|{torch._C._GLIBCXX_USE_CXX11_ABI}|{CXXFLAGS}".encode())
    return cache_dir() / f"int4_gemm-{key.hexdigest()[:16]}.so"


def build(out: Path) -> None:
    """Compile the library into `out` (atomically: concurrent builders each write their own file)."""
    torch_dir = Path(torch.__file__).parent
    inc, lib = torch_dir / "include", torch_dir / "lib"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.stem}.{os.getpid()}.tmp.so")
    cmd = [os.environ.get("CXX", "c++"), *CXXFLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           f"-I{inc}", f"-I{inc / 'torch' / 'csrc' / 'api' / 'include'}", str(SOURCE), f"-L{lib}",
           f"-Wl,-rpath,{lib}", "-ltorch", "-ltorch_cpu", "-lc10", "-o", str(tmp)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


@functools.cache
def load() -> bool:
    """Make torch.ops.localllm.int4_gemm available (building it on first use); False when this
    machine cannot have it, in which case callers use torch's int4 kernel."""
    if not supported():
        return False
    path = library_path()
    try:
        try:
            if not path.is_file():
                log.warning("building the CPU int4 kernel (once per machine, a few seconds) into %s", path)
                build(path)
            torch.ops.load_library(str(path))
        except OSError:  # a damaged library file: build it again, once
            path.unlink(missing_ok=True)
            build(path)
            torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        log.warning("CPU int4 kernel unavailable, using torch's: %s", e)
        return False

    @torch.library.register_fake("localllm::int4_gemm")
    def _(x, w, scales, group_size):  # shapes for torch.export
        return x.new_empty(x.shape[0], w.shape[0] * ROWS)

    return True


def fits(n: int, k: int, group_size: int) -> bool:
    """Shapes the kernel takes (N is padded to a multiple of 16 by pack)."""
    return k % 32 == 0 and group_size % 32 == 0 and k % group_size == 0 and n > 0


def pack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights in the int4 layout of localllm.quant.int4 (w = (q - 8) * scales + zeros; q uint8
    [N, K], scales/zeros [G, N]) -> the kernel's (w uint8 [N/16, K/8, 64], sc [N/16, G, 2, 16]
    with w = d * q + m). Scales are kept in fp16 when that is exact (GGUF, AWQ, GPTQ), else fp32.
    Rows past N are zero padding."""
    n, k = q.shape
    g = scales.shape[0]
    pad = -n % ROWS
    d = scales.t().float()
    m = zeros.t().float() - 8.0 * d
    if pad:
        q = torch.cat([q, q.new_zeros(pad, k)])
        d, m = torch.cat([d, d.new_zeros(pad, g)]), torch.cat([m, m.new_zeros(pad, g)])
    nb = (n + pad) // ROWS
    qb = q.to(torch.uint8).view(nb, ROWS, k // 8, 2, 4)
    w = (qb[:, :, :, 0] | (qb[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(nb, k // 8, 64).contiguous()
    sc = torch.stack([d.view(nb, ROWS, g), m.view(nb, ROWS, g)], 1).permute(0, 3, 1, 2).contiguous()
    half = sc.half()
    exact = torch.isfinite(half).all() and torch.equal(half.float(), sc)
    return w, (half if exact else sc)


def int4_gemm(x: torch.Tensor, w: torch.Tensor, sc: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp32 x [M, K] @ W.T -> fp32 [M, N padded to 16]."""
    return torch.ops.localllm.int4_gemm(x, w, sc, group_size)
