"""Models on demand for `localllm serve` without a MODEL: every local model is servable, and a
request for one that is not loaded loads it.

Each loaded model has its own thread that loads the engine and then runs its EngineLoop (the
thread that loads is the one that steps: one OpenMP team per model, see app.py). Memory is
counted with the planner: a model's need is weights + its KV cache + runtime, and when a new
model does not fit the budget (--max-memory, else 90% of what is free now) the least recently
used idle model is unloaded first. A model with requests in flight is never unloaded. Requests
for a model that is loading wait for that one load.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..config import EngineConfig, kv_blocks
from .generation import ServedModel, serve_engine
from .openai_schema import APIError

if TYPE_CHECKING:  # for the annotations only: importing the engine loads torch
    from ..engine.engine import LLMEngine
    from .encoder_loop import ServedEncoder

DEFAULT_KEEP_ALIVE = 300.0  # seconds an idle model stays loaded (Ollama's default: 5m)


@dataclass
class LocalModel:
    """A model that can be served without downloading anything."""

    name: str
    aliases: list[str]
    path: str | None
    size: int
    modified: float
    variant: str = ""
    kind: str = "generate"  # "embedding" | "rerank": an encoder (model/encoder_loader.py)


def local_models() -> list[LocalModel]:
    """Registry models that are embedded or downloaded, and other models in the HF cache."""
    import os

    from ..model.encoder_loader import encoder_kind
    from ..models_cli import list_models

    out: dict[str, LocalModel] = {}
    for row in list_models():
        if row["status"] not in ("embedded", "downloaded") or row["name"] in out:
            continue
        path = row["path"]
        try:
            modified = os.stat(path).st_mtime if path else 0.0
        except OSError:
            modified = 0.0
        aliases = [*row["aliases"], *([row["repo"]] if row["repo"] != row["name"] else [])]
        out[row["name"]] = LocalModel(row["name"], aliases, path, row["size_bytes"] or 0, modified, row["variant"],
                                      encoder_kind(path) or row.get("kind") or "generate")
    return list(out.values())


def find_model(models: list[LocalModel], name: str) -> LocalModel | None:
    """A request's model name -> the local model (name, alias or repo; `:latest` as Ollama adds it)."""
    key = name.strip().lower()
    keys = {key, key.removesuffix(":latest")}
    for m in models:
        if keys & {n.lower() for n in [m.name, *m.aliases]}:
            return m
    return None


@dataclass
class Pinned:
    """`localllm serve MODEL`: the one model of a pool of one, loaded at start by `load` (the CLI's
    planned build_engine) and kept until the server stops; a request naming another is a 404."""

    name: str
    aliases: list[str]
    load: Callable[[], LLMEngine]
    # a server that runs the model instead of our engine (vllm_backend.VLLMBackend): `load` returns
    # its ProxyEngine, `backend.serve` makes the ServedModel, and its routes answer /v1 (app.py)
    backend: Any = None

    def local(self) -> LocalModel:
        """The model as /api/tags lists it (its file is there once `load` has pulled it)."""
        import os

        from ..models_cli import disk_size, local_path
        from ..registry import resolve_model

        path = local_path(resolve_model(self.name))
        size, modified = 0, 0.0
        if path is not None:
            size, modified = disk_size(path), os.stat(path).st_mtime
        from ..model.encoder_loader import encoder_kind

        return LocalModel(self.name, [a for a in self.aliases if a], str(path) if path else None, size, modified,
                          kind=encoder_kind(path) or "generate")


@dataclass
class PoolConfig:
    engine_config: EngineConfig  # for every model (ctx, kv memory, threads, batch)
    quant: str = "auto"
    device: str = "auto"
    max_memory: int | None = None  # bytes for all loaded models together; None: 90% of free memory
    keep_alive: float = DEFAULT_KEEP_ALIVE
    pinned: Pinned | None = None


@dataclass
class PoolEntry:
    """A model in the pool, loading or loaded: its ServedModel once ready (what requests run on),
    and what the pool decides by (memory it needs, requests in flight, when it expires)."""

    name: str
    need: int  # planned bytes (weights + KV + runtime)
    ctx: int = 0  # the context it was loaded with
    model: ServedModel | ServedEncoder | None = None  # set once loaded, None again once unloaded
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    error: APIError | None = None
    active: int = 0  # requests in flight
    last_used: float = field(default_factory=time.monotonic)
    expires_at: float | None = None  # wall-clock time (None: while in use, or forever)
    keep_alive: float = DEFAULT_KEEP_ALIVE
    loaded_at: float = 0.0
    load_seconds: float = 0.0


# what each task needs the model to be, and how Ollama words the refusal ("%q does not support chat")
_TASKS = {"generate": ("generate", "generate"), "chat": ("generate", "chat"), "embed": ("embedding", "embeddings"),
          "rerank": ("rerank", "reranking")}


# a chat model asked for embeddings is loaded a second time as an embedder (DecoderEncoder: its
# last token's hidden state, as Ollama's llama.cpp engine embedded with chat models), a pool entry
# of its own under this name
EMBED_TWIN = " (embeddings)"


def check_task(local: LocalModel, name: str, task: str, pinned: bool = False) -> None:
    need, word = _TASKS[task]
    if task == "embed" and local.kind == "generate" and not pinned:
        return
    if local.kind != need:
        what = {"embedding": "an embedding model", "rerank": "a reranker"}.get(local.kind, "a text generation model")
        raise APIError(400, f'"{name}" does not support {word} (it is {what})', param="model",
                       code="model_capability")


def load_error(name: str, e: BaseException) -> APIError:
    """What a client is told when `name` fails to load: a cause it can act on is a 4xx or a 503
    saying what to change; only a fault of ours is a 500."""
    from ..hub import HubError
    from ..planner import PlanError

    text = f"could not load {name}: {e or type(e).__name__}"
    if isinstance(e, MemoryError) or "out of memory" in str(e).lower():
        return APIError(503, text + " (not enough free memory now: retry when other models or programs "
                                    "have freed some, or ask for a smaller num_ctx)",
                        "service_unavailable", code="model_memory", headers={"Retry-After": "5"})
    if isinstance(e, (ValueError, PlanError, FileNotFoundError)):  # sizing, a request value, a bad model file
        return APIError(400, text, param="model", code="model_load_failed")
    if isinstance(e, HubError):  # the download: the hub or the network, not this server
        return APIError(502, text, "upstream_error", code="model_download_failed")
    return APIError(500, text, "internal_error", code="model_load_failed")


@dataclass
class EncoderPlan:
    """What the pool needs to know to load an encoder: its memory (fp32 weights, the batch's
    activations) against the budget. No KV cache, no context to choose."""

    fits: bool
    needed_bytes: int
    reason: str = ""
    ctx: int = 0
    precision: str = "float32"
    variant: str | None = None


ENCODER_RUNTIME_BYTES = 256 << 20  # activations of a forward of MAX_BATCH_TOKENS tokens, and slack


def encoder_plan(local: LocalModel, budget: int | None, device: str = "auto") -> EncoderPlan:
    from ..hardware import available_memory, pick_device
    from ..model.encoder_loader import describe_encoder

    info = describe_encoder(local.path)
    need = info["parameters"] * 4 + ENCODER_RUNTIME_BYTES
    room = budget if budget is not None else int(0.9 * available_memory(pick_device(device)))
    if need > room:
        return EncoderPlan(False, need, f"needs {need / 2**30:.2f} GiB, {room / 2**30:.2f} GiB free",
                           info["context_length"])
    return EncoderPlan(True, need, "", info["context_length"])


class ModelPool:
    def __init__(self, cfg: PoolConfig, log: Callable[[str], None],
                 catalog: Callable[[], list[LocalModel]] = local_models):
        self.cfg, self.log, self._catalog = cfg, log, catalog
        self.loaded: dict[str, PoolEntry] = {}
        self._lock = asyncio.Lock()  # one load decision at a time (memory accounting)
        self._reaper: asyncio.Task | None = None
        self.closing = False
        self.load_error: str | None = None  # the pinned model's, which ends the server
        self.on_fatal: Callable[[], None] = lambda: None

    @property
    def pinned(self) -> Pinned | None:
        return self.cfg.pinned

    async def catalog(self) -> list[LocalModel]:
        if self.pinned is not None:
            return [await asyncio.to_thread(self.pinned.local)]
        return await asyncio.to_thread(self._catalog)  # scans the HF cache: off the event loop

    async def find(self, name: str | None) -> LocalModel:
        if self.pinned is not None:
            pin = self.pinned
            if name is not None and find_model([LocalModel(pin.name, pin.aliases, None, 0, 0.0)], name) is None:
                raise APIError(404, f"The model `{name}` does not exist. This server serves `{pin.name}`.",
                               param="model", code="model_not_found")
            return await asyncio.to_thread(pin.local)
        models = await self.catalog()
        if not name:  # as `localllm run` without MODEL: the registry's default model
            from ..registry import load_registry

            name = load_registry().default
            if find_model(models, name) is None:
                raise APIError(400, "model is required: this server serves every local model "
                                    f"({', '.join(m.name for m in models) or 'none'})", param="model")
        m = find_model(models, name)
        if m is None:
            raise APIError(404, f"model '{name}' not found: not a local model (pull it first; local models: "
                                f"{', '.join(m.name for m in models) or 'none'})", "not_found_error",
                           param="model", code="model_not_found")
        return m

    def model_card(self, m: LocalModel) -> dict:
        """/v1/models' entry for `m`; a loaded model also says the context it was loaded with."""
        card = {"id": m.name, "object": "model", "created": int(m.modified), "owned_by": "localllm"}
        entry = self.loaded.get(m.name)
        if entry is not None and entry.model is not None:
            card["max_model_len"] = entry.model.engine.max_model_len
        return card

    # ---- acquire / release -----------------------------------------------------------------------
    async def acquire(self, name: str | None, keep_alive: float | None = None, num_ctx: int | None = None,
                      task: str = "generate") -> tuple[ServedModel | ServedEncoder, Callable[[], None]]:
        """The loaded model `name` names (loading it first), counted as in use until release().
        `num_ctx` (Ollama's option): the context to load it with; a model loaded with another
        one is reloaded when idle, as Ollama does (while requests run on it, they share it).
        `task` ("generate", "chat", "embed", "rerank"): what the request asks of the model; a
        model that cannot do it is a 400 before anything loads."""
        if self.closing:
            raise APIError(503, "the server is shutting down", "service_unavailable", code="server_shutting_down")
        local = await self.find(name)
        check_task(local, name or local.name, task, self.pinned is not None)
        if task == "embed" and local.kind == "generate":
            local = dataclasses.replace(local, name=local.name + EMBED_TWIN, kind="embedding")
        if self.pinned is not None:  # loaded at start with the server's --ctx, kept until it stops
            entry = self.loaded.get(local.name)
            if entry is None or not entry.ready.is_set():
                raise APIError(503, "the model is still loading; retry shortly", "service_unavailable",
                               code="model_loading", headers={"Retry-After": "1"})
            num_ctx = keep_alive = None
        async with self._lock:
            entry = self.loaded.get(local.name)
            if entry is not None and num_ctx and entry.ctx != num_ctx and entry.active == 0 and entry.error is None:
                await self._unload(entry, f"reloading with context {num_ctx}")
                entry = None
            if entry is None:
                entry = await self._start_load(local, num_ctx)
            entry.active += 1
            entry.expires_at = None
            if keep_alive is not None:
                entry.keep_alive = keep_alive
        try:
            await entry.ready.wait()
        except BaseException:
            self._release(entry)
            raise
        if entry.error is not None or entry.model is None:  # no model: unloaded by a shutdown meanwhile
            self._release(entry)
            raise entry.error or APIError(503, "the server is shutting down", "service_unavailable",
                                          code="server_shutting_down")
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._release(entry)
        return entry.model, release

    def _release(self, entry: PoolEntry) -> None:
        entry.active -= 1
        entry.last_used = time.monotonic()
        if entry.active == 0 and entry.error is None:
            if entry.keep_alive == 0:
                self._unload_later(entry)
            else:
                entry.expires_at = None if entry.keep_alive < 0 else time.time() + entry.keep_alive

    # ---- loading ---------------------------------------------------------------------------------
    def _plan(self, local: LocalModel, budget: int | None, num_ctx: int | None = None):
        if local.kind != "generate":
            return encoder_plan(local, budget, self.cfg.device)
        from ..planner import DEFAULT_CTX, device_facts, facts_for, plan

        facts = facts_for(local.name)
        ec = self.cfg.engine_config
        # a fixed context per model (the request's num_ctx, --ctx, or the default), not "all that fits"
        ctx = num_ctx or ec.max_model_len or min(DEFAULT_CTX, facts.max_context)
        if num_ctx and num_ctx > facts.max_context:
            raise ValueError(f"num_ctx {num_ctx} exceeds the model's context of {facts.max_context} tokens")
        return plan(facts, device_facts(self.cfg.device), self.cfg.quant, ctx, budget, ec.kv_memory_bytes)

    async def _start_load(self, local: LocalModel, num_ctx: int | None = None) -> PoolEntry:
        """Under self._lock: plan, unload LRU idle models until it fits, start the loader thread."""
        from ..planner import PlanError

        while True:
            used = sum(e.need for e in self.loaded.values())
            budget = None if self.cfg.max_memory is None else self.cfg.max_memory - used
            try:
                p = await asyncio.to_thread(self._plan, local, budget, num_ctx)
            except (PlanError, ValueError, OSError) as e:
                raise APIError(400, f"cannot load {local.name}: {e}", param="model") from None
            if p.fits:
                break
            idle = sorted((e for e in self.loaded.values() if e.active == 0), key=lambda e: e.last_used)
            if idle:
                await self._unload(idle[0], "to make room for " + local.name)
                continue
            if self.loaded:  # only models in use are in the way: they finish, then it fits
                raise APIError(503, f"{local.name} does not fit next to the models in use "
                                    f"({', '.join(self.loaded)}): {p.reason}; retry when they are idle",
                               "service_unavailable", code="model_memory_busy", headers={"Retry-After": "1"})
            raise APIError(400, f"{local.name} cannot be loaded: {p.reason}", param="model", code="model_too_large")
        entry = PoolEntry(local.name, p.needed_bytes, p.ctx, keep_alive=self.cfg.keep_alive)
        self.loaded[local.name] = entry
        aloop = asyncio.get_running_loop()
        ec = self.cfg.engine_config
        config = dataclasses.replace(ec, max_model_len=p.ctx)
        if budget is not None and not ec.kv_memory_bytes:  # within --max-memory: the KV blocks the plan counted
            config = dataclasses.replace(config, num_kv_blocks=kv_blocks(p.ctx, ec.block_size))
        model = p.variant or local.name
        if local.kind != "generate":
            threading.Thread(target=self._run_encoder, args=(entry, local.path, local.kind, aloop),
                             name=f"localllm-encoder-{local.name}", daemon=True).start()
            return entry
        threading.Thread(target=self._load_and_run, args=(entry, model, p.precision, config, aloop),
                         name=f"localllm-engine-{local.name}", daemon=True).start()
        return entry

    def _run_encoder(self, entry: PoolEntry, path: str, kind: str, aloop) -> None:
        """An encoder's thread: loads it, then runs its EncoderLoop (as _run_engine for a decoder)."""
        from ..engine.embedder import Embedder
        from ..hardware import pick_device
        from ..model.encoder_loader import load_encoder
        from .encoder_loop import EncoderLoop, ServedEncoder

        t0 = time.perf_counter()
        from ..planner import QUANT_ALIASES

        # --quant fp32 / bf16 apply to encoders too; any other (int4...) is a decoder's: encoders keep auto
        precision = QUANT_ALIASES.get(self.cfg.quant.lower(), "auto")
        precision = precision if precision in ("float32", "bfloat16") else "auto"
        embedder = self._build(entry, lambda: Embedder(load_encoder(path, pick_device(self.cfg.device), kind, precision)),
                               aloop)
        if embedder is None:
            return
        served = entry.model = ServedEncoder(entry.name.removesuffix(EMBED_TWIN), embedder,
                                             EncoderLoop(embedder, self.log))
        entry.load_seconds = time.perf_counter() - t0
        entry.loaded_at = time.time()
        self.log(f"model {entry.name} loaded in {entry.load_seconds:.1f} s ({embedder.kind}, at most "
                 f"{embedder.max_model_len} tokens per input)")
        aloop.call_soon_threadsafe(entry.ready.set)
        served.loop.run()

    def _load_and_run(self, entry: PoolEntry, model: str, precision: str, config: EngineConfig,
                      aloop: asyncio.AbstractEventLoop) -> None:
        from ..llm import build_engine

        self._run_engine(entry, lambda: build_engine(model, precision, self.cfg.device, config), aloop)

    def _run_engine(self, entry: PoolEntry, build: Callable[[], LLMEngine], aloop: asyncio.AbstractEventLoop) -> None:
        """The model's thread: builds its engine, then steps it (the only thread that enters torch
        for it, so OpenMP keeps one team whose threads spin between ops; a second calling thread
        gets a second team, and libgomp stops spinning when its threads outnumber the cores)."""
        t0 = time.perf_counter()
        engine = self._build(entry, build, aloop)
        if engine is None:
            return
        backend = self.pinned.backend if self.pinned is not None else None
        served = entry.model = (backend.serve if backend is not None else serve_engine)(entry.name, engine, self.log)
        entry.load_seconds = time.perf_counter() - t0
        entry.loaded_at = time.time()
        where = f"{engine.cache_stats()['kv_blocks_total']} KV blocks" if backend is None else f"on {backend.url}"
        self.log(f"model {entry.name} loaded in {entry.load_seconds:.1f} s (context {engine.max_model_len} tokens, "
                 f"{where}){'; ready' if self.pinned else ''}")
        aloop.call_soon_threadsafe(entry.ready.set)
        failure = served.loop.run()  # a backend's loop ends with its one line when the backend dies
        if failure and not self.closing:
            aloop.call_soon_threadsafe(self._load_failed, entry,
                                       APIError(502, failure, "upstream_error", code="engine_failed"))

    def _build(self, entry: PoolEntry, build: Callable, aloop: asyncio.AbstractEventLoop):
        """build() on the model's thread -> what it made, or None: a failure is logged and answered
        to every waiting request; a pool closing meanwhile drops the result."""
        try:
            made = build()
        except BaseException as e:  # noqa: BLE001 - answered to every waiting request
            self.log(f"Error: could not load {entry.name}: {e}")
            aloop.call_soon_threadsafe(self._load_failed, entry, load_error(entry.name, e))
            return None
        return None if self.closing else made

    def _load_failed(self, entry: PoolEntry, err: APIError) -> None:
        entry.error = err
        if self.loaded.get(entry.name) is entry:
            del self.loaded[entry.name]
        entry.ready.set()
        if self.pinned is not None:  # the one model cannot load: the server has nothing to serve
            self.load_error = err.message
            self.on_fatal()

    # ---- unloading -------------------------------------------------------------------------------
    async def _unload(self, entry: PoolEntry, why: str) -> None:
        if self.loaded.get(entry.name) is not entry:
            return
        del self.loaded[entry.name]
        await entry.ready.wait()
        if entry.model is not None:
            await asyncio.to_thread(entry.model.loop.close)
        entry.model = None
        await asyncio.to_thread(gc.collect)  # the engine's tensors go now, not at some later collection
        self.log(f"model {entry.name} unloaded ({why})")

    def _unload_later(self, entry: PoolEntry) -> None:
        async def run():
            async with self._lock:
                if entry.active == 0:
                    await self._unload(entry, "keep_alive 0")
        asyncio.get_running_loop().create_task(run())

    async def unload(self, name: str) -> bool:
        """Unload `name` now if it is loaded and idle (keep_alive 0 on an empty request, rm); the
        pinned model stays."""
        if self.pinned is not None:
            return False
        async with self._lock:
            entry = self.loaded.get(name)
            if entry is None:
                return False
            if entry.active:
                entry.keep_alive = 0  # unloaded when its last request ends
                return True
            await self._unload(entry, "requested")
            return True

    def start(self) -> None:
        aloop = asyncio.get_running_loop()
        if self.pinned is not None:
            entry = self.loaded[self.pinned.name] = PoolEntry(self.pinned.name, 0, keep_alive=-1)
            threading.Thread(target=self._run_engine, args=(entry, self.pinned.load, aloop),
                             name="localllm-engine", daemon=True).start()
            return
        self._reaper = aloop.create_task(self._reap())

    def status(self) -> tuple[bool, str | None]:
        """(ready to answer, the load error): a pinned pool is ready once its model is loaded,
        an on-demand one at once (models load when asked for)."""
        if self.pinned is None:
            return True, None
        entry = self.loaded.get(self.pinned.name)
        return entry is not None and entry.ready.is_set() and entry.error is None, self.load_error

    async def _reap(self) -> None:
        """Unload idle models whose keep_alive ran out."""
        while not self.closing:
            await asyncio.sleep(1.0)
            now = time.time()
            async with self._lock:
                for entry in list(self.loaded.values()):
                    if entry.active == 0 and entry.expires_at is not None and entry.expires_at <= now:
                        await self._unload(entry, "keep_alive expired")

    def begin_shutdown(self) -> None:
        self.closing = True
        for entry in list(self.loaded.values()):
            if entry.model is not None:
                entry.model.loop.close(timeout=0)

    async def close(self) -> None:
        self.closing = True
        if self._reaper is not None:
            self._reaper.cancel()
        for entry in list(self.loaded.values()):
            if entry.model is not None:
                await asyncio.to_thread(entry.model.loop.close)
        self.loaded.clear()
