"""models.toml -> ModelSpec, and MODEL arguments -> what to load."""

from __future__ import annotations

import difflib
import logging
import os
import re
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REGISTRY_PATH = Path(__file__).resolve().parent.parent / "models.toml"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
REPO_ID_MAX = 96  # the hub's limit on "org/name" (huggingface_hub's validate_repo_id)


def is_repo_id(name: str) -> bool:
    return len(name) <= REPO_ID_MAX and bool(_REPO_ID.match(name))


def local_path(name: str) -> Path | None:
    """`name` as an existing file or directory, else None. A name no file system can hold (longer
    than a file name may be, a NUL byte, an unknown ~user) names no path: it is never an OSError."""
    try:
        p = Path(name).expanduser()
        return p if p.exists() else None
    except (OSError, ValueError, RuntimeError):
        return None


def _shown(name: str) -> str:
    """A name as an error message quotes it: a deep path stays whole, a 10,000-character prompt taken for one is cut."""
    return repr(name) if len(name) <= 200 else repr(name[:160]) + f"... ({len(name)} characters)"


class UnknownModelError(ValueError):
    def __init__(self, name: str, suggestions: list[str], why: str = ""):
        hint = f"; did you mean: {', '.join(suggestions)}?" if suggestions else ""
        super().__init__(f"unknown model {_shown(name)}{f' ({why})' if why else ''}{hint} (see `localllm list`; a hub repo id 'org/name', "
                         "a local model directory or a .gguf file also work)")
        self.name, self.suggestions = name, suggestions


@dataclass
class ModelSpec:
    name: str
    repo: str
    revision: str = "main"
    family: str = ""
    context: int | None = None
    params: int | None = None
    aliases: list[str] = field(default_factory=list)
    draft: str | None = None
    embedded: str | None = None
    awq: str | None = None
    gptq: str | None = None
    gguf_repo: str | None = None
    gguf_file: str | None = None
    gguf_mmproj: str | None = None  # the GGUF variant's mmproj (vision tower), in the same repo: pulled with it
    file: str | None = None  # an entry whose repo is a GGUF repo: the GGUF file it loads (no safetensors form)
    mmproj: str | None = None  # ... and that file's mmproj beside it
    vision_params: int = 0  # the vision tower + projector's parameters, for the planner before download
    kind: str = "generate"  # "embedding" | "rerank": what the model is for (the server's capability check)

    def embedded_path(self) -> Path | None:
        """The model shipped inside an installed package, located without importing it: its GGUF,
        or the folder its zipped model directory is unpacked to (once, in the model store)."""
        if not self.embedded:
            return None
        from .embedded import package_file, unpacked

        path = package_file(self.embedded)
        if path is None or path.suffix != ".zip":
            return path
        try:
            return unpacked(path, self.name)
        except (OSError, ValueError, zipfile.BadZipFile) as e:  # the hub's copy is still there to fetch
            logging.getLogger("localllm").warning("warning: cannot unpack the embedded %s (%s)", self.name, e)
            return None


@dataclass
class Registry:
    models: dict[str, ModelSpec]
    default: str
    default_embedding: str = "all-minilm"  # `localllm embed` without MODEL

    def lookup(self, name: str) -> ModelSpec | None:
        key = name.lower()
        for spec in self.models.values():
            if key == spec.name.lower() or key in (a.lower() for a in spec.aliases) or key == spec.repo.lower():
                return spec
        return None

    def names(self) -> list[str]:
        return [n for s in self.models.values() for n in [s.name, *s.aliases]]

    def suggest(self, name: str) -> list[str]:
        names = self.names()
        close = difflib.get_close_matches(name.lower(), names, n=3, cutoff=0.5)
        return close or [n for n in names if name.lower() in n][:3]


def load_registry(path: str | os.PathLike | None = None) -> Registry:
    path = Path(path or os.environ.get("LOCALLLM_MODELS") or REGISTRY_PATH)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"model registry {path} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"model registry {path}: {e}") from None
    models = {}
    for name, d in data.get("models", {}).items():
        if d.get("mmproj") and not d.get("file"):
            raise ValueError(f"model registry {path}: {name}: mmproj goes with file (the GGUF it belongs to)")
        v = d.get("variants", {})
        gguf = v.get("gguf") or {}
        models[name] = ModelSpec(
            name=name, repo=d["repo"], revision=d.get("revision", "main"), family=d.get("family", ""),
            context=d.get("context"), params=d.get("params"), aliases=list(d.get("aliases", [])),
            draft=d.get("draft"), embedded=d.get("embedded"), awq=v.get("awq"), gptq=v.get("gptq"),
            gguf_repo=gguf.get("repo"), gguf_file=gguf.get("file"), gguf_mmproj=gguf.get("mmproj"),
            vision_params=int(d.get("vision_params", 0)), file=d.get("file"), mmproj=d.get("mmproj"),
            kind=d.get("kind", "generate"),
        )
    return Registry(models, data.get("default", next(iter(models), "")), data.get("default_embedding", "all-minilm"))


@dataclass
class ModelRef:
    """What a MODEL argument names: a local file/dir to load, or a hub repo to fetch first."""

    name: str
    local_path: Path | None = None
    repo: str | None = None
    revision: str = "main"
    spec: ModelSpec | None = None


def looks_like_model(arg: str, registry: Registry) -> bool:
    """For `run [MODEL] [PROMPT...]`: is the first word meant as a model name?"""
    if registry.lookup(arg) or is_repo_id(arg) or arg.endswith(".gguf"):
        return True
    p = local_path(arg)
    return p is not None and p.is_dir() and (p / "config.json").is_file()


class InvalidModelName(ValueError):
    """A name that is no model name (a path, say) where only names are taken (the HTTP API)."""


def _spec_ref(spec: ModelSpec) -> ModelRef:
    embedded = spec.embedded_path()
    if embedded is not None:
        return ModelRef(spec.name, local_path=embedded, repo=spec.repo, revision=spec.revision, spec=spec)
    return ModelRef(spec.name, repo=spec.repo, revision=spec.revision, spec=spec)


def resolve_model(name: str | None, registry: Registry | None = None) -> ModelRef:
    registry = registry or load_registry()
    name = name or registry.default
    p = local_path(name)
    if p is not None and (p.is_file() or (p / "config.json").is_file()):
        return ModelRef(name, local_path=p.resolve())
    spec = registry.lookup(name)
    if spec is not None:
        return _spec_ref(spec)
    if is_repo_id(name) and p is None:
        return ModelRef(name, repo=name)
    if p is not None and p.is_dir():
        raise UnknownModelError(name, [], "a directory without config.json")
    if name.endswith(".gguf") or os.sep in name:
        raise UnknownModelError(name, [], "no such file or directory")
    raise UnknownModelError(name, registry.suggest(name))


def resolve_name(name: str, registry: Registry | None = None) -> ModelRef:
    """A model *name* (registry name or alias, or a hub repo id org/name) -> ModelRef, without
    looking at the disk: what a name sent over HTTP may be. A path there would let any client
    learn which files exist on the server (its answer would differ), so it is an
    InvalidModelName whether or not the file is there; other unknown names are UnknownModelError."""
    registry = registry or load_registry()
    spec = registry.lookup(name)
    if spec is not None:
        return _spec_ref(spec)
    if is_repo_id(name):
        return ModelRef(name, repo=name)
    if name.startswith(("/", ".", "~")) or any(c in name for c in "/\\\0") or name.endswith(".gguf"):
        raise InvalidModelName(f"invalid model name {_shown(name)}: a registry name (see `localllm list`) or a hub "
                               "repo id 'org/name', never a path")
    raise UnknownModelError(name, registry.suggest(name))
