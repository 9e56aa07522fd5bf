"""The file names of a split GGUF's shards, as llama.cpp's gguf-split and gguf-py's writer name
them: NAME-00001-of-00003.gguf, NAME-00002-of-00003.gguf, ... (the hub's big GGUFs come so)."""

from __future__ import annotations

import re

_SHARD = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_of(name: str) -> tuple[int, int] | None:
    """(shard number from 1, shard count) that a file name says, or None."""
    m = _SHARD.match(name)
    return (int(m["no"]), int(m["count"])) if m else None


def shard_names(name: str, count: int | None = None) -> list[str]:
    """Every shard's name, the first first, for any shard's `name` (`count`: how many there are,
    when the caller knows better than the name); [name] for a name outside the pattern."""
    m = _SHARD.match(name)
    if m is None:
        return [name]
    n = count or int(m["count"])
    return [f"{m['prefix']}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
