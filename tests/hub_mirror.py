"""A loopback fake of the Hugging Face hub, for tests (the real hub is unreachable here).

It implements what huggingface_hub (2.x) calls for model repos:
  GET  /api/models/{repo}/revision/{rev}      model info with siblings (?blobs=true adds sizes and LFS)
  GET  /api/models/{repo}/tree/{rev}          file tree (used by snapshot_download)
  HEAD /{repo}/resolve/{rev}/{file}           X-Repo-Commit, ETag, Content-Length
  GET  /{repo}/resolve/{rev}/{file}           the bytes, with Range support (206) for resumed downloads
and the error headers huggingface_hub maps to exceptions: `X-Error-Code: RepoNotFound` (404),
`GatedRepo` (401 without a token that has access), `RevisionNotFound`, `EntryNotFound`.

Faults for resume tests: `drop_after[file] = n` sends n bytes of the first GET of that file and then
closes the connection; `stall_after[file] = n` makes every GET of that file (a client's Range
retries too) stop at byte n and hang until `release` is set, however long that takes: a test can
take its time to interrupt the download, which cannot finish or time out meanwhile.
Every request is recorded in `requests` as (method, path, headers).

Hostile modes, for the tests that a mirror cannot write outside the cache: a repo's `hostile` maps
a field to the value the mirror sends instead of the true one: "sha" (model info's commit), "etag"
(the ETag header), "linked_etag" (X-Linked-Etag), "repo_commit" (X-Repo-Commit), "sibling" (one more
file name in the listing, served with config.json's bytes), "location" (HEAD answers 302 to it).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

LFS_MIN = 1 << 20  # files this big are "LFS" files: ETag = sha256, like on the hub


@dataclass
class MirrorFile:
    path: Path
    size: int
    etag: str
    lfs: bool


@dataclass
class MirrorRepo:
    files: dict[str, MirrorFile]
    commit: str
    gated: bool = False
    hostile: dict[str, str] = field(default_factory=dict)


def _file(path: Path) -> MirrorFile:
    data = path.read_bytes()
    size = len(data)
    if size >= LFS_MIN:
        return MirrorFile(path, size, hashlib.sha256(data).hexdigest(), True)
    git_oid = hashlib.sha1(b"blob %d\0" % size + data).hexdigest()
    return MirrorFile(path, size, git_oid, False)


def make_repo(folder: Path, gated: bool = False, hostile: dict[str, str] | None = None) -> MirrorRepo:
    files = {p.relative_to(folder).as_posix(): _file(p) for p in sorted(folder.rglob("*")) if p.is_file()}
    commit = hashlib.sha1("".join(f.etag for f in files.values()).encode()).hexdigest()
    if hostile and "sibling" in hostile:
        files[hostile["sibling"]] = files["config.json"]
    return MirrorRepo(files, commit, gated, dict(hostile or {}))


class HubMirror:
    def __init__(self, repos: dict[str, MirrorRepo], tokens: set[str] | None = None):
        self.repos = repos
        self.tokens = tokens or set()  # bearer tokens that may read gated repos
        self.requests: list[tuple[str, str, dict]] = []
        self.drop_after: dict[str, int] = {}
        self.stall_after: dict[str, int] = {}
        self.release = threading.Event()
        self.stalled = threading.Event()  # set once a stalled response has sent its bytes
        self._lock = threading.Lock()
        handler = functools.partial(_Handler, self)
        self.server = _Server(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HubMirror:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def record(self, method: str, path: str, headers: dict) -> None:
        with self._lock:
            self.requests.append((method, path, headers))

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    def gets(self, fragment: str = "/resolve/") -> list[tuple[str, str, dict]]:
        """GET requests whose path contains `fragment` (default: file downloads)."""
        return [r for r in list(self.requests) if r[0] == "GET" and fragment in r[1]]


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):  # clients that hang up are normal here
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def __init__(self, mirror: HubMirror, *args, **kwargs):
        self.mirror = mirror
        super().__init__(*args, **kwargs)

    def log_message(self, *args) -> None:  # keep test output clean
        pass

    # ---- helpers ---------------------------------------------------------------------------
    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.send_header("Content-Length", str((headers or {}).get("Content-Length", len(body))))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)

    def _json(self, obj, status: int = 200, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, code: str, message: str, head: bool = False) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(status, body, {"Content-Type": "application/json", "X-Error-Code": code,
                                  "X-Error-Message": message}, head=head)

    def _authorized(self, repo: MirrorRepo) -> bool:
        auth = self.headers.get("Authorization", "")
        return not repo.gated or (auth.startswith("Bearer ") and auth[7:] in self.mirror.tokens)

    def _route(self, head: bool) -> None:
        raw = urlparse(self.path).path  # matched before unquoting: a revision may hold a quoted '/'
        path = unquote(raw)
        self.mirror.record(self.command, path, {k.lower(): v for k, v in self.headers.items()})
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)(?:/.*)?", raw)
        if m:
            return self._api(*map(unquote, m.groups()))
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", raw)
        if m:
            return self._resolve(*map(unquote, m.groups()), head)
        self._error(404, "EntryNotFound", f"no route {path}", head)

    def _repo(self, name: str, rev: str, head: bool = False) -> MirrorRepo | None:
        repo = self.mirror.repos.get(name)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found", head)
            return None
        if rev not in ("main", repo.commit, repo.hostile.get("sha")):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
            return None
        return repo

    # ---- routes ----------------------------------------------------------------------------
    def _api(self, name: str, kind: str, rev: str) -> None:
        repo = self._repo(name, rev)
        if repo is None:
            return
        if kind == "revision":  # model info is public even for gated repos (like the hub)
            siblings = [{"rfilename": n, "size": f.size, "blobId": f.etag if not f.lfs else "0" * 40,
                         **({"lfs": {"sha256": f.etag, "size": f.size, "pointerSize": 134}} if f.lfs else {})}
                        for n, f in repo.files.items()]
            return self._json({"id": name, "modelId": name, "sha": repo.hostile.get("sha", repo.commit), "private": False,
                               "gated": "auto" if repo.gated else False, "disabled": False, "tags": [],
                               "downloads": 0, "likes": 0, "siblings": siblings})
        tree = [{"type": "file", "path": n, "size": f.size, "oid": f.etag if not f.lfs else "0" * 40,
                 **({"lfs": {"oid": f.etag, "size": f.size, "pointerSize": 134}} if f.lfs else {})}
                for n, f in repo.files.items()]
        self._json(tree)

    def _resolve(self, name: str, rev: str, filename: str, head: bool) -> None:
        repo = self._repo(name, rev, head)
        if repo is None:
            return
        if not self._authorized(repo):
            return self._error(401, "GatedRepo", "Access to this model is restricted: accept the conditions", head)
        f = repo.files.get(filename)
        if f is None:
            return self._error(404, "EntryNotFound", f"{filename} does not exist", head)
        headers = {"X-Repo-Commit": repo.hostile.get("repo_commit", repo.commit),
                   "ETag": f'"{repo.hostile.get("etag", f.etag)}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if "linked_etag" in repo.hostile:
            headers["X-Linked-Etag"] = f'"{repo.hostile["linked_etag"]}"'
        if "location" in repo.hostile:
            return self._send(302, b"", {**headers, "Location": repo.hostile["location"], "X-Linked-Size": f.size},
                              head=head)
        start = 0
        rng = self.headers.get("Range")
        if rng and not head:
            m = re.fullmatch(r"bytes=(\d+)-", rng.strip())
            if not m or int(m.group(1)) >= f.size:
                return self._send(416, b"", {"Content-Range": f"bytes */{f.size}"})
            start = int(m.group(1))
        n = f.size - start
        headers["Content-Length"] = n
        if start:
            headers["Content-Range"] = f"bytes {start}-{f.size - 1}/{f.size}"
        self.send_response(206 if start else 200)
        for k, v in headers.items():
            self.send_header(k, str(v))
        self.end_headers()
        if head:
            return
        self._stream(f, filename, start)

    def _stream(self, f: MirrorFile, filename: str, start: int) -> None:
        mirror = self.mirror
        with mirror._lock:  # a drop fires once, on the first full GET of a file; a stall until released
            drop = mirror.drop_after.pop(filename, None) if start == 0 else None
            stall = None if mirror.release.is_set() else mirror.stall_after.get(filename)
        limit = drop if drop is not None else None if stall is None else max(stall - start, 0)
        with open(f.path, "rb") as fh:
            fh.seek(start)
            sent = 0
            while True:
                chunk = fh.read(1 << 16 if limit is None else min(1 << 16, limit - sent))
                if not chunk:
                    break
                self.wfile.write(chunk)
                sent += len(chunk)
            self.wfile.flush()
        if drop is not None:
            self.close_connection = True
            self.connection.shutdown(2)  # the client sees a truncated body
        elif stall is not None:
            mirror.stalled.set()
            mirror.release.wait()  # the test sets it (its fixtures too, at the end): never on a timer
            self.close_connection = True

    def do_GET(self) -> None:  # noqa: N802
        self._route(head=False)

    def do_HEAD(self) -> None:  # noqa: N802
        self._route(head=True)


# ---- the served model: the embedded SmolLM2 cut to 2 layers, bf16 (~64 MB) -------------------
@functools.cache
def tiny_checkpoint() -> Path:
    """An HF checkpoint that `localllm run` really loads, built once per test process."""
    import atexit

    import torch

    from localllm.model.export import export_hf
    from localllm.registry import resolve_model

    root = Path(tempfile.mkdtemp(prefix="localllm-mirror-"))
    atexit.register(shutil.rmtree, root, True)
    out = export_hf(resolve_model("smollm2-135m").local_path, root / "tiny", torch.bfloat16, num_layers=2)
    (out / "pytorch_model.bin").write_bytes(b"pickle weights must never be downloaded")
    (out / "README.md").write_text("# tiny test model\n")
    return out


def pickle_only_repo(root: Path) -> Path:
    d = root / "pickle-only"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (d / "pytorch_model.bin").write_bytes(b"\0" * 1000)
    return d


def gguf_repo(root: Path) -> Path:
    """A GGUF-only repo holding the embedded model file (hard-linked: no copy of 100 MB)."""
    from localllm.registry import resolve_model

    d = root / "gguf"
    d.mkdir(parents=True, exist_ok=True)
    src = resolve_model("smollm2-135m").local_path
    dst = d / "tiny-q4_1.gguf"
    if not dst.exists():
        try:
            dst.hardlink_to(src)
        except OSError:
            shutil.copyfile(src, dst)
    (d / "README.md").write_text("# gguf\n")
    return d


def tiny_checkpoint_with_template(dest: Path, template: str) -> Path:
    """A copy of the tiny checkpoint at `dest` whose tokenizer_config.json carries `template`
    (e.g. Qwen3's: a model that reasons and takes tools, for the server's template paths)."""
    shutil.copytree(tiny_checkpoint(), dest)
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    return dest


def tiny_checkpoint_that_says(dest: Path, text: str) -> Path:
    """A copy of the tiny checkpoint at `dest` whose every reply is `text` repeated, one token per
    `text`, on any machine: the final norm's weight is zero, so every logit is exactly 0 and greedy
    decoding picks token 0, whose content becomes `text` (a plain, non-special added token; the
    end-of-text token it was is no stop token of this model, <|im_end|> is). For tests that need
    a reply they choose, e.g. one full of terminal escape sequences."""
    import torch
    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint()
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, dest / name)
    # fp32: every logit is an exact tie, which only the exact head breaks as argmax does (lowest
    # id); a 16-bit checkpoint gets the int4 ranking head, whose candidates among ties are any
    config = json.loads((dest / "config.json").read_text())
    config.update({k: "float32" for k in ("torch_dtype", "dtype") if k in config})
    (dest / "config.json").write_text(json.dumps(config))
    tensors = {k: v.float() for k, v in load_file(src / "model.safetensors").items()}
    tensors["model.norm.weight"] = torch.zeros_like(tensors["model.norm.weight"])
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    tok = json.loads((src / "tokenizer.json").read_text())
    first = tok["added_tokens"][0]
    assert first["id"] == 0 and first["content"] == "<|endoftext|>", first
    first.update(content=text, special=False)
    tok["model"]["vocab"][text] = tok["model"]["vocab"].pop("<|endoftext|>")
    (dest / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    for entry in (cfg.get("added_tokens_decoder") or {}).values():
        if entry.get("content") == "<|endoftext|>":
            entry.update(content=text, special=False)
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    return dest


# Qwen2.5-Coder's FIM and repository tokens, in the order its vocabulary lists them
QWEN_FIM = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]


def tiny_coder_checkpoint(out: Path) -> Path:
    """A 2-layer Qwen2 written by transformers, with the embedded model's byte-level vocabulary
    under Qwen2's pre-tokenizer (what transformers' Qwen2Tokenizer applies) plus Qwen2.5-Coder's
    FIM tokens as special tokens: a coder model's tokenizer in miniature."""
    import torch
    import transformers
    from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers

    from localllm.model.gguf import read_gguf
    from localllm.registry import resolve_model
    from localllm.tokenizer import _QWEN2_REGEX, LLMTokenizer

    out.mkdir(parents=True)
    src = LLMTokenizer.from_gguf(read_gguf(resolve_model("smollm2-135m").local_path).metadata)
    src.save_hf(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in QWEN_FIM])
    tok.save(str(out / "tokenizer.json"))
    cfg = transformers.Qwen2Config(
        vocab_size=tok.get_vocab_size(with_added_tokens=True), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        tie_word_embeddings=True, eos_token_id=src.eos_id, bos_token_id=None)
    model = transformers.Qwen2ForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # peaked logits: greedy near-ties would make token-exact comparisons flaky
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) if "norm" in name
                        else 0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 2 / p.shape[1] ** 0.5)
    model.save_pretrained(out, safe_serialization=True)
    return out
