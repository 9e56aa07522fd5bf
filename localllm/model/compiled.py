"""The compiled CPU step's packages: the model's one forward (`LlamaModel.forward`: every layer,
attention over the paged cache through our paged-attention op), exported once and compiled ahead
of time by AOTInductor into a C++ package, and the on-disk cache of those packages (keys, paths,
checks, removal, the job a background build runs). The engine's runtime step that uses them is
localllm.engine.compiled_step.CompiledStep; the background builder is localllm.model.build_queue.

Why: at batch 1 the eager step is ~300 small aten calls per token plus Python; on 2 cores that
overhead is as large as the matmuls. One compiled graph fuses the elementwise work (norms, RoPE,
residuals, SiLU, the cache writes) into a few C++ loops around our kernels, and AOTInductor's
C++ wrapper leaves no Python per kernel call (BENCHMARKS.md, "Where the time goes").

Kinds of package (torch.export specializes sizes 1, so batch 1 has its own):
  "d1": one sequence, one new token (decode at batch 1);
  "v1": one sequence, 2..R new tokens (a speculative verify at batch 1);
  "n":  2..R sequences, 2..R new tokens (batched decode and verify);
R = max_rows(model). Block tables and the cache are dynamic in size.

Built where it costs the user nothing: a package that is not on disk is queued for the one
background builder of this localllm home (localllm.model.build_queue: one worker at a time, at
idle CPU priority, stopped while any engine generates). The engine answers eagerly meanwhile and
switches at a step boundary once the package is there. A one-shot `localllm run` queues nothing
unless asked (`--build`); chat and serve do. Packages live in ~/.cache/localllm/aoti, keyed by
the model's structure (config, module tree, tensor shapes and dtypes: the package runs on the
model's own tensors, so the same weights under another path, or another checkpoint of the same
shape, use the same package), the code, torch, the thread count and the KV dtype; each has a JSON
sidecar with its sha256 (a damaged package is deleted and built again, never loaded) and the
model files that use it (`localllm rm`).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..durable import publish
from ..paths import cache_home
from . import build_queue
from .attention import AttnMeta, describe_batch
from .layers import Int4Linear

KINDS = ("d1", "v1", "n")


def max_rows(model) -> int:
    """The most new tokens a package takes; larger steps run eagerly. Int4 layers with fp32
    prefill copies switch to those at `dense_min_rows` rows (32 with torch's int4 kernel, 160 with
    ours), a branch an exported graph cannot hold for a dynamic size."""
    rows = [m.dense_min_rows for m in model.modules() if isinstance(m, Int4Linear) and m.dense is not None]
    return min(rows, default=257) - 1


def kind_of(num_seqs: int, num_tokens: int) -> str:
    if num_seqs == 1:
        return "d1" if num_tokens == 1 else "v1"
    return "n"


def cache_dir() -> Path:
    return cache_home() / "aoti"


@functools.cache
def _code_digest() -> str:
    """The sources whose math a package bakes in: a change to them invalidates every package.
    Read once: the code this process runs, not what an editor saved since."""
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in ("compiled.py", "llama.py", "layers.py", "attention.py", "moe.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def _plain(v) -> bool:
    if isinstance(v, (tuple, list)):
        return all(map(_plain, v))
    return v is None or isinstance(v, (bool, int, float, str))


def structure_key(model) -> str:
    """What a package bakes in besides the code: the config, every module's class and plain
    attributes (eps, scales, windows, group sizes, kernel kinds), every tensor's name, shape,
    dtype and layout. Not the weights' values (they are the package's inputs) nor where the file
    lies: a copy of a model, or another checkpoint of the same shape, shares its packages."""
    key = model.__dict__.get("_structure_key")
    if key is None:
        h = hashlib.sha256(repr(model.cfg).encode())
        for name, mod in _Step(model).named_modules(remove_duplicate=False):
            attrs = sorted((k, v) for k, v in vars(mod).items()
                           if not k.startswith("_") and k not in ("fingerprint", "origin", "training") and _plain(v))
            h.update(f"{name}:{type(mod).__qualname__}:{attrs!r}\n".encode())
        for name, t in sorted(_tensors(model).items()):
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.stride()}:{t.device}\n".encode())
        key = model.__dict__["_structure_key"] = h.hexdigest()
    return key


def package_path(model, kind: str, kv_dtype: torch.dtype) -> Path | None:
    """Where the package for this model, kind and KV dtype lives; None for a model that was not
    loaded from a file (no builder could load it again)."""
    if not model.fingerprint:
        return None
    sk = structure_key(model)
    key = "|".join((sk, kind, _code_digest(), torch.__version__, str(torch.get_num_threads()), str(kv_dtype)))
    return cache_dir() / f"decode-{kind}-{sk[:12]}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.pt2"


def job_key(model, kv_dtype: torch.dtype) -> str:
    """The build queue's name for this model's packages (one job per structure, threads, KV dtype)."""
    return f"{structure_key(model)[:16]}-t{torch.get_num_threads()}-{str(kv_dtype).removeprefix('torch.')}"


# ---- the exported function ----------------------------------------------------------------------
class _Step(torch.nn.Module):
    def __init__(self, model):
        from .llama import Ops

        super().__init__()
        self.m = model
        self.ops = Ops.for_backend("torch")  # plain torch ops: Inductor fuses them itself

    def forward(self, ids, positions, slots, block_tables, cu_seqlens_q, context_lens, *caches):
        meta = AttnMeta.captured(slots, block_tables, cu_seqlens_q, context_lens)
        # the hidden states only: the head runs outside, greedy (int4 rank + exact rescore) or the
        # exact logits a sampled token needs (temperature 0.7 is run's and chat's default): in the
        # graph, every sampled token paid for a greedy head it did not use (1.2 ms on 135M)
        return (self.m(ids, positions, meta, list(zip(caches[::2], caches[1::2])), self.ops),)


def _layout(model, kv_dtype: torch.dtype, lens: list[tuple[int, int]], num_blocks: int,
            tables: torch.Tensor | None = None):
    """Inputs of a step for sequences of (new tokens, context) on a small paged cache: sequence b
    owns blocks 1 + b*W .. (block 0 is the null block), or row b of `tables`."""
    cfg, bs = model.cfg, 16
    if tables is None:
        W = max(2, max(-(-c // bs) for _, c in lens))
        tables = torch.tensor([[1 + b * W + j for j in range(W)] for b in range(len(lens))])
    pos, meta = describe_batch(tables, [n for n, _ in lens], [c for _, c in lens], bs)
    ids = (pos * 7919 + 3) % cfg.vocab_size
    caches = [torch.zeros(num_blocks, bs, cfg.num_kv_heads, cfg.head_dim, dtype=kv_dtype)
              for _ in range(2 * cfg.num_layers)]
    return [ids, pos, meta.slot_mapping, meta.block_tables, meta.cu_seqlens_q, meta.context_lens], caches


EXAMPLES = {"d1": [(1, 13)], "v1": [(3, 15)], "n": [(1, 13), (2, 20)]}


def _dynamic_shapes(model, kind: str, num_caches: int):
    from torch.export import Dim

    R = max_rows(model)
    W = Dim("W", min=2, max=model.rope.cos.shape[0] // 16 + 2)
    NB = Dim("NB", min=3)
    T = Dim("T", min=2, max=R) if kind != "d1" else None
    B = Dim("B", min=2, max=R) if kind == "n" else None
    tok = {0: T} if T is not None else None
    return {"ids": tok, "positions": tok, "slots": tok, "block_tables": {0: B, 1: W} if B else {1: W},
            "cu_seqlens_q": {0: B + 1} if B else None, "context_lens": {0: B} if B else None,
            "caches": tuple({0: NB} for _ in range(num_caches))}


def build_package(model, kind: str, kv_dtype: torch.dtype, out: Path) -> None:
    """Export the step for `kind` and compile it into `out`, atomically: the package and its
    sidecar appear together only once the package has matched the eager step."""
    args, caches = _layout(model, kv_dtype, EXAMPLES[kind], 48)
    with torch.inference_mode():
        ep = torch.export.export(_Step(model), (*args, *caches), strict=False,
                                 dynamic_shapes=_dynamic_shapes(model, kind, len(caches)))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.stem}.{os.getpid()}.tmp.pt2")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    try:
        scalars = _compile_without_weights(ep, model, tmp, kind, kv_dtype)
        if scalars is None:  # fall back to a package that carries its own copy of the weights
            model.cover(model.rope.cos.shape[0])  # (the RoPE tables among them, every row)
            torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp))
            if not _same_as_eager(model, _load(model, tmp, None), kind, kv_dtype):
                raise RuntimeError("the compiled step does not match the eager step")
        source = (model.origin or {}).get("path")
        sidecar = {"scalars": scalars, "sha256": _sha256(tmp), "sources": [source] if source else []}
        side_tmp = tmp.with_suffix(".json")
        side_tmp.write_text(json.dumps(sidecar))
        publish(side_tmp, out.with_suffix(".json"))  # each fsynced before its rename
        publish(tmp, out)
        # other versions for the same weights (older code or torch, other thread counts) are stale
        prefix = out.name.rsplit("-", 1)[0]
        for old in out.parent.glob(f"{prefix}-*"):
            if old.stem != out.stem and ".tmp." not in old.name:
                old.unlink(missing_ok=True)
    finally:
        tmp.unlink(missing_ok=True)
        tmp.with_suffix(".json").unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _compile_without_weights(ep, model, path: Path, kind: str, kv_dtype: torch.dtype) -> dict[str, int] | None:
    """Compile a package that holds no weights. Besides the model's tensors it then needs the
    constants Inductor creates itself: one 0-d int64 group size per torch int4 matmul (the C
    shim takes it as a tensor), numbered in graph order. Returns them by name once a test step
    matches the eager step, else None."""
    int4 = torch.ops.aten._weight_int4pack_mm_for_cpu.default
    groups = [n.args[2] for n in ep.graph.nodes if n.target is int4]
    torch._inductor.aoti_compile_and_package(
        ep, package_path=str(path), inductor_configs={"aot_inductor.package_constants_in_so": False})
    names = set(_tensors(model))
    fqns = Package(path).get_constant_fqns()
    missing = sorted((n for n in fqns if n not in names), key=lambda n: int(n.removeprefix("constant") or -1))
    if len(missing) != len(groups) or not all(n.startswith("constant") for n in missing):
        return None
    scalars = dict(zip(missing, groups))
    return scalars if _same_as_eager(model, _load(model, path, scalars), kind, kv_dtype) else None


def _same_as_eager(model, package, kind: str, kv_dtype: torch.dtype) -> bool:
    """One step of the package against the eager forward on the same cache, after eager
    prefills have filled it with real keys and values."""
    lens = {"d1": [(1, 21)], "v1": [(4, 24)], "n": [(1, 21), (3, 30), (1, 5)]}[kind]
    args, caches = _layout(model, kv_dtype, lens, 1 + 2 * len(lens))
    ids, pos, slots, tables, cu, ctx = args
    kv = list(zip(caches[::2], caches[1::2]))
    with torch.inference_mode():
        for b, (n, c) in enumerate(lens):  # the cached prefix of each sequence, eagerly
            p_args, _ = _layout(model, kv_dtype, [(c - n, c - n)], 1, tables[b:b + 1])
            model(p_args[0], p_args[1], AttnMeta.captured(*p_args[2:]), kv)
        ref = model(ids, pos, AttnMeta.captured(slots, tables, cu, ctx), [(k.clone(), v.clone()) for k, v in kv])
        hidden = package(*args, *caches)[0]
    # matmul inputs rounded at other points of a fused graph differ by ~5e-3 over 30 layers; a
    # wrong group size or a wrong cache slot gives O(1)
    return bool(((hidden - ref).norm() / ref.norm()) < 3e-2)


def _tensors(model) -> dict[str, torch.Tensor]:
    # every name of a shared tensor (a tied embedding and head): packages may use either
    step = _Step(model)
    return dict(step.named_parameters(remove_duplicate=False)) | dict(step.named_buffers(remove_duplicate=False))


class Package:
    """An AOTI package run through torch's C++ loader directly, with flat tensor lists: going
    through torch._inductor.aoti_load_package imports Inductor's Python package (~1.5 s of every
    load) and its wrapper re-parses the call spec on every call."""

    def __init__(self, path: Path):
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)

    def get_constant_fqns(self) -> list[str]:
        return self.loader.get_constant_fqns()

    def load_constants(self, tensors: dict[str, torch.Tensor], check_full_update: bool, user_managed: bool) -> None:
        self.loader.load_constants(tensors, False, check_full_update, user_managed)

    def __call__(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        return self.loader.boxed_run(list(tensors))


def _load(model, path: Path, scalars: dict[str, int] | None) -> Package:
    runner = Package(path)
    tensors = _tensors(model)
    if scalars is not None:  # a package without weights: it runs on the model's own tensors
        tensors.update({name: torch.tensor(v, dtype=torch.int64) for name, v in scalars.items()})
        runner.load_constants({k: tensors[k] for k in runner.get_constant_fqns()}, True, True)
    else:  # its packaged weights are replaced by the model's where they match
        runner.load_constants({k: tensors[k] for k in runner.get_constant_fqns() if k in tensors}, False, True)
    return runner


def load_package(model, path: Path) -> Package:
    """The package at `path`, checked against its sidecar; ValueError when either is damaged."""
    try:
        side = json.loads(path.with_suffix(".json").read_text())
        ok = side["sha256"] == _sha256(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"unreadable package sidecar: {e}") from None
    if not ok:
        raise ValueError("package does not match its recorded sha256")
    return _load(model, path, side["scalars"])


def _sources(side: dict) -> list[str]:
    return list(side.get("sources") or ([side["source"]] if side.get("source") else []))


def note_source(path: Path, source: str | None) -> None:
    """Record in the sidecar that the model file `source` uses this package (for `rm`); a lost
    update (two processes at once) costs at most that `rm` of the other model keeps it."""
    side_path = path.with_suffix(".json")
    try:
        side = json.loads(side_path.read_text())
        if not source or source in _sources(side):
            return
        side["sources"] = _sources(side) + [source]
        tmp = side_path.with_name(f"{side_path.stem}.{os.getpid()}.tmp.json")
        tmp.write_text(json.dumps(side))
        os.replace(tmp, side_path)
    except (OSError, ValueError, TypeError):  # a read-only home: rm then misses this model's use
        pass


def remove_packages(source: str | os.PathLike) -> int:
    """`localllm rm`: forget the model file(s) under `source` in every package's sidecar and
    delete the packages no other model file on disk uses. -> packages deleted."""
    root, count = str(Path(source).resolve()), 0
    for side_path in cache_dir().glob("decode-*.json"):
        try:
            side = json.loads(side_path.read_text())
            sources = _sources(side)
        except (OSError, ValueError, TypeError, AttributeError):
            continue
        ours = [s for s in sources if s == root or s.startswith(root.rstrip(os.sep) + os.sep)]
        if not ours:
            continue
        others = [s for s in sources if s not in ours and os.path.exists(s)]
        if others:
            side["sources"] = others
            side_path.write_text(json.dumps(side))
            continue
        side_path.with_suffix(".pt2").unlink(missing_ok=True)
        side_path.unlink(missing_ok=True)
        count += 1
    return count


# ---- building in the background (localllm.model.build_queue runs the jobs) ----------------------
def _lock_path(model) -> Path:
    return cache_dir() / f"build-{structure_key(model)[:12]}-{torch.get_num_threads()}.lock"


def job_spec(model, kv_dtype: torch.dtype) -> dict:
    """What a worker needs to load the model again and build its packages."""
    return {"origin": model.origin, "kv_dtype": str(kv_dtype).removeprefix("torch."),
            "threads": torch.get_num_threads()}


def build_missing(model, kv_dtype: torch.dtype) -> list[str]:
    """Build every kind whose package is missing, holding the model's build lock (another
    process already building: return at once). -> the kinds built."""
    lock = _lock_path(model)
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return []
        f.write(str(os.getpid()))
        f.flush()
        for tmp in cache_dir().glob(f"decode-*-{structure_key(model)[:12]}-*.tmp.*"):  # left by a killed build
            tmp.unlink(missing_ok=True)
        built = []
        for kind in KINDS:
            path = package_path(model, kind, kv_dtype)
            if path is not None and not path.is_file():
                build_package(model, kind, kv_dtype, path)
                built.append(kind)
        return built


def builder_pid(model) -> int | None:
    """The pid of the process building this model's packages now, if any."""
    try:
        with open(_lock_path(model)) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return int(f.read() or 0) or None
            fcntl.flock(f, fcntl.LOCK_UN)
    except (OSError, ValueError):
        pass
    return None


def _worker_main(job_path: str) -> int:
    """Build the packages of one queued job; started by the builder (build_queue) at idle
    priority (SCHED_IDLE), so this process and the compilers it starts only run on cores nobody
    else wants."""
    try:
        spec = json.loads(Path(job_path).read_text())
    except (OSError, ValueError):
        return 0  # removed meanwhile (`localllm rm`, `ps --stop`)
    torch.set_num_threads(spec["threads"])
    from torch._inductor import config as inductor_config

    inductor_config.compile_threads = 1
    from .loader import load_model

    o = spec["origin"]
    loaded = load_model(o["path"], o["precision"], o["device"], o["max_model_len"], o["fast_head"], o["cpu_kernels"])
    kv_dtype = getattr(torch, spec["kv_dtype"])
    t0 = time.time()
    built = build_missing(loaded.model, kv_dtype)
    print(f"{time.strftime('%F %T')} built {built or 'nothing'} for {o['path']} in {time.time() - t0:.0f} s "
          f"(peak RSS {_peak_rss_mib()} MiB)", flush=True)
    return 0


def _peak_rss_mib() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


# ---- what the runtime step (localllm.engine.compiled_step) asks of the cache --------------------
def remove_package(path: Path) -> None:
    """Delete a damaged package and its sidecar, so that it is built again (never loaded)."""
    path.unlink(missing_ok=True)
    path.with_suffix(".json").unlink(missing_ok=True)


def queue_build(model, kv_dtype: torch.dtype) -> subprocess.Popen | None:
    """Queue this model's missing packages for the background builder and make sure one runs;
    -> the builder process when this call started it."""
    build_queue.enqueue(job_key(model, kv_dtype), job_spec(model, kv_dtype))
    return build_queue.ensure_builder()


def build_queued(model, kv_dtype: torch.dtype) -> bool:
    """A job for this model's packages is in the queue."""
    key = job_key(model, kv_dtype)
    return any(j.key == key for j in build_queue.jobs())


def builder_running() -> bool:
    return build_queue.builder_pid() is not None


def busy_flag() -> build_queue.BusyFlag:
    """The flag an engine raises while it generates: the background build waits meanwhile."""
    return build_queue.BusyFlag()


def hint_path(model, kv_dtype: torch.dtype) -> Path:
    """Marks that a one-shot run was told once that this model has no package yet."""
    return cache_dir() / "hinted" / job_key(model, kv_dtype)


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1]))
