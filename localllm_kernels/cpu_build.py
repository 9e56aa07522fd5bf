"""Building, caching and loading our C++ CPU kernels (localllm_kernels/cpu/*.cpp), shared by cpu_int4 and
cpu_attention.

Each source is compiled once per machine with the system C++ compiler ($CXX, default c++) against
torch's headers into a shared library cached under ~/.cache/localllm/kernels ($LOCALLLM_HOME/kernels
when that is set, LOCALLLM_KERNEL_CACHE overriding both), named by a hash of the source and the
headers of ours it includes, torch, the flags and anything else the caller names (the CPU's
feature flags when it builds with -march=native). Builds are atomic and durable (concurrent builders each write their own file,
fsync it, then rename it into place) and leave a sidecar with the library's size and sha256; a
library that does not match its sidecar (cut short, damaged, or built before sidecars) is built
again before it is loaded: loading a truncated library dies of SIGBUS. A failing compiler makes
``load`` return False and log why. Imports only torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_LOCAL_INCLUDE = re.compile(r'\s*#\s*include\s+"([^"]+)"')


def cache_dir() -> Path:
    """localllm.paths.cache_home() / "kernels" (spelled out here: this package imports only torch)."""
    override = os.environ.get("LOCALLLM_KERNEL_CACHE")
    if override:
        return Path(override).expanduser()
    home = os.environ.get("LOCALLLM_HOME")
    if home:
        return Path(home).expanduser() / "kernels"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "localllm" / "kernels"


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


def build_inputs(source: Path) -> list[Path]:
    """`source` and the headers of ours it includes (`#include "x.h"`, beside it), theirs too:
    the files a library is built from."""
    seen, todo = [], [source]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.append(f)
        for line in f.read_text().splitlines():
            m = _LOCAL_INCLUDE.match(line)
            if m:
                todo.append(f.parent / m[1])
    return seen


def library_path(source: Path, flags: list[str], extra: str = "") -> Path:
    """The cached library of `source` built with `flags`; `extra` is anything else its machine code
    depends on (empty: the library runs on any CPU the source itself checks for)."""
    key = hashlib.sha256()
    for f in build_inputs(source):  # a header shared by two kernels rebuilds both when it changes
        key.update(f.read_bytes())
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
    side = tmp.with_suffix(".json")
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
        _fsync(tmp)
        side.write_text(json.dumps(_record(tmp)))
        _fsync(side)
        # the sidecar first: a crash between the renames leaves a sidecar the old file fails
        os.replace(side, sidecar(out))
        os.replace(tmp, out)
        _fsync(out.parent)
    finally:
        tmp.unlink(missing_ok=True)
        side.unlink(missing_ok=True)


def sidecar(library: Path) -> Path:
    return library.with_suffix(".json")


def _record(path: Path) -> dict:
    data = path.read_bytes()
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # a folder on a filesystem that cannot fsync one
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def check(library: Path) -> str | None:
    """None when `library` matches its sidecar (size, then sha256: ~1 ms for our libraries), else
    what is wrong."""
    try:
        want = json.loads(sidecar(library).read_text())
        size, digest = int(want["size"]), str(want["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return "no readable sidecar with its sha256"
    try:
        have = _record(library)
    except OSError as e:
        return str(e)
    if have["size"] != size:
        return f"{have['size']} bytes where {size} were built"
    return None if have["sha256"] == digest else "its sha256 differs from the one recorded at build"


def load_library(path: Path, build_fn: Callable[[Path], None], what: str, instead: str) -> bool:
    """Load the library at `path` into torch (its ops register themselves), building it with
    `build_fn(path)` when missing or when it does not match its sidecar, and once more when the
    loader refuses it. False, with a log message naming `what` and what runs `instead`, when it
    cannot be built or loaded."""
    try:
        try:
            if not path.is_file():
                log.warning("building the %s (once per machine, a few seconds) into %s", what, path)
                build_fn(path)
            elif (why := check(path)) is not None:
                log.warning("the %s at %s does not match its build (%s): building it again (a few seconds)",
                            what, path, why)
                build_fn(path)
            torch.ops.load_library(str(path))
        except OSError:  # intact but refused by the dynamic loader (built elsewhere?): build it again, once
            path.unlink(missing_ok=True)
            build_fn(path)
            torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        log.warning("%s unavailable, using %s: %s", what, instead, e)
        return False
    return True
