"""What checking the conversion cache costs a load (localllm.model.cache_file).

    python bench/cache_check.py                                   # the default model
    python bench/cache_check.py bench/models/random-smollm2-1.7b.Q4_1.gguf   # (bench/make_gguf.py)

Converts the GGUF once into a temporary LOCALLLM_HOME, then times: the candidate hashes over the
cache file's tensors on one thread (GB/s), the check as the loader runs it (torch's thread count,
here OMP_NUM_THREADS), and load_model from the cache with and without the check (the best of
--repeat; the file is in the page cache, as on every start after the first).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="a GGUF file (default: the default model)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from localllm_kernels import cpu_build

    os.environ.setdefault("LOCALLLM_KERNEL_CACHE", str(cpu_build.cache_dir()))  # not rebuilt in the temp home
    home = tempfile.mkdtemp(prefix="localllm-bench-cache-")
    os.environ["LOCALLLM_HOME"] = home
    try:
        measure(args)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def measure(args) -> None:
    import torch
    import xxhash

    from localllm.model import cache_file
    from localllm.model.convert_cache import ConvertCache
    from localllm.model.loader import load_model
    from localllm.registry import resolve_model

    path = Path(args.model) if args.model else resolve_model(None).local_path
    load_model(path)  # converts and writes the cache (in a background thread)
    ConvertCache.wait_written()
    (cached,) = (Path(os.environ["LOCALLLM_HOME"]) / "converted").glob("*.safetensors")
    size = cached.stat().st_size
    print(f"{path.name}: conversion cache {size / 1e6:.0f} MB; torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} CPUs")

    tensors, check = cache_file.open_checked(cached, 1)
    assert check.wait() is None
    views = [t.reshape(-1).view(torch.uint8).numpy() for t in tensors.values()]
    hashes = {"xxh3-64 (xxhash)": lambda v: xxhash.xxh3_64_intdigest(v), "crc32 (zlib)": lambda v: zlib.crc32(v), "adler32 (zlib)": lambda v: zlib.adler32(v),
              "sha256": lambda v: hashlib.sha256(v).digest(), "blake2b": lambda v: hashlib.blake2b(v).digest()}
    for name, h in hashes.items():  # wall and CPU time: the CPU figure holds on a busy machine too
        best, cpu = min(_timed(lambda h=h: [h(v) for v in views], time.process_time) for _ in range(3))
        print(f"  {name:15s} one thread: {size / best / 1e9:5.2f} GB/s wall ({best * 1e3:.0f} ms), "
              f"{size / cpu / 1e9:5.2f} GB/s per CPU second")
    best = min(_timed(lambda: cache_file.open_checked(cached, torch.get_num_threads())[1].wait())
               for _ in range(3))
    print(f"  the check as the loader runs it ({torch.get_num_threads()} threads, alone): {best * 1e3:.0f} ms")

    # the check runs while the loader builds the model; what it adds is the loader's wait at the end
    real_open, real_wait, waits = cache_file.open_checked, cache_file.Check.wait, []

    def wait(self):
        t = time.perf_counter()
        try:
            return real_wait(self)
        finally:
            waits.append(time.perf_counter() - t)

    def unchecked(p, n):  # the same mapping, no checksums
        from safetensors.torch import load_file

        return load_file(str(p)), cache_file.Check()

    times, wait_times = {"checked": [], "unchecked": []}, []
    cache_file.Check.wait = wait
    try:
        for _ in range(args.repeat):
            for kind in times:
                cache_file.open_checked = real_open if kind == "checked" else unchecked
                waits.clear()
                times[kind].append(_timed(lambda: load_model(path)))
                if kind == "checked":
                    wait_times.append(sum(waits))
    finally:
        cache_file.open_checked, cache_file.Check.wait = real_open, real_wait
    med = {k: statistics.median(v) * 1e3 for k, v in [*times.items(), ("wait", wait_times)]}
    print(f"  load_model from the cache, medians of {args.repeat}: {med['checked']:.0f} ms checked, of which "
          f"{med['wait']:.0f} ms waiting for the check after the build; {med['unchecked']:.0f} ms unchecked")


def _timed(fn, cpu_clock=None):
    """Wall seconds of fn(); with cpu_clock, (wall, that clock's seconds)."""
    t, c = time.perf_counter(), cpu_clock() if cpu_clock else 0.0
    fn()
    wall = time.perf_counter() - t
    return (wall, cpu_clock() - c) if cpu_clock else wall


if __name__ == "__main__":
    main()
