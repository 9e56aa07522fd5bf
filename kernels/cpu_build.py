"""Building, caching and loading our C++ CPU kernels (kernels/cpu/*.cpp), shared by cpu_int4 and
cpu_attention.

Each source is compiled once per machine with the system C++ compiler ($CXX, default c++) against
torch's headers into a shared library cached under ~/.cache/localllm/kernels
(LOCALLLM_KERNEL_CACHE), named by a hash of the source, torch, the flags and anything else the
caller names (the CPU's feature flags when it builds with -march=native). Builds are atomic
(concurrent builders each write their own file, then rename it into place); a damaged library file
is built again once; a failing compiler makes ``load`` return False and log why. Imports only torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    override = os.environ.get("LOCALLLM_KERNEL_CACHE")
    if override:
        return Path(override)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "localllm" / "kernels"


def cpu_flags() -> str:
    """This CPU's feature flags as /proc/cpuinfo lists them ('flags' on x86, 'Features' on Arm),
    with the machine name: what -march=native compiles for."""
    line = ""
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith(("flags", "Features")):
                line = ln.split(":", 1)[-1]
                break
    except OSError:
        pass
    return f"{platform.machine()}:{' '.join(sorted(line.split()))}"


def library_path(source: Path, flags: list[str], extra: str = "") -> Path:
    """The cached library of `source` built with `flags`; `extra` is anything else its machine code
    depends on (empty: the library runs on any CPU the source itself checks for)."""
    key = hashlib.sha256(source.read_bytes())
    key.update(f"{torch.__version__}|{torch._C._GLIBCXX_USE_CXX11_ABI}|{flags}".encode())
    if extra:
        key.update(f"|{extra}".encode())
    return cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"


def build(source: Path, out: Path, flags: list[str]) -> None:
    """Compile `source` into the library `out` (atomically). RuntimeError when the compiler fails."""
    torch_dir = Path(torch.__file__).parent
    inc, lib = torch_dir / "include", torch_dir / "lib"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.stem}.{os.getpid()}.tmp.so")
    cmd = [os.environ.get("CXX", "c++"), *flags, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           f"-I{inc}", f"-I{inc / 'torch' / 'csrc' / 'api' / 'include'}", str(source), f"-L{lib}",
           f"-Wl,-rpath,{lib}", "-ltorch", "-ltorch_cpu", "-lc10", "-o", str(tmp)]
    try:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:  # no compiler at all
            raise RuntimeError(f"building {source.name} failed: {e}") from e
        if done.returncode != 0:
            raise RuntimeError(f"building {source.name} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def load_library(path: Path, build_fn: Callable[[Path], None], what: str, instead: str) -> bool:
    """Load the library at `path` into torch (its ops register themselves), building it with
    `build_fn(path)` when missing, and once more when the file is damaged. False, with a log
    message naming `what` and what runs `instead`, when it cannot be built or loaded."""
    try:
        try:
            if not path.is_file():
                log.warning("building the %s (once per machine, a few seconds) into %s", what, path)
                build_fn(path)
            torch.ops.load_library(str(path))
        except OSError:  # a damaged library file: build it again, once
            path.unlink(missing_ok=True)
            build_fn(path)
            torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        log.warning("%s unavailable, using %s: %s", what, instead, e)
        return False
    return True
