"""`localllm list / show / rm`: what is known (models.toml), what is here (embedded or in the HF
cache), what a model is (read from config.json / GGUF metadata and the tokenizer, never the
weights), and freeing the cache of one model."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path

from .gguf_names import shard_names
from .hub import HubError, Variant, cached_snapshot, hub_cache, human_bytes, repo_dir, spec_variants
from .registry import ModelRef, ModelSpec, load_registry, resolve_model

_GGUF_QUANT = re.compile(r"[.\-_](i?q\d\w*|f16|bf16|f32)\.gguf$", re.IGNORECASE)


# ---- list -------------------------------------------------------------------------------------
def _scan() -> dict[str, object]:
    """repo id -> CachedRepoInfo of the models in the HF cache (empty if there is no cache)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(hub_cache())
    except CacheNotFound:
        return {}
    return {r.repo_id: r for r in info.repos if r.repo_type == "model"}


def _latest_snapshot(info) -> Path | None:
    revs = sorted(info.revisions, key=lambda r: r.last_modified, reverse=True)
    return Path(revs[0].snapshot_path) if revs else None


def _kind_of(path: Path | None, unquantized: str = "safetensors") -> str:
    """bf16 / awq / gptq / mxfp4 / gguf of a downloaded snapshot, from its files and config.json."""
    if path is None:
        return "?"
    if any(path.glob("*.gguf")):
        return "gguf"
    try:
        q = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        q = {}
    return str(q.get("quant_method", unquantized)).lower()


def _repo_kind(v: Variant, snapshot: Path | None = None) -> str:
    """A registry variant's form as listed: a model repo published quantized (gpt-oss's MXFP4
    experts) says so, from its files once downloaded, else from the planner's known config."""
    if v.kind != "bf16":
        return v.kind
    if snapshot is not None:
        return _kind_of(snapshot, "bf16")
    from .planner import KNOWN_CONFIGS

    return KNOWN_CONFIGS.get(v.repo.lower(), {}).get("quantization_config", {}).get("quant_method", "bf16")


def disk_size(path: Path) -> int:
    """Bytes of a model on disk: a file (a split GGUF's every shard), or a directory's files."""
    if path.is_file():
        return sum(f.stat().st_size for f in (path.with_name(n) for n in shard_names(path.name)) if f.is_file())
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def list_models() -> list[dict]:
    reg = load_registry()
    cache = _scan()
    rows = []

    def row(name, repo, variant, status, size, path, spec: ModelSpec | None = None):
        return {"name": name, "repo": repo, "variant": variant, "status": status, "size_bytes": size,
                "path": str(path) if path else None, "aliases": list(spec.aliases) if spec else [],
                "kind": spec.kind if spec else None,
                "default": bool(spec) and spec.name == reg.default}

    for spec in reg.models.values():
        mine = []
        emb = spec.embedded_path()
        if emb is not None:
            m = _GGUF_QUANT.search(emb.name)
            variant = "safetensors" if emb.is_dir() else f"gguf-{m.group(1).lower()}" if m else "gguf"
            mine.append(row(spec.name, spec.repo, variant, "embedded", disk_size(emb), emb, spec))
        for v in spec_variants(spec):
            info = cache.pop(v.repo, None)
            if info is not None:
                snap = _latest_snapshot(info)
                mine.append(row(spec.name, v.repo, _repo_kind(v, snap), "downloaded", info.size_on_disk, snap, spec))
        rows += mine or [row(spec.name, spec.repo, _repo_kind(spec_variants(spec)[0]), "available", None, None, spec)]
    for repo_id, info in sorted(cache.items()):
        snap = _latest_snapshot(info)
        rows.append(row(repo_id, repo_id, _kind_of(snap), "downloaded", info.size_on_disk, snap))
    return rows


def format_table(rows: list[dict]) -> str:
    head = ("NAME", "VARIANT", "SIZE", "STATUS", "REPO")
    body = [(r["name"] + (" *" if r["default"] else ""), r["variant"],
             human_bytes(r["size_bytes"]) if r["size_bytes"] is not None else "-", r["status"], r["repo"])
            for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [head, *body]]
    return "\n".join(lines) + "\n(* default model; `localllm pull NAME` downloads an available one)"


# ---- show -------------------------------------------------------------------------------------
def local_path(ref: ModelRef) -> Path | None:
    """Where a model is on disk without downloading anything (embedded, local, or any cached variant)."""
    if ref.local_path is not None:
        return ref.local_path
    variants = spec_variants(ref.spec) if ref.spec is not None else [Variant(ref.repo, ref.revision)]
    for v in variants:
        p = cached_snapshot(v.repo, v.revision, v.filename, v.mmproj)
        if p is not None:
            return p / v.filename if v.filename else p
    return None


def _quantization(weights) -> str:
    from .model.gguf_weights import GGUFWeights

    if isinstance(weights, GGUFWeights):
        kinds = Counter(t.qtype.name for n, t in weights.file.tensors.items() if len(t.shape) > 1)
        return ", ".join(f"{k} ({n} tensors)" for k, n in kinds.most_common())
    q = weights.quant
    if q:
        return f"{q.get('quant_method', '?')} {q.get('bits', '?')}-bit, group {q.get('group_size', '?')}"
    dtypes = {str(v) for v in [weights.raw_config.get("torch_dtype") or weights.raw_config.get("dtype")] if v}
    return ", ".join(sorted(dtypes)) or "unknown"


def _plan(path: Path) -> str:
    """The precision planner's choice for the model at `path` on this machine, with why."""
    from .planner import PlanError, plan_for

    try:
        return plan_for(str(path)).describe()
    except (PlanError, ValueError, OSError) as e:  # metadata the planner cannot read: `show` still answers
        return f"(no plan: {e})"


def _fim_format(tok) -> str | None:
    """The FIM format the tokenizer carries ("qwen (tokenizer special tokens)"), None without one."""
    from .fim import detect

    fmt = detect(tok)
    return f"{fmt.name} ({fmt.source})" if fmt else None


def _vision(weights, path: Path) -> tuple[bool, str | None]:
    """(takes images, the mmproj file that gives a GGUF its vision tower: the one beside it)."""
    from .model.hf_weights import HFWeights
    from .model.vision.load import has_vision

    if isinstance(weights, HFWeights):
        return has_vision(weights.raw_config, weights.has), None
    from .model.vision.mmproj import Mmproj, find_mmproj

    found = find_mmproj(path)
    if found is None:
        return False, None
    Mmproj(found)  # an mmproj we cannot read is an error here as it is at load
    return True, str(found)


def describe(model: str | None, prompt: str | None = None, system: str | None = None) -> dict:
    from .chat import render_chat
    from .model.gguf_weights import GGUFWeights
    from .model.weights import open_weights

    ref = resolve_model(model)
    spec = ref.spec
    info: dict = {"name": ref.name, "repo": ref.repo, "aliases": list(spec.aliases) if spec else [],
                  "embedded": bool(spec and ref.local_path is not None and ref.local_path == spec.embedded_path())}
    path = local_path(ref)
    info["downloaded"] = path is not None
    info["path"] = str(path) if path else None
    if path is None:
        if prompt is not None:
            raise HubError(f"{ref.name} is not downloaded: `localllm pull {ref.name}` first (--prompt needs "
                           "its tokenizer)")
        info.update({"parameters": spec.params if spec else None, "context_length": spec.context if spec else None,
                     "architecture": None, "quantization": None, "chat_template": None, "stop_tokens": [],
                     "vision": bool(spec and spec.vision_params), "vision_params": spec.vision_params if spec else 0})
        return info
    from .model.encoder_loader import describe_encoder, encoder_kind

    if encoder_kind(path):  # an embedding model or a reranker: no chat template, no generation
        info.update(describe_encoder(path), size_bytes=disk_size(path))
        return info
    weights = open_weights(path)  # headers and metadata only: no tensor is read
    cfg = weights.config
    vision, mmproj = _vision(weights, path)
    tok = weights.tokenizer()
    stop_ids = sorted(set(tok.eos_ids) | weights.extra_eos_ids())
    size = disk_size(path)
    info.update({
        "format": "gguf" if isinstance(weights, GGUFWeights) else "safetensors",
        "architecture": cfg.architecture,
        "parameters": cfg.num_params,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "layers": cfg.num_layers,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "vocab_size": cfg.vocab_size,
        "quantization": _quantization(weights),
        "vision": vision,
        "mmproj": mmproj,
        "size_bytes": size,
        "chat_template": {"family": tok.template_name, "source": tok.template_source, "template": tok.chat_template},
        "bos_token": {"id": tok.bos_id, "text": tok.bos_token, "added_to_raw_prompts": tok.add_bos,
                      "added_to_chat_prompts": tok.add_bos and tok.chat_adds_bos},
        "eos_token": {"id": tok.eos_id, "text": tok.eos_token, "added_to_raw_prompts": tok.add_eos},
        "stop_tokens": [{"id": i, "text": tok.id_to_token(i)} for i in stop_ids],
        "fill_in_middle": _fim_format(tok),
        "plan": _plan(path),
    })
    if prompt is not None:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text = render_chat(tok.chat_template, messages, bos_token=tok.bos_token, eos_token=tok.eos_token)
        ids = tok.encode_chat(text)  # exactly what the engine sends
        leading = 0
        while tok.bos_id is not None and leading < len(ids) and ids[leading] == tok.bos_id:
            leading += 1
        info["prompt"] = {"text": text, "token_ids": ids, "num_tokens": len(ids), "leading_bos": leading,
                          "template_has_bos": bool(tok.bos_token) and text.startswith(tok.bos_token)}
    return info


def format_show(info: dict) -> str:
    out = [f"  {'name':<16}{info['name']}"]

    def add(key, value):
        if value not in (None, "", []):  # a value of several lines stays in the value column
            out.append(f"  {key:<16}" + str(value).replace("\n", "\n" + " " * 18))

    add("repo", info.get("repo"))
    if not info["downloaded"]:
        add("parameters", f"{info['parameters']:,}" if info.get("parameters") else None)
        add("context length", info.get("context_length"))
        add("vision", f"images in (a vision tower of {info['vision_params']:,} parameters)"
            if info.get("vision_params") else None)
        out.append(f"  not downloaded: `localllm pull {info['name']}`")
        return "Model\n" + "\n".join(out)
    add("architecture", info["architecture"])
    add("parameters", f"{info['parameters'] / 1e6:.1f}M ({info['parameters']:,})")
    add("context length", info["context_length"])
    add("embedding", info["embedding_length"])
    add("layers", f"{info['layers']} ({info['heads']} heads, {info['kv_heads']} KV heads)")
    add("quantization", info["quantization"])
    add("vision", None if not info.get("vision") else
        f"images in (the vision tower of {info['mmproj']})" if info.get("mmproj") else "images in (a vision tower)")
    add("format", info["format"])
    add("size", human_bytes(info["size_bytes"]))
    add("path", info["path"] + ("  (embedded)" if info["embedded"] else ""))
    add("plan", info.get("plan"))
    if info.get("kind"):  # an encoder: what it is for and how it pools
        add("kind", info["kind"])
        add("pooling", info["pooling"])
        return "Model\n" + "\n".join(out)
    out.append("Chat")
    add("template", f"{info['chat_template']['family']} ({info['chat_template']['source']})")
    bos = info["bos_token"]
    added = " and ".join(w for w, on in (("raw", bos["added_to_raw_prompts"]), ("chat", bos["added_to_chat_prompts"]))
                         if on)
    add("bos", f"{bos['text']!r} (id {bos['id']}; {f'added to {added} prompts' if added else 'not added'})"
        if bos["id"] is not None else "none")
    if info["eos_token"]["added_to_raw_prompts"]:
        add("eos", f"{info['eos_token']['text']!r} (id {info['eos_token']['id']}; added to raw prompts)")
    add("stop tokens", ", ".join(f"{t['text']!r} (id {t['id']})" for t in info["stop_tokens"]))
    add("fill-in-middle", info.get("fill_in_middle"))
    p = info.get("prompt")
    if p is not None:
        out.append("Prompt")
        out += ["    " + line for line in p["text"].splitlines()]
        add("tokens", p["num_tokens"])
        add("token ids", " ".join(map(str, p["token_ids"])))
        add("leading BOS", p["leading_bos"])
    return "Model\n" + "\n".join(out)


# ---- rm ---------------------------------------------------------------------------------------
def _remove_derived(root: Path, model: str) -> list[str]:
    """What localllm made from the model files under `root`: its queued and running builds of
    the compiled step, then its compiled packages. One line per kind removed."""
    from .model.build_queue import remove_jobs
    from .model.compiled import remove_packages

    jobs = remove_jobs(root)
    packages = remove_packages(root)
    lines = [f"stopped and dropped {jobs} queued build{'s' * (jobs != 1)} of {model}"] if jobs else []
    if packages:
        lines.append(f"deleted {packages} compiled package{'s' * (packages != 1)} of {model}")
    exports = _remove_vllm_exports(root)
    if exports:
        lines.append(f"deleted {exports} HF checkpoint{'s' * (exports != 1)} written for vLLM from {model}")
    return lines


def _remove_vllm_exports(root: Path) -> int:
    """The HF checkpoints `serve --engine vllm` wrote from the GGUF files under `root`."""
    from .model.export import hf_checkpoint_dir
    from .paths import cache_home

    cache = cache_home() / "vllm-checkpoints"
    if not cache.is_dir():
        return 0
    files = [root] if root.is_file() else sorted(root.rglob("*.gguf")) if root.is_dir() else []
    n = 0
    for f in files:
        out = hf_checkpoint_dir(f, cache)
        if out.is_dir():
            shutil.rmtree(out)
            n += 1
    return n


def remove(model: str) -> list[str]:
    """Delete every cached revision of the model's repos (all variants of a registry alias).
    Returns one line per repo deleted."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    reg = load_registry()
    spec = reg.lookup(model)
    if spec is not None:
        repos = [v.repo for v in spec_variants(spec)]
    else:
        ref = resolve_model(model, reg)
        if ref.repo is None:
            derived = _remove_derived(ref.local_path, model)
            if not derived:
                raise HubError(f"{model} is a local file or directory, not a downloaded model, and localllm has "
                               "nothing of its own for it (no compiled package, no queued build): delete it yourself")
            return derived + [f"({ref.local_path} itself stays: localllm did not download it)"]
        repos = [ref.repo]
    try:
        scan = scan_cache_dir(hub_cache())
        cached = [r for r in scan.repos if r.repo_type == "model" and r.repo_id in repos]
    except CacheNotFound:
        scan, cached = None, []
    leftovers = [r for r in repos if repo_dir(r).is_dir() and r not in {c.repo_id for c in cached}]
    if not cached and not leftovers:
        embedded = spec.embedded_path() if spec is not None else None
        derived = _remove_derived(embedded, model) if embedded is not None else []
        if derived:
            return derived + [f"(the embedded {spec.name} stays: it is part of the {spec.embedded.split('/')[0]} "
                              "package)"]
        if embedded is not None:
            raise HubError(f"{spec.name} is the embedded model (inside the {spec.embedded.split('/')[0]} package); "
                           "it is not in the download cache and cannot be removed with `rm` "
                           f"(pip uninstall {spec.embedded.split('/')[0]} would)")
        raise HubError(f"{model} is not downloaded (see `localllm list`)")
    lines = [line for r in repos for line in _remove_derived(repo_dir(r), model)]
    if cached:
        hashes = [rev.commit_hash for r in cached for rev in r.revisions]
        others = [r for r in scan.repos if r not in cached and any(v.commit_hash in hashes for v in r.revisions)]
        if hashes and not others:
            strategy = scan.delete_revisions(*hashes)
            strategy.execute()
        for r in cached:  # a repo whose hash another repo shares, or one without revisions: remove its folder
            shutil.rmtree(r.repo_path, ignore_errors=True)
            lines.append(f"deleted {r.repo_id} ({len(r.revisions)} revision{'s' * (len(r.revisions) != 1)}, "
                         f"{human_bytes(r.size_on_disk)} freed)")
    for repo in leftovers:  # only partial downloads: no snapshot, so scan_cache_dir skips it
        d = repo_dir(repo)
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file() and not f.is_symlink())
        shutil.rmtree(d, ignore_errors=True)
        lines.append(f"deleted {repo} (partial download, {human_bytes(size)} freed)")
    if spec is not None and spec.embedded_path() is not None:
        lines.append(f"(the embedded {spec.name} stays: it is part of the {spec.embedded.split('/')[0]} package)")
    return lines
