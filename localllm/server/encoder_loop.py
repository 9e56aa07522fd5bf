"""The thread that owns a loaded encoder (an embedding model or a reranker) in `localllm serve`.

As with EngineLoop (generation.py), one thread enters torch for the model (one OpenMP team), and
HTTP handlers never run a forward on the event loop: they submit a job and await its future.
Jobs waiting together run in one call of the embedder, so concurrent requests share forwards
(their inputs are packed into the same batches)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.embedder import Embedder, Encoded

MAX_JOB_INPUTS = 2048  # inputs of the jobs run together (bounds one embedder call)

# the keys /metrics reads from each loaded model's stats (an encoder generates nothing and keeps no KV)
_ZERO_STATS = ("generated_tokens", "cached_tokens", "running", "waiting", "kv_blocks_used", "kv_blocks_total",
               "captured_steps", "preemptions", "max_batch_size")


@dataclass
class Job:
    kind: str  # "embed" | "score"
    enc: Encoded
    dimensions: int | None
    future: asyncio.Future
    aloop: asyncio.AbstractEventLoop
    result: Any = field(default=None)


class EncoderLoop:
    def __init__(self, embedder: Embedder, log: Callable[[str], None] = print):
        self.embedder, self.log = embedder, log
        self.stats: dict = {**dict.fromkeys(_ZERO_STATS, 0), "prompt_tokens": 0, "steps": 0, "hit_rate": 0.0,
                            "speculative": None}
        self.pending = 0
        self._jobs: list[Job] = []
        self._cv = threading.Condition()
        self._closed = False
        self._done = threading.Event()

    async def run_job(self, kind: str, enc: Encoded, dimensions: int | None = None):
        """The job's result (a tensor of vectors or scores), computed on the loop's thread."""
        aloop = asyncio.get_running_loop()
        job = Job(kind, enc, dimensions, aloop.create_future(), aloop)
        with self._cv:
            if self._closed:
                raise RuntimeError("the model is being unloaded")
            self._jobs.append(job)
            self.pending += 1
            self._cv.notify()
        return await job.future

    def close(self, timeout: float | None = 5.0) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        if timeout:
            self._done.wait(timeout)

    def run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._jobs and not self._closed:
                        self._cv.wait()
                    if self._closed:
                        jobs, self._jobs = self._jobs, []
                        for job in jobs:
                            self._finish(job, RuntimeError("the model was unloaded"))
                        return
                    jobs, n = [], 0
                    while self._jobs and (not jobs or n + len(self._jobs[0].enc.ids) <= MAX_JOB_INPUTS):
                        jobs.append(self._jobs.pop(0))
                        n += len(jobs[-1].enc.ids)
                    self.pending -= len(jobs)
                self._run(jobs)
        finally:
            self._done.set()

    def _run(self, jobs: list[Job]) -> None:
        """Jobs of one kind and one `dimensions` run as one embedder call: their inputs share forwards."""
        groups: dict[tuple, list[Job]] = {}
        for job in jobs:
            groups.setdefault((job.kind, job.dimensions), []).append(job)
        for (kind, dims), group in groups.items():
            enc = Encoded([x for j in group for x in j.enc.ids], [x for j in group for x in j.enc.types])
            try:
                out = self.embedder.embed(enc, dims) if kind == "embed" else self.embedder.score(enc)
            except Exception as e:  # noqa: BLE001 - answered to the requests, the loop goes on
                for job in group:
                    self._finish(job, e)
                continue
            self.stats["prompt_tokens"] += enc.num_tokens
            self.stats["steps"] += len(self.embedder.batches(enc))
            start = 0
            for job in group:
                n = len(job.enc.ids)
                self._finish(job, None, out[start:start + n])
                start += n

    @staticmethod
    def _finish(job: Job, error: BaseException | None, value=None) -> None:
        def settle():
            if job.future.done():  # the request was cancelled (the client left)
                return
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(value)
        try:
            job.aloop.call_soon_threadsafe(settle)
        except RuntimeError:  # the event loop is gone (shutdown)
            pass


@dataclass
class ServedEncoder:
    """A loaded encoder as requests run on it (the pool's twin of generation.ServedModel)."""

    name: str
    engine: Embedder
    loop: EncoderLoop
    token_bytes: int | None = None
