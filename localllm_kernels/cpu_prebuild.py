"""Building every C++ CPU kernel library ahead of its first use, all at once.

Each kernel module builds its own library the first time it is loaded (cpu_build.load_library),
one after the other as a model load reaches them: ~10-15 s of compiling each on 2 cores, most of
it torch's headers. Built here they compile concurrently (each is its own compiler process), at
set-up time (`make setup` runs ``python -m localllm_kernels.cpu_prebuild``) or at the start of a
CPU model load, so a first contact waits for the slowest compile instead of their sum.
Imports only torch.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from . import cpu_build

# the modules with a C++ library (each has library_path() and build(out))
MODULES = ("cpu_int4", "cpu_int8", "cpu_q8", "cpu_table", "cpu_repack", "cpu_bf16", "cpu_bf16x3", "cpu_attention",
           "cpu_fused", "cpu_sampler")


def missing() -> list[str]:
    """The modules whose library is not built for this machine (a damaged one is rebuilt by its
    own load(), which checks it anyway)."""
    out = []
    for name in MODULES:
        mod = importlib.import_module(f".{name}", __package__)
        if getattr(mod, "supported", lambda: True)() and not mod.library_path().is_file():
            out.append(name)
    return out


def build_missing(workers: int | None = None) -> dict[str, str | None]:
    """Build the missing libraries concurrently: {module: None, or why its build failed}. A
    failed build is not fatal here: that kernel's load() falls back and says so."""
    todo = missing()

    def one(name: str) -> str | None:
        mod = importlib.import_module(f".{name}", __package__)
        try:
            mod.build(mod.library_path())
        except RuntimeError as e:
            return str(e).splitlines()[0]
        return None
    if not todo:
        return {}
    with ThreadPoolExecutor(max_workers=workers or min(len(todo), os.cpu_count() or 1)) as pool:
        return dict(zip(todo, pool.map(one, todo)))


def main() -> int:
    t0 = time.monotonic()
    done = build_missing()
    for name, err in done.items():
        print(f"{name}: {'built' if err is None else 'failed: ' + err}")
    print(f"CPU kernels: {len(done)} built in {time.monotonic() - t0:.1f} s into {cpu_build.cache_dir()}"
          if done else f"CPU kernels: all built already ({cpu_build.cache_dir()})")
    return 0 if all(err is None for err in done.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
