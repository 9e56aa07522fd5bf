"""The conversion cache's file format: safetensors whose header records a 64-bit XXH3 hash of
every tensor (of its name, dtype, shape and bytes), written durably (localllm.durable) and checked
on load.

XXH3 rather than a cryptographic hash or a CRC: the check guards against damage (a crash before
the data reached the disk, a bad sector, a truncated copy), not against someone who can write
the cache and so anything else. XXH3 runs ~26-30 GB/s a core here, zlib's crc32 ~4 (it was the
check before: 0.54 s of a 4 GB MoE cache's 0.66 s later load), sha256 ~1.3 (BENCHMARKS.md,
"Checking the conversion cache"). The tensors are checked in threads (xxhash releases the GIL)
while the loader builds the model from the mapped file, and the loader waits for the verdict
before the model is used.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from ..durable import publish

KEY = "localllm.xxh3"  # header metadata: JSON {tensor name: its checksum}


class DamagedFile(Exception):
    """The file cannot be read as a checked cache file (truncated, a broken header, no checksums)."""


def checksum(name: str, t: torch.Tensor) -> int:
    """XXH3-64 of a contiguous tensor's bytes, seeded by its description (a header that still parses
    but gives a tensor another shape or dtype changes it as damaged bytes do)."""
    head = xxhash.xxh3_64_intdigest(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
    return xxhash.xxh3_64_intdigest(t.detach().reshape(-1).view(torch.uint8).numpy(), head)


@dataclass
class Check:
    """The pending check of an opened file's tensors."""

    futures: dict[str, Future] = field(default_factory=dict)
    expected: dict[str, int] = field(default_factory=dict)
    unrecorded: list[str] = field(default_factory=list)  # tensors without a checksum, or checksums without a tensor

    def wait(self) -> str | None:
        """None when every tensor matched its recorded checksum, else what is wrong."""
        bad = [n for n, f in self.futures.items() if f.result() != self.expected[n]]
        if self.unrecorded:
            return f"{len(self.unrecorded)} tensors without a checksum or missing (first: {self.unrecorded[0]})"
        if bad:
            return f"{len(bad)} of {len(self.futures)} tensors do not match their checksums (first: {bad[0]})"
        return None


def _start(tensors: dict[str, torch.Tensor], expected: dict[str, int], threads: int) -> Check:
    check = Check(expected=expected, unrecorded=sorted(set(tensors) ^ set(expected)))
    pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="cache-check")
    for name in sorted(tensors, key=lambda n: -tensors[n].nbytes):  # largest first: the threads end together
        if name in expected:
            check.futures[name] = pool.submit(checksum, name, tensors[name])
    pool.shutdown(wait=False)  # what was submitted still runs; the threads end with it
    return check


def open_checked(path: Path, threads: int) -> tuple[dict[str, torch.Tensor], Check]:
    """The file's tensors (mapped, not read) and their check, started in `threads` threads.
    DamagedFile when the file cannot be read at all."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        expected = {k: int(v) for k, v in json.loads(meta[KEY]).items()}
    except KeyError:
        raise DamagedFile("no checksums in its header") from None
    except Exception as e:  # safetensors' own errors, bad JSON, a short file
        raise DamagedFile(f"{type(e).__name__}: {e}") from None
    return tensors, _start(tensors, expected, threads)


def verify(path: Path, threads: int = 1) -> str | None:
    """None when the file at `path` is intact, else what is wrong (tests, bench)."""
    try:
        _, check = open_checked(path, threads)
    except DamagedFile as e:
        return str(e)
    return check.wait()


def save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write `tensors` to `path` with their checksums, durably and atomically (a crash leaves the old
    file or none, never part of this one). The sums are taken in the calling thread: a pool made by
    a background writer once the main thread has returned (a `run` that printed its answer) is
    refused by an interpreter shutting down, and the file was lost."""
    from safetensors.torch import save_file

    tensors = {k: v.contiguous() for k, v in tensors.items()}
    sums = {k: checksum(k, v) for k, v in tensors.items()}
    tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")  # two loads in one process too
    try:
        save_file(tensors, str(tmp), metadata={KEY: json.dumps(sums)})
        publish(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def remove_orphans(folder: Path, prefix: str) -> None:
    """Remove the unfinished files (`save`'s temporaries) named `prefix`* in `folder` of processes
    that are gone: a write cut short (a second Ctrl-C while `run` waited for it, a kill) leaves one."""
    for tmp in folder.glob(f"{prefix}*.tmp*"):
        pid = tmp.suffix[len(".tmp"):].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's
        return True
    return True
