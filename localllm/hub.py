"""Hugging Face hub downloads into the standard HF cache (via huggingface_hub).

huggingface_hub answers the questions (which commit, which files, which errors) and owns the cache
layout; we fetch the bytes ourselves with its `http_get` into a *stable* `blobs/<etag>.incomplete`
file, because huggingface_hub >= 1.x writes to a per-process temporary name and deletes it on
failure: a Ctrl-C or a killed process would lose everything. Ours survives both, and the next pull
resumes it with a Range request. We then link the finished blob into `snapshots/<commit>/`
ourselves, from the one HEAD answer we checked (hf_hub_download would ask the hub again and trust
whatever came back).

Every name the hub (or an HF_ENDPOINT mirror) sends becomes a path here: the commit a snapshot
folder, the ETag a blob, each listed file a link. A hostile mirror can send `../../x` for any of
them, so each is checked before it touches the disk (hex digests for commits and blobs, plain
relative names for files) and a pull that meets a bad one writes nothing at all.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .gguf_names import shard_names
from .paths import safe_relative_name
from .registry import ModelRef, ModelSpec

# just what a safetensors checkpoint needs: never *.bin / *.pth pickles
ALLOW_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                  "quant_config.json", "quantize_config.json",
                  # a vision model's image processor (transformers 5 writes processor_config.json)
                  "preprocessor_config.json", "processor_config.json",
                  # an embedding model's pooling, normalisation and input length (sentence-transformers)
                  "modules.json", "sentence_bert_config.json", "*Pooling/config.json"]
QUANTS = ("auto", "bf16", "awq", "gptq", "gguf")
SUPPORTED = "supported: safetensors (bf16/fp16/fp32), AWQ or GPTQ int4 safetensors, gpt-oss MXFP4 safetensors, GGUF"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_BLOB = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})$")  # the hub's ETags: git sha1, or sha256 for LFS files


class HubError(RuntimeError):
    """A download failed for a reason the user can act on."""


# ---- where things are (read at call time, so HF_HOME / HF_ENDPOINT set later still count) -----
def hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def offline() -> bool:
    v = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return v.strip().upper() in ("1", "ON", "YES", "TRUE")


def repo_dir(repo: str) -> Path:
    return hub_cache() / ("models--" + repo.replace("/", "--"))


# ---- names the hub sends, checked before they become paths --------------------------------------
def _shown(value: object) -> str:
    """A server-sent value in an error message: repr (one line, control characters escaped), cut short."""
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def check_commit(value: object, repo: str) -> str:
    """The commit the hub named for a revision: 40 hex digits (it names snapshots/<commit>)."""
    if not isinstance(value, str) or not _COMMIT.match(value):
        raise HubError(f"{repo}: the hub sent an invalid commit {_shown(value)} (expected 40 hex digits); "
                       "nothing was written")
    return value


def check_etag(value: object, repo: str, filename: str) -> str:
    """A file's ETag: a hex digest (it names blobs/<etag>)."""
    if not isinstance(value, str) or not _BLOB.match(value):
        raise HubError(f"{repo}/{filename}: the hub sent an invalid ETag {_shown(value)} (expected a sha1 or "
                       "sha256 hex digest); nothing was written")
    return value


def check_filename(value: object, repo: str) -> str:
    """A file name from the repo's listing: a relative path inside the snapshot folder."""
    if not safe_relative_name(value):
        raise HubError(f"{repo}: the hub listed an unsafe file name {_shown(value)} (absolute, '..', backslash "
                       "or control character); nothing was written")
    return value  # type: ignore[return-value]


def check_revision(revision: str) -> str:
    """A branch or tag is written as refs/<revision> ('refs/pr/1' is one): it must stay in refs/."""
    if not safe_relative_name(revision):
        raise HubError(f"invalid revision {_shown(revision)}: a branch, tag or commit name cannot be absolute or "
                       "contain '..', a backslash or control characters")
    return revision


# ---- variants ---------------------------------------------------------------------------------
@dataclass
class Variant:
    """One downloadable form of a model: a repo, and for GGUF the one file in it (and its mmproj, the
    vision tower llama.cpp keeps in a second file of the same repo: pulled beside it)."""

    repo: str
    revision: str = "main"
    filename: str | None = None
    kind: str = "bf16"  # bf16 | awq | gptq | gguf
    mmproj: str | None = None


def variant_for(ref: ModelRef, quant: str = "auto", revision: str | None = None) -> Variant:
    """The repo (and file) `pull --quant` means for a MODEL argument."""
    if quant not in QUANTS:
        raise HubError(f"--quant must be one of {', '.join(QUANTS)}, got {quant!r}")
    if ref.repo is None:
        raise HubError(f"{ref.name} is a local file or directory: there is nothing to pull")
    spec, rev = ref.spec, revision or ref.revision
    if spec is not None and spec.file:  # a GGUF entry: its file (and mmproj) is its one form
        if quant not in ("auto", "gguf"):
            raise HubError(f"{spec.name} is a GGUF entry ({spec.repo}/{spec.file}): it has no {quant.upper()} variant")
        return Variant(ref.repo, rev, spec.file, "gguf", spec.mmproj)
    if quant in ("auto", "bf16"):
        return Variant(ref.repo, rev, None, "bf16")
    if spec is None:
        raise HubError(f"{ref.repo} is not in models.toml, so its {quant.upper()} variant is unknown: "
                       "pass the variant's repo id instead (e.g. org/name-AWQ)")
    if quant == "gguf":
        if not (spec.gguf_repo and spec.gguf_file):
            raise HubError(f"{spec.name} has no GGUF variant in models.toml")
        return Variant(spec.gguf_repo, revision or "main", spec.gguf_file, "gguf", spec.gguf_mmproj)
    repo = getattr(spec, quant)
    if not repo:
        known = [k for k in ("awq", "gptq") if getattr(spec, k)] + (["gguf"] if spec.gguf_repo else [])
        raise HubError(f"{spec.name} has no {quant.upper()} variant in models.toml "
                       f"(variants: {', '.join(['bf16', *known])})")
    return Variant(repo, revision or "main", None, quant)


def spec_variants(spec: ModelSpec) -> list[Variant]:
    """The forms of a registry entry, its own first (a GGUF entry's file and mmproj, or the
    safetensors repo)."""
    out = [Variant(spec.repo, spec.revision, spec.file, "gguf" if spec.file else "bf16", spec.mmproj)]
    out += [Variant(getattr(spec, k), "main", None, k) for k in ("awq", "gptq") if getattr(spec, k)]
    if spec.gguf_repo and spec.gguf_file:
        out.append(Variant(spec.gguf_repo, "main", spec.gguf_file, "gguf", spec.gguf_mmproj))
    return out


# ---- the cache --------------------------------------------------------------------------------
def _commit_for(repo: str, revision: str) -> str | None:
    if _COMMIT.match(revision):
        return revision
    if not safe_relative_name(revision):
        return None
    ref = repo_dir(repo) / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else None
    return commit if commit and _COMMIT.match(commit) else None  # a damaged ref: not cached, pull again


def snapshot_complete(path: Path, filename: str | None = None, mmproj: str | None = None) -> bool:
    """Does a snapshot folder hold a loadable model (not half of a pull)? A GGUF with an mmproj:
    both files (without it the model would load text-only)."""
    if filename:
        return all((path / f).is_file() for f in shard_names(filename)) and (mmproj is None or (path / mmproj).is_file())
    if not (path / "config.json").is_file():
        return False
    index = path / "model.safetensors.index.json"
    if index.is_file():
        import json

        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, AttributeError):
            return False
        return all(safe_relative_name(s) and (path / s).is_file() for s in shards)
    return any(path.glob("*.safetensors"))


def cached_snapshot(repo: str, revision: str = "main", filename: str | None = None,
                    mmproj: str | None = None) -> Path | None:
    """The complete local snapshot of `repo@revision` (or of its one `filename`, with its `mmproj`),
    else None."""
    commit = _commit_for(repo, revision)
    if commit is None:
        return None
    path = repo_dir(repo) / "snapshots" / commit
    return path if snapshot_complete(path, filename, mmproj) else None


# ---- progress: per-file bars on stderr, only on a terminal ------------------------------------
def progress_enabled() -> bool:
    off = os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    return sys.stderr.isatty() and not off


class _Bar:
    """The tqdm-like object huggingface_hub's http_get updates, drawn as a rich progress task."""

    def __init__(self, progress, desc: str, total: int | None, initial: int):
        self.progress = progress
        self.task = progress.add_task(desc, total=total, completed=initial) if progress is not None else None

    def update(self, n: int | float | None = 1) -> None:
        if self.task is not None:
            self.progress.update(self.task, advance=n or 0)

    def close(self) -> None:
        pass


def _progress():
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=Console(stderr=True), transient=False)


# ---- pull -------------------------------------------------------------------------------------
@dataclass
class PullResult:
    repo: str
    revision: str
    commit: str | None
    path: Path  # the snapshot folder (or, for a GGUF variant, the .gguf file)
    files: list[str] = field(default_factory=list)
    total_bytes: int = 0
    downloaded_files: int = 0
    downloaded_bytes: int = 0
    resumed_bytes: int = 0
    seconds: float = 0.0

    @property
    def up_to_date(self) -> bool:
        return self.downloaded_files == 0

    def summary(self) -> str:
        what = f"{self.repo}" + (f"@{self.revision}" if self.revision != "main" else "")
        size = f"{len(self.files)} file{'s' * (len(self.files) != 1)}, {human_bytes(self.total_bytes)}"
        if self.up_to_date:
            return f"{what} is up to date ({size}) -> {self.path}"
        rate = self.downloaded_bytes / self.seconds if self.seconds > 0 else 0.0
        resumed = f", resumed {human_bytes(self.resumed_bytes)}" if self.resumed_bytes else ""
        return (f"pulled {what} ({size}; downloaded {human_bytes(self.downloaded_bytes)} in "
                f"{self.seconds:.1f} s, {human_bytes(rate)}/s{resumed}) -> {self.path}")


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def select_files(repo: str, names: list[str], filename: str | None = None, mmproj: str | None = None) -> list[str]:
    """The files of `repo` that a variant needs, or a HubError naming what the repo has instead."""
    if filename is not None:
        wanted = [*shard_names(filename), *([mmproj] if mmproj else [])]  # a split GGUF: every shard
        for f in wanted:
            if f not in names:
                ggufs = [n for n in names if n.endswith(".gguf")]
                raise HubError(f"{repo} has no file {f!r}" + (f" (GGUF files: {', '.join(ggufs[:6])})"
                                                              if ggufs else ""))
        return wanted
    # the checkpoint's own files sit at the top (gpt-oss's repos keep their original weights, as big,
    # under original/); a pattern naming a folder (sentence-transformers' pooling) reaches into it
    chosen = [n for n in names if any(fnmatch.fnmatch(n, p) and ("/" not in n or "/" in p) for p in ALLOW_PATTERNS)]
    if not any(n.endswith(".safetensors") for n in chosen):
        found = sorted({Path(n).suffix or n for n in names if n.endswith((".bin", ".pth", ".pt", ".gguf", ".ckpt",
                                                                          ".h5", ".msgpack", ".onnx"))})
        has = f"it has {', '.join(found)} weights" if found else "it has no weight files"
        hint = " (for GGUF, use `--quant gguf` with a models.toml alias or pass a local .gguf file)" \
            if ".gguf" in found else ""
        raise HubError(f"{repo} has no supported weight format: {has}; {SUPPORTED}{hint}")
    if "config.json" not in chosen:
        raise HubError(f"{repo} has no config.json: not a transformers checkpoint ({SUPPORTED})")
    return sorted(chosen)


def _map_error(e: Exception, repo: str, revision: str) -> HubError | None:
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(e, GatedRepoError):
        return HubError(f"{repo} is gated: accept the license at {endpoint()}/{repo}, then set HF_TOKEN "
                        "to a token of that account")
    if isinstance(e, RepositoryNotFoundError):
        return HubError(f"model repo {repo!r} was not found on the Hugging Face hub (check the name; "
                        "a private repo needs HF_TOKEN)")
    if isinstance(e, RevisionNotFoundError):
        return HubError(f"{repo}: revision {revision!r} not found")
    if isinstance(e, EntryNotFoundError):
        return HubError(f"{repo}: file not found ({e.__class__.__name__})")
    if isinstance(e, (OfflineModeIsEnabled, LocalEntryNotFoundError)):
        return HubError(f"{repo} is not in the local cache and offline mode is on (HF_HUB_OFFLINE=1)")
    if isinstance(e, HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", "?")
        return HubError(f"{repo}: the hub answered HTTP {status}: {str(e).splitlines()[0]}")
    network = type(e).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3")
    if network or isinstance(e, OSError):
        return HubError(f"cannot download {repo} from {endpoint()} ({e.__class__.__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else 'no details'}) and it is not in the local cache")
    return None


def pull(repo: str, revision: str = "main", filename: str | None = None, progress: bool | None = None,
         bars=None, mmproj: str | None = None) -> PullResult:
    """Make `repo@revision` (all files a safetensors checkpoint needs, or the one GGUF `filename`
    and its `mmproj` beside it) complete in the HF cache. Downloads only what is missing; resumes
    partial files. `bars`: an object with rich Progress's start/stop/add_task/update to report
    bytes to (the server's /api/pull) instead of the terminal."""
    t0 = time.perf_counter()
    if mmproj is not None and filename is None:
        raise HubError(f"{repo}: an mmproj file goes with a GGUF file")
    if offline():
        path = cached_snapshot(repo, revision, filename, mmproj)
        if path is None:
            raise HubError(f"{repo} is not in the local cache and offline mode is on (HF_HUB_OFFLINE=1); "
                           "pull it once while online")
        files = [*shard_names(filename), *([mmproj] if mmproj else [])] if filename else \
            sorted(p.name for p in path.iterdir())
        size = sum((path / f).stat().st_size for f in files)
        return PullResult(repo, revision, path.name, path / filename if filename else path, files, size)
    try:
        return _pull_online(repo, revision, filename, progress_enabled() if progress is None else progress, t0,
                            bars, mmproj)
    except HubError:
        raise
    except Exception as e:
        mapped = _map_error(e, repo, revision)
        if mapped is None:
            raise
        raise mapped from None


def _pull_online(repo: str, revision: str, filename: str | None, show: bool, t0: float, sink=None,
                 mmproj: str | None = None) -> PullResult:
    from huggingface_hub import HfApi

    check_revision(revision)
    info = HfApi(endpoint=endpoint()).model_info(repo, revision=revision, files_metadata=True)
    commit = check_commit(info.sha, repo)
    sizes = {s.rfilename: (s.size or 0) for s in (info.siblings or [])}
    # every name the hub lists is checked, the ones not taken too: a hostile listing is refused whole
    files = select_files(repo, [check_filename(f, repo) for f in sizes], filename, mmproj)
    snap = repo_dir(repo) / "snapshots" / commit
    todo = [f for f in files if not (snap / f).exists()]
    metas = {f: _file_meta(repo, f, commit) for f in todo}  # every name checked before a byte is written
    result = PullResult(repo, revision, commit, snap / filename if filename else snap, files,
                        sum(sizes[f] for f in files))
    bars = sink if sink is not None else _progress() if show and todo else None
    if bars is not None:
        bars.start()
    try:
        for f in todo:
            got, resumed = _fetch_blob(repo, f, metas[f], bars)
            result.downloaded_files += 1
            result.downloaded_bytes += got
            result.resumed_bytes += resumed
    finally:
        if bars is not None:
            bars.stop()
    for f in todo:
        _link(repo_dir(repo) / "blobs" / metas[f].etag, snap, f)
    if revision != commit:
        refs = repo_dir(repo) / "refs"
        (refs / revision).parent.mkdir(parents=True, exist_ok=True)
        (refs / revision).write_text(commit)
    result.seconds = time.perf_counter() - t0
    return result


def _file_meta(repo: str, filename: str, commit: str):
    """The hub's HEAD answer for one file at `commit`, its ETag, commit and location checked."""
    from urllib.parse import urlparse

    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    url = hf_hub_url(repo, filename, revision=commit, endpoint=endpoint())
    meta = get_hf_file_metadata(url)
    if not meta.etag:
        raise HubError(f"{repo}/{filename}: the hub sent no ETag")
    check_etag(meta.etag, repo, filename)
    if meta.commit_hash is not None and meta.commit_hash != commit:
        raise HubError(f"{repo}/{filename}: asked for commit {commit}, the hub answered for "
                       f"{_shown(meta.commit_hash)}; nothing was written")
    if urlparse(meta.location).scheme not in ("http", "https"):
        raise HubError(f"{repo}/{filename}: the hub redirected to {_shown(meta.location)}, not an http(s) URL; "
                       "nothing was written")
    return meta


def _link(blob: Path, snap: Path, filename: str) -> None:
    """snapshots/<commit>/<filename> -> the blob, as huggingface_hub lays it out (a relative symlink;
    a copy where the file system has none). Made under a temporary name and renamed: never half a link."""
    pointer = snap / filename
    # check_filename refused this already; a second, lexical check (abspath: a link may be dangling)
    if Path(os.path.abspath(snap)) not in Path(os.path.abspath(pointer)).parents:
        raise HubError(f"refusing to write {pointer}: outside {snap}")
    pointer.parent.mkdir(parents=True, exist_ok=True)
    tmp = pointer.with_name(f".{pointer.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), tmp)
    except OSError:
        import shutil

        shutil.copyfile(blob, tmp)
    os.replace(tmp, pointer)


def _fetch_blob(repo: str, filename: str, meta, bars) -> tuple[int, int]:
    """Download one file into blobs/<etag>, resuming blobs/<etag>.incomplete. -> (bytes fetched now,
    bytes that were already there)."""
    from urllib.parse import urlparse

    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    etag = check_etag(meta.etag, repo, filename)
    blobs = repo_dir(repo) / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    blob = blobs / etag
    if blob.exists():
        return 0, 0
    partial = blobs / f"{etag}.incomplete"
    lock = hub_cache() / ".locks" / repo_dir(repo).name / f"{etag}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(str(lock)):
        if blob.exists():  # another process finished it while we waited
            return 0, 0
        have = partial.stat().st_size if partial.exists() else 0
        if meta.size is not None and have > meta.size:
            partial.unlink()
            have = 0
        headers = build_hf_headers()
        if urlparse(meta.location).netloc != urlparse(endpoint()).netloc:
            headers.pop("authorization", None)  # a signed CDN url: never send the token there
        bar = _Bar(bars, filename, meta.size, have)
        with open(partial, "ab") as fh:
            http_get(meta.location, fh, resume_size=have, headers=headers, expected_size=meta.size,
                     displayed_filename=filename, _tqdm_bar=bar)
        size = partial.stat().st_size
        if _SHA256.match(etag):  # LFS files: the ETag is the content's sha256; check the resumed whole
            h = hashlib.sha256()
            with open(partial, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    h.update(chunk)
            if h.hexdigest() != etag:
                partial.unlink()
                raise HubError(f"{repo}/{filename}: checksum mismatch after download (partial file removed; "
                               "pull again)")
        os.replace(partial, blob)
    return size - have, have


def download(repo: str, revision: str = "main", filename: str | None = None, mmproj: str | None = None) -> Path:
    """Pull and tell the user on stderr (used when run/chat/serve need a model that is not here)."""
    result = pull(repo, revision, filename, mmproj=mmproj)
    if not result.up_to_date:
        print(result.summary(), file=sys.stderr)
    return result.path


def ensure_local(ref: ModelRef) -> Path:
    """Local path of a model, downloading it first if needed. A registry model uses whichever of its
    variants is already downloaded before it downloads the base repo."""
    if ref.local_path is not None:
        return ref.local_path
    assert ref.repo is not None
    candidates = spec_variants(ref.spec) if ref.spec is not None else [Variant(ref.repo, ref.revision)]
    candidates[0].revision = ref.revision
    for v in candidates:
        path = cached_snapshot(v.repo, v.revision, v.filename, v.mmproj)
        if path is not None:
            return path / v.filename if v.filename else path
    own = candidates[0]
    return download(ref.repo, ref.revision, own.filename, own.mmproj)
