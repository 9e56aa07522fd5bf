"""The runner's captured step on CPU: the compiled forward's AOTInductor packages (made and
cached by localllm.model.compiled), loaded when they are on disk and run for the steps they
cover; the CUDA graphs (cuda_graphs) are the same role on a GPU. A missing package is asked of
the cache (queued for the background builder), never built here.
"""

from __future__ import annotations

import logging
import subprocess
import time

import torch

from ..model.attention import AttnMeta
from ..model.compiled import (
    KINDS,
    Package,
    build_queued,
    builder_running,
    busy_flag,
    cache_dir,
    hint_path,
    kind_of,
    load_package,
    max_rows,
    note_source,
    package_path,
    queue_build,
    remove_package,
)

log = logging.getLogger(__name__)

CHECK_EVERY_S = 1.0  # how often a running engine looks for a package that is being built


class CompiledStep:
    """The runner's captured step on CPU: run() -> hidden states, or None for a step it
    does not cover (the runner then runs the eager forward). Steps covered: every sequence has a
    cached prefix (decode, speculative verify, prefix-hit extend) and at most max_rows() new
    tokens in all. `background`: a missing package is queued for the background builder once
    (chat, serve; a one-shot run only with --build); until it is on disk those steps run eagerly."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], background: bool = True):
        self.model, self.kv_caches = model, kv_caches
        self.caches = [t for kv in kv_caches for t in kv]
        self.kv_dtype = kv_caches[0][0].dtype
        self.max_rows = max_rows(model)
        self.background = background
        self._runners: dict[str, Package] = {}
        self._next_look: dict[str, float] = {}
        self.requested = False  # a build was queued by this engine
        self.builder: subprocess.Popen | None = None  # the builder process this engine started, if it did
        self.failed: str | None = None
        self.steps = 0  # steps served by a package
        self.kinds_used: set[str] = set()
        self._busy = busy_flag()
        self._announced = False
        d1 = package_path(model, "d1", self.kv_dtype)
        if model.origin and d1 is not None and not d1.is_file():
            # said now, before an answer streams: from the first decode step it lands mid-answer
            if not background:
                # once per model: a user who runs the same file every day is told once, not every time
                hinted = hint_path(model, self.kv_dtype)
                if not hinted.exists():
                    log.warning("no compiled step for this model yet: decode runs eagerly; `localllm run --build` "
                                "(or a chat or serve) builds it once in the background")
                    try:
                        hinted.parent.mkdir(parents=True, exist_ok=True)
                        hinted.touch()
                    except OSError:  # a read-only cache: the hint again next time, no harm
                        pass
            else:  # queued already (by another engine, or a builder that died) or about to be
                self._announce()

    def _queued(self) -> bool:
        return build_queued(self.model, self.kv_dtype)

    def _announce(self) -> None:
        if not self._announced:
            self._announced = True
            log.warning("building the compiled step for this model in the background (a few minutes of CPU "
                        "while no answer is being generated, once per model; answers use the eager step "
                        "until then) into %s; `localllm ps` shows it", cache_dir())

    def _runner(self, kind: str) -> Package | None:
        runner = self._runners.get(kind)
        if runner is not None:
            return runner
        now = time.monotonic()
        if now < self._next_look.get(kind, 0.0):
            return None
        self._next_look[kind] = now + CHECK_EVERY_S
        path = package_path(self.model, kind, self.kv_dtype)
        if path is None:
            return None
        if path.is_file():
            try:
                self._runners[kind] = runner = load_package(self.model, path)
                note_source(path, self.model.origin.get("path") if self.model.origin else None)
                return runner
            except Exception as e:  # damaged: never trusted, built again
                log.warning("compiled package %s is damaged (%s); building it again", path.name, e)
                remove_package(path)
        self._request_build()
        return None

    def _request_build(self) -> None:
        """Queue this model's missing packages (once) and make sure the builder runs."""
        if not self.background or self.requested or not self.model.origin:
            return
        paths = [package_path(self.model, k, self.kv_dtype) for k in KINDS]
        if all(p is not None and p.is_file() for p in paths):
            return
        self.requested = True
        self._announce()
        self.builder = queue_build(self.model, self.kv_dtype) or self.builder

    def busy(self, busy: bool) -> None:
        """The engine has work (True) or has none left (False). The background build runs only
        while no engine of this home generates: beside a decode, even at SCHED_IDLE, it cut
        eager decode from 47 to 2.7 tok/s on 2 cores (OpenMP's spinning threads lose their CPUs;
        bench/build_slowdown.py). So a busy engine holds the shared busy lock and stops the
        builder's worker; the last one to finish continues it (see build_queue): a chat builds
        while the user reads and types, a server between requests."""
        self._busy.set(busy)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta):
        T = ids.shape[0]
        if self.failed or T > self.max_rows or not meta.all_cached:
            return None
        kind = kind_of(len(meta.q_lens), T)
        runner = self._runner(kind)
        if runner is None:
            return None
        tables = meta.block_tables
        if tables.shape[1] < 2:  # the packages take tables of 2+ columns: pad with the null block
            tables = torch.nn.functional.pad(tables, (0, 2 - tables.shape[1]))
        try:
            out = runner(ids, positions, meta.slot_mapping, tables, meta.cu_seqlens_q, meta.context_lens,
                         *self.caches)
        except Exception as e:  # a compiler problem must not take the engine down
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("compiled step disabled, using eager: %s", self.failed)
            return None
        self.steps += 1
        self.kinds_used.add(kind)
        return out[0]

    @property
    def ready(self) -> bool:
        return "d1" in self._runners

    def wait(self, kinds: tuple[str, ...] = KINDS, timeout: float = 900.0) -> bool:
        """Block until the packages of `kinds` are loaded (benchmarks, tests), queueing the
        build when nobody builds them; False on timeout or when builds keep failing."""
        deadline, tries = time.monotonic() + timeout, 0
        self.busy(False)
        while time.monotonic() < deadline:
            for k in kinds:
                self._next_look.pop(k, None)
                self._runner(k)
            if all(k in self._runners for k in kinds):
                return True
            ours = self.builder is not None and self.builder.poll() is None  # (still taking its lock)
            if not self._queued() or (not builder_running() and not ours):  # nobody will build it
                if tries == 2 or not self.background:
                    return False
                self.requested, tries = False, tries + 1
                self._request_build()
            time.sleep(0.2)
        return False
