"""The conversion cache: what loading a GGUF on CPU computes, saved once per file and reused."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch
from torch import nn

from . import cache_file
from .errors import ModelLoadError
from .layers import ConcatLinear, Int4Linear, Int8wLinear
from .moe import Int4Experts, Int8wExperts, LoopExperts
from .weights import reads_blocks

log = logging.getLogger(__name__)


def weights_fingerprint(path: str | os.PathLike, *how) -> str:
    """Identity of a checkpoint on disk (path, size and mtime of each file: a split GGUF's every
    shard) plus how it was loaded: the key of everything derived from the weights and cached
    between processes."""
    from .gguf import read_gguf

    path = Path(path).resolve()
    files = (list(read_gguf(path).paths) if path.suffix == ".gguf" else [path]) if path.is_file() else \
        sorted(f for f in path.iterdir() if f.is_file())
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update("|".join(map(str, how)).encode())
    return h.hexdigest()


class ConvertCache:
    """What loading a GGUF (or gpt-oss's MXFP4 checkpoint) on CPU computes (int4pack repacks, MoE
    layers' stacked experts, the fp32 embedding, the int4 copy of the head) saved once per file as
    safetensors under ~/.cache/localllm/converted, keyed by the file's (a directory's: each file's)
    path, size and mtime: a later `localllm run` skips the conversion (see BENCHMARKS.md).
    Written durably with a checksum of every tensor (cache_file); a file that does not match is
    converted again, never used."""

    # 5: MoE experts (Int4Experts' stacks or each looped expert) and routers; 6: crc32s; 7: GGUF types
    # beyond Q4_0/Q4_1 on our kernels (Int8wLinear, ConcatLinear of mixed parts), none re-quantized;
    # 8: K-quant sub-scales and IQ4 indices as the file keeps them, Q4_0 without offsets; 9: 5- and 6-bit
    # values' high bits as shifted bits / 2-bit pairs (were bit planes); 10: int8-lane experts stacked
    # (Int8wExperts, were looped), MXFP4 as codebook indices (was fp32); 11: XXH3-64 checksums (were crc32);
    # 12: experts with biases stacked (gpt-oss: Int8wExperts' b1/b2, were looped)
    VERSION = 12
    # this process's writes still under way, by file: a load of the same file waits for its write
    # rather than converting again (a server reloading a model it just evicted)
    _writing: dict[Path, threading.Thread] = {}

    def __init__(self, file: Path, dense: bool = False, cpu_kernel: bool = True):
        from localllm_kernels import cpu_int4

        from ..paths import cache_home

        # the buffers differ by int4 kernel (ours or torch's), so does the cache
        key = weights_fingerprint(file, torch.__version__, f"v{self.VERSION}", f"dense={dense}",
                                  f"cpu_int4={cpu_kernel and cpu_int4.load()}")
        self.stem = file.stem
        self.path = cache_home() / "converted" / f"{self.stem}-{key[:16]}.safetensors"
        self.tensors: dict[str, torch.Tensor] = {}
        self.hit = False
        self._check: cache_file.Check | None = None
        ConvertCache.wait_written(self.path)
        if self.path.is_file():
            try:  # the tensors' checksums are checked in threads while the loader builds from them
                self.tensors, self._check = cache_file.open_checked(self.path, torch.get_num_threads())
                self.hit = True
            except cache_file.DamagedFile as e:  # truncated, or from before checksums: convert, overwrite
                log.warning("the conversion cache %s is damaged (%s): converting again", self.path, e)

    @staticmethod
    def open(path, weights, mode: str, device: str, dense: bool, cpu_kernel: bool) -> ConvertCache | None:
        if not (reads_blocks(weights) and mode == "int4" and device == "cpu"):
            return None
        return ConvertCache(Path(path), dense, cpu_kernel)

    def linear(self, key: str, build):
        """The cached Int4Linear `key`, or build() (remembered when it is a plain Int4Linear)."""
        m = self._cached_linear(key)
        if m is None:
            m = build()
            if self._keepable(m):
                self._keep_linear(key, m)
        return m

    def experts(self, key: str, n: int, inter: int, build, act: tuple[int, float, float] = (0, 0.0, 0.0)
                ) -> nn.Module:
        """The cached experts `key` of an MoE layer (Int4Experts or Int8wExperts from their stacks, or
        LoopExperts from each expert's linears), or build() (remembered when the cache can hold it).
        act: Int8wExperts' activation (the model's, not the cache's)."""
        t = self.tensors
        if self.hit and f"{key}.w1" in t:
            stacks = [t[f"{key}.{b}"] for b in ("w1", "s1", "w2", "s2")]
            if f"{key}.zero1" in t:
                forms = tuple(int(t[f"{key}.{f}"]) for f in ("group1", "zero1", "group2", "zero2"))
                return Int8wExperts(*stacks, forms, inter, t.get(f"{key}.b1"), t.get(f"{key}.b2"), act)
            return Int4Experts(*stacks, int(t[f"{key}.group1"]), int(t[f"{key}.group2"]), inter)
        keys = [f"{key}.{e}.{part}" for e in range(n) for part in ("gate_up", "down")]
        linears = [self._cached_linear(k) for k in keys] if self.hit else [None]
        if all(x is not None for x in linears):
            return LoopExperts(linears[0::2], linears[1::2])
        m = build()
        if isinstance(m, (Int4Experts, Int8wExperts)):
            forms = ("group1", "group2") + (("zero1", "zero2") if isinstance(m, Int8wExperts) else ())
            t.update({f"{key}.{b}": getattr(m, b) for b in ("w1", "s1", "w2", "s2", "b1", "b2")
                      if getattr(m, b, None) is not None})
            t.update({f"{key}.{f}": torch.tensor(getattr(m, f)) for f in forms})
        elif isinstance(m, LoopExperts):
            linears = [x for pair in zip(m.gate_up, m.down) for x in pair]
            if all(self._keepable(x) for x in linears):
                for k, x in zip(keys, linears):
                    self._keep_linear(k, x)
        return m

    def _cached_linear(self, key: str) -> nn.Module | None:
        t = self.tensors
        if self.hit and f"{key}.parts" in t:  # a ConcatLinear
            parts = [self._cached_linear(f"{key}.part{i}") for i in range(int(t[f"{key}.parts"]))]
            return None if any(p is None for p in parts) else ConcatLinear(parts)
        if not (self.hit and f"{key}.group" in t):
            return None
        if f"{key}.qw8" in t:
            return Int8wLinear(t[f"{key}.qw8"], t[f"{key}.qsc8"], int(t[f"{key}.n"]), int(t[f"{key}.group"]),
                               int(t[f"{key}.zero"]), t.get(f"{key}.bias"))
        names = ("qw", "qsc") if f"{key}.qw" in t else ("packed", "scales_zeros")
        return Int4Linear.from_kernel_tensors({n: t[f"{key}.{n}"] for n in names}, int(t[f"{key}.n"]),
                                              int(t[f"{key}.group"]), t.get(f"{key}.bias"), t.get(f"{key}.dense"))

    @staticmethod
    def _keepable(m) -> bool:
        if isinstance(m, ConcatLinear):
            return all(ConvertCache._keepable(p) for p in m.parts)
        return isinstance(m, Int8wLinear) or (isinstance(m, Int4Linear) and m.in_perm is None and not m.cuda_path)

    def _keep_linear(self, key: str, m: nn.Module) -> None:
        t = self.tensors
        if isinstance(m, ConcatLinear):
            t[f"{key}.parts"] = torch.tensor(len(m.parts))
            for i, p in enumerate(m.parts):
                self._keep_linear(f"{key}.part{i}", p)
            return
        t.update({f"{key}.{n}": v for n, v in m.kernel_tensors().items()})
        t.update({f"{key}.group": torch.tensor(m.group_size), f"{key}.n": torch.tensor(m.out_features)})
        if isinstance(m, Int8wLinear):
            t[f"{key}.zero"] = torch.tensor(m.zero)
        if m.bias is not None:
            t[f"{key}.bias"] = m.bias.data
        if getattr(m, "dense", None) is not None:
            t[f"{key}.dense"] = m.dense

    def tensor(self, key: str, build) -> torch.Tensor:
        if self.hit and key in self.tensors:
            return self.tensors[key]
        self.tensors[key] = t = build()
        return t

    def intact(self) -> bool:
        """Waits for the check of a cached file: False when it is damaged (then removed, so that
        loading again converts the weights anew), True otherwise."""
        if self._check is None:
            return True
        why, self._check = self._check.wait(), None
        if why is None:
            return True
        log.warning("the conversion cache %s is damaged (%s): converting again", self.path, why)
        self.tensors, self.hit = {}, False
        try:
            self.path.unlink(missing_ok=True)
        except OSError as e:  # else loading again would read it again
            raise ModelLoadError(f"the conversion cache {self.path} is damaged ({why}) and cannot be "
                                 f"removed: {e}") from None
        return False

    def save(self) -> None:
        """Write the converted tensors (nothing on a hit) in a thread of this process, so that the
        first answer does not wait for ~1 GB to reach the disk (1.3-2.3 s of a 1B file's 3.9-5 s
        first load here); not a daemon, so the process exits once the file is complete
        (`localllm run` after printing its answer)."""
        if self.hit:
            return
        writer = threading.Thread(target=self._write, name=f"localllm-cache-{self.stem}")
        ConvertCache._writing[self.path] = writer
        writer.start()

    def _write(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            cache_file.remove_orphans(self.path.parent, f"{self.stem}-")
            cache_file.save(self.tensors, self.path)
            for old in self.path.parent.glob(f"{self.stem}-*.safetensors"):  # stale versions of this file
                if old != self.path:
                    old.unlink(missing_ok=True)
        except OSError:  # a read-only home: convert every time
            pass
        finally:
            if ConvertCache._writing.get(self.path) is threading.current_thread():
                del ConvertCache._writing[self.path]

    @staticmethod
    def wait_written(path: Path | None = None) -> None:
        """Wait for this process's background write of the cache file `path` (of every one: None)."""
        for p, writer in list(ConvertCache._writing.items()):
            if path is None or p == path:
                writer.join()

