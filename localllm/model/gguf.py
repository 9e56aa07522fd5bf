"""A fast GGUF reader: metadata, tensor index and zero-copy tensor views over an mmap.

gguf's own GGUFReader spends ~2.6 s parsing the 49k-entry vocab arrays element by
element; this parser reads the same header in ~0.1 s, which is most of our cold start.
We still use the `gguf` package for the quantization type table and dequantizers.
"""

from __future__ import annotations

import array
import ctypes
import functools
import operator
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch

GGUF_MAGIC = b"GGUF"


class QType(NamedTuple):
    """A ggml tensor type: id, name, elements per block, bytes per block."""

    id: int
    name: str
    block: int
    type_size: int


# The GGUF spec's table for the common types. Importing the gguf package for it would cost
# ~70 ms of every cold start; rarer types are looked up there (tests check this table against it).
_QTYPES = {q.id: q for q in (
    QType(0, "F32", 1, 4), QType(1, "F16", 1, 2), QType(2, "Q4_0", 32, 18), QType(3, "Q4_1", 32, 20),
    QType(6, "Q5_0", 32, 22), QType(7, "Q5_1", 32, 24), QType(8, "Q8_0", 32, 34), QType(9, "Q8_1", 32, 40),
    QType(10, "Q2_K", 256, 84), QType(11, "Q3_K", 256, 110), QType(12, "Q4_K", 256, 144),
    QType(13, "Q5_K", 256, 176), QType(14, "Q6_K", 256, 210), QType(15, "Q8_K", 256, 292),
    QType(30, "BF16", 1, 2), QType(39, "MXFP4", 32, 17),
)}


def qtype(type_id: int) -> QType:
    if type_id in _QTYPES:
        return _QTYPES[type_id]
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    qt = GGMLQuantizationType(type_id)  # ValueError for ids gguf does not know either
    return QType(type_id, qt.name, *GGML_QUANT_SIZES[qt])

# value type id -> (struct format, size) for scalar types
_SCALARS = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NP_SCALARS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
               6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file is corrupt, truncated or uses something we do not support."""


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order: rows first (GGUF stores ne0 first)
    qtype: QType
    offset: int  # absolute byte offset in the file
    nbytes: int
    data: np.ndarray = field(repr=False, default=None)  # raw bytes, uint8 memmap view
    path: Path | None = None  # the file it is in (a split GGUF's shard)


@dataclass
class GGUFFile:
    path: Path  # the file named (a split GGUF's first shard)
    metadata: dict  # (a split GGUF's: its first shard's, which holds them all)
    tensors: dict[str, GGUFTensor]
    paths: tuple[Path, ...] = ()  # every file its tensors are in: the path, or a split GGUF's shards

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def read(self, t: GGUFTensor, into: np.ndarray | None = None) -> np.ndarray:
        """A copy of the tensor's bytes (uint8, shaped as `t.data`), read with pread rather than
        through the map: pages touched through the map count in this process's RSS, and each
        fault maps a large neighbourhood (reading the 61 small norms of the 135M model through
        it left 25 MB of unrelated layers mapped). `into`: a uint8 buffer of `t.nbytes` to read
        into (the parts of a fused layer side by side)."""
        buf = np.empty(t.nbytes, dtype=np.uint8) if into is None else into  # writable: torch takes it as is
        if buf.dtype != np.uint8 or buf.size != t.nbytes or not buf.flags.c_contiguous:
            raise ValueError(f"reading {t.name}: a contiguous uint8 buffer of {t.nbytes} bytes is needed")
        view, done = memoryview(buf.reshape(-1)), 0
        with open(t.path or self.path, "rb") as f:
            while done < t.nbytes:  # one read returns at most ~2 GiB
                n = os.preadv(f.fileno(), [view[done:]], t.offset + done)
                if n <= 0:
                    raise GGUFError(f"{t.path or self.path}: truncated file while reading tensor {t.name}")
                done += n
        return buf.reshape(t.data.shape)


class _Cursor:
    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF header (needed {end} bytes, file has {len(self.buf)})")
        out = self.buf[self.pos:end]
        self.pos = end
        return out

    def scalar(self, vtype: int):
        fmt, size = _SCALARS[vtype]
        return struct.unpack(fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.scalar(10)
        if n > 1 << 30:
            raise GGUFError(f"{self.path}: corrupt GGUF header (string of {n} bytes)")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(vtype)
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar(4), self.scalar(10)
            if etype in _NP_SCALARS:
                size = _SCALARS[etype][1]
                return np.frombuffer(self.take(size * count), dtype=_NP_SCALARS[etype]).copy().tolist()
            if etype == _STRING:
                return self._strings(count)
            return [self.value(etype) for _ in range(count)]
        raise GGUFError(f"{self.path}: corrupt GGUF header (unknown value type {vtype})")

    def _strings(self, count: int) -> list[str] | StringArray:
        buf, pos = self.buf, self.pos
        unpack = struct.Struct("<Q").unpack_from
        total = len(buf)
        starts = array.array("q")
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > total:
                raise GGUFError(f"{self.path}: truncated GGUF header inside a string array")
            starts.append(pos)
            pos += n
        self.pos = pos
        out = StringArray(buf, np.frombuffer(starts, dtype=np.int64) if count else np.empty(0, np.int64), pos)
        return out if count >= LAZY_STRINGS else list(out)


# String arrays this long (a vocabulary, its merges) stay in the file's mapping until read.
LAZY_STRINGS = 1024


class StringArray(Sequence):
    """A GGUF string array read from the file's mapping when used. The tokenizer reads a
    vocabulary and its merges once, when it is built; decoded at parse time and held by the
    cached header, their 10^5 Python strings would stay for the process's life (8 MB for a 49k
    vocabulary, ~25 MB for a 128k one with its merges). Kept: each string's start (8 bytes)."""

    def __init__(self, buf: memoryview, starts: np.ndarray, end: int):
        self._buf, self._starts, self._end = buf, starts, end

    def __len__(self) -> int:
        return len(self._starts)

    def _ends(self) -> np.ndarray:
        return np.append(self._starts[1:] - 8, self._end)  # each string ends where the next one's length begins

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = operator.index(i)
        n = len(self)
        if not -n <= i < n:
            raise IndexError("string array index out of range")
        i %= n
        start = int(self._starts[i])
        end = int(self._starts[i + 1]) - 8 if i + 1 < n else self._end
        return str(self._buf[start:end], "utf-8", "replace")

    def __iter__(self):
        if not len(self):
            return iter(())
        base = int(self._starts[0])
        region = bytes(self._buf[base:self._end])  # one copy: slicing bytes is 2x faster than the map
        return (str(region[a:b], "utf-8", "replace")
                for a, b in zip((self._starts - base).tolist(), (self._ends() - base).tolist()))

    def index(self, value, start: int = 0, stop: int | None = None) -> int:
        """Found in the raw bytes (its length, then its UTF-8), not by decoding every string."""
        if not isinstance(value, str) or "\ufffd" in value or not len(self):  # (a replaced byte: decode and compare)
            return super().index(value, start, len(self) if stop is None else stop)
        raw = value.encode("utf-8")
        base = int(self._starts[0]) - 8
        region = bytes(self._buf[base:self._end])
        pattern = struct.pack("<Q", len(raw)) + raw
        pos = region.find(pattern)
        while pos >= 0:
            j = int(np.searchsorted(self._starts, base + pos + 8))
            at_start = j < len(self) and int(self._starts[j]) == base + pos + 8
            if at_start and j >= start and (stop is None or j < stop):
                return j
            pos = region.find(pattern, pos + 1)
        raise ValueError(f"{value!r} is not in the string array")

    def __contains__(self, value) -> bool:
        try:
            self.index(value)
        except ValueError:
            return False
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, tuple, StringArray)) and len(self) == len(other) and list(self) == list(other)

    __hash__ = None

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF file's header and map its tensors (no tensor data is copied). Parsed once
    per process and file version: the planner and the loader both read it, and the header's
    49k tokenizer strings cost ~0.1 s of every cold start. A split GGUF (split.count in its
    header) is named by its first shard and read whole, as llama.cpp reads it: the first shard's
    metadata, every shard's tensors."""
    first = _read_one(Path(path))
    count = int(first.metadata.get("split.count") or 1)
    return first if count <= 1 else _read_split(first, count)


def _read_one(path: Path) -> GGUFFile:
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    st = path.stat()
    return _read_gguf(path, st.st_size, st.st_mtime_ns)


def _read_split(first: GGUFFile, count: int) -> GGUFFile:
    from ..gguf_names import shard_names, shard_of

    path, no = first.path, int(first.metadata.get("split.no") or 0)
    if no != 0:
        name = shard_names(path.name, count)[0] if shard_of(path.name) else "its first shard"
        raise GGUFError(f"{path}: shard {no + 1} of {count} of a split GGUF; pass the first shard ({name}): it "
                        "names the others")
    names = shard_names(path.name, count)
    if len(names) != count:
        raise GGUFError(f"{path}: the first of {count} shards of a split GGUF, but its name does not say where the "
                        f"others are: keep the shards' names as written (NAME-00001-of-{count:05d}.gguf, ...)")
    tensors, paths = dict(first.tensors), [path]
    for i, name in enumerate(names[1:], 1):
        if not path.with_name(name).is_file():
            raise GGUFError(f"{path}: shard {i + 1} of {count} of this split GGUF is missing: "
                            f"{path.with_name(name)} (download every shard into one folder)")
        shard = _read_one(path.with_name(name))
        said = (int(shard.metadata.get("split.no", -1)), int(shard.metadata.get("split.count") or 1))
        if said != (i, count):
            raise GGUFError(f"{shard.path}: its header does not make it shard {i + 1} of {count} of {path.name} "
                            f"(it says shard {said[0] + 1} of {said[1]})")
        twice = sorted(tensors.keys() & shard.tensors.keys())
        if twice:
            raise GGUFError(f"{shard.path}: tensor {twice[0]} is in two shards of {path.name}")
        tensors.update(shard.tensors)
        paths.append(shard.path)
    want = first.metadata.get("split.tensors.count")
    if want is not None and int(want) != len(tensors):
        raise GGUFError(f"{path}: its {count} shards hold {len(tensors)} tensors; the first says {int(want)}")
    return GGUFFile(path, first.metadata, tensors, tuple(paths))


@functools.lru_cache(maxsize=16)
def _read_gguf(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    if size < 24:
        raise GGUFError(f"{path}: not a GGUF file (only {size} bytes)")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm), path)
    if bytes(cur.take(4)) != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (bad magic bytes)")
    version = cur.scalar(4)
    if version not in (2, 3):
        raise GGUFError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
    if n_tensors > 1_000_000 or n_kv > 1_000_000:
        raise GGUFError(f"{path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} keys)")
    try:
        metadata = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar(4)
            dims = [cur.scalar(10) for _ in range(n_dims)]
            type_id, offset = cur.scalar(4), cur.scalar(10)
            infos.append((name, dims, type_id, offset))
    except struct.error as e:
        raise GGUFError(f"{path}: truncated GGUF header ({e})") from None
    align = int(metadata.get("general.alignment", 32))
    data_start = (cur.pos + align - 1) // align * align
    tensors = {}
    for name, dims, type_id, offset in infos:
        try:
            qt = qtype(type_id)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name} has unknown type id {type_id}") from None
        block, type_size = qt.block, qt.type_size
        n_el = int(np.prod(dims)) if dims else 1
        if dims[0] % block:
            raise GGUFError(f"{path}: tensor {name} row length {dims[0]} is not a multiple of {block}")
        nbytes = n_el // block * type_size
        start = data_start + offset
        if start + nbytes > size:
            raise GGUFError(
                f"{path}: truncated file: tensor {name} needs bytes {start}..{start + nbytes} "
                f"but the file has {size} bytes"
            )
        rows = n_el // dims[0]
        raw = mm[start:start + nbytes].reshape(rows, -1)
        tensors[name] = GGUFTensor(name, tuple(reversed(dims)), qt, start, nbytes, raw, path)
    return GGUFFile(path, metadata, tensors, (path,))


def dequantize(t: GGUFTensor, raw: np.ndarray | None = None) -> np.ndarray:
    """Dequantize a tensor to float32 with its torch shape; `raw`: its bytes (default: the map)."""
    raw = np.asarray(t.data) if raw is None else raw
    if t.qtype.name == "F32":
        return raw.view(np.float32).reshape(t.shape)
    if t.qtype.name == "F16":
        return raw.view(np.float16).astype(np.float32).reshape(t.shape)
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as _deq

    try:
        out = _deq(raw, GGMLQuantizationType(t.qtype.id))
    except NotImplementedError:
        raise GGUFError(f"tensor {t.name}: quantization type {t.qtype.name} is not supported") from None
    return out.reshape(t.shape).astype(np.float32, copy=False)


def release_pages(view: torch.Tensor) -> None:
    """Drop this process's resident pages of `view` (a tensor over this module's read-only file
    mapping, and nothing else: on anonymous memory MADV_DONTNEED would zero it): the whole
    pages inside it leave the process's RSS and come back from the page cache when read again.
    Read once in full (a first load builds the head's ranking copy from every row) they would stay
    resident while later steps read a few rows. Nothing happens where madvise is unavailable."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    addr, nbytes = view.data_ptr(), view.numel() * view.element_size()
    page = os.sysconf("SC_PAGE_SIZE")
    start, end = -(-addr // page) * page, (addr + nbytes) // page * page
    if end > start:
        madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4)  # MADV_DONTNEED
