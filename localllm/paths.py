"""Where localllm keeps its own files. Environment variables name locations only:
LOCALLLM_HOME puts everything (compiled packages, conversion caches, kernel libraries, chat
history) under one folder (LOCALLLM_KERNEL_CACHE moves the kernel libraries alone); otherwise caches go to $XDG_CACHE_HOME/localllm (~/.cache/localllm) and the chat
history to ~/.local/share/localllm."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    home = os.environ.get("LOCALLLM_HOME")
    if home:
        return Path(home).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "localllm"


def data_home() -> Path:
    home = os.environ.get("LOCALLLM_HOME")
    return Path(home).expanduser() if home else Path("~/.local/share/localllm").expanduser()


def safe_relative_name(name: object) -> bool:
    """Is `name` (a file name a hub repo or an index lists) a plain relative path that stays inside
    the folder it is joined to? No absolute path, no `..` or `.` or empty component, no backslash
    (a separator on Windows), no NUL or other control character."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name:
        return False
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))
