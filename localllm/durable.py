"""Putting a finished cache file in place so that a crash or power cut never leaves a damaged one
under the real name: the data is fsynced before the rename, the folder after it. Without the
first, a crash soon after the rename can leave the new name holding zeros (the rename reached the
disk, the data did not); without the second, the rename itself can be lost."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Best effort: some filesystems (and Windows) cannot fsync a folder."""
    try:
        fsync_file(path)
    except OSError:
        pass


def publish(tmp: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename the fully written file `tmp` to `dst` durably (same folder)."""
    fsync_file(tmp)
    os.replace(tmp, dst)
    fsync_dir(Path(dst).parent)
