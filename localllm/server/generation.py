"""The engine side of `localllm serve`: the one thread that owns an engine (EngineLoop), a loaded
model as requests use it (ServedModel, made by serve_engine for a pinned model and one loaded on
demand alike), the server-wide admission count (Admission) and the engine requests behind one
HTTP request (Generation). Every API's routes run on these, over the model pool (pool.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from . import openai_schema as oai
from .metrics import ServerMetrics
from .openai_schema import APIError

if TYPE_CHECKING:  # for the annotations only: importing the engine loads torch
    from ..engine.engine import LLMEngine, RequestOutput
    from ..model.vision import ImagePrompt
    from ..sampling import SamplingParams
    from ..tokenizer import LLMTokenizer


Prompt = Union[str, list[int], list[dict]]  # text, token ids, or chat messages for the template


class ShutdownError(RuntimeError):
    """The server is stopping; in-flight requests are ended with this."""


# ---- the engine loop thread --------------------------------------------------------------------
def _text_of(content) -> str:
    """A message's text: its string, or its text parts (image parts aside)."""
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if p.get("type") == "text")
    return content or ""


@dataclass
class _Pending:
    prompt: list[int] | ImagePrompt  # (localllm.model.vision)
    params: SamplingParams
    request_id: str
    # called with each RequestOutput, or with the exception that ends the request
    sink: Callable[[RequestOutput | BaseException], None]
    done: Callable[[BaseException | None], None]  # admission result


class EngineLoop:
    """The one thread that calls engine.add_request / step / abort."""

    def __init__(self, engine: LLMEngine, log: Callable[[str], None] = print):
        self.engine = engine
        self.log = log
        self._cv = threading.Condition()
        self._adds: list[_Pending] = []
        self._aborts: list[str] = []
        self._sinks: dict[str, Callable[[RequestOutput | BaseException], None]] = {}
        self._closed = False
        self.stats: dict = engine.cache_stats()  # snapshot, refreshed by the loop thread
        self.pending = 0  # submitted, not yet admitted (read by the 429 check)
        self._thread: threading.Thread | None = None

    def submit(self, p: _Pending) -> None:
        with self._cv:
            if self._closed:
                p.done(ShutdownError("the server is shutting down"))
                return
            self._adds.append(p)
            self.pending += 1
            self._cv.notify()

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread; every live request gets a ShutdownError."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        t = self._thread
        if t is not None and t.is_alive() and threading.current_thread() is not t:
            t.join(timeout)

    def run(self) -> None:
        """The loop, in the calling thread, until close()."""
        self._thread = threading.current_thread()
        engine = self.engine
        while True:
            with self._cv:
                while not (self._adds or self._aborts or self._closed or engine.has_unfinished()):
                    self._cv.wait()
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                closed = self._closed
            for p in adds:  # before aborts: an abort may name a request submitted in the same batch
                try:
                    engine.add_request(p.prompt, p.params, p.request_id)
                except Exception as e:  # noqa: BLE001 - the handler maps it to an HTTP answer
                    p.done(e)
                else:
                    self._sinks[p.request_id] = p.sink
                    p.done(None)
                with self._cv:
                    self.pending -= 1
            for rid in aborts:
                engine.abort(rid)
                self._sinks.pop(rid, None)
            if closed:
                self._fail_all(ShutdownError("the server is shutting down"))
                self.stats = engine.cache_stats()
                return
            if engine.has_unfinished():
                steps = engine.stats["steps"]
                try:
                    outs = engine.step()
                except Exception as e:  # noqa: BLE001 - an engine bug must not kill the server
                    self.log(f"engine step failed: {type(e).__name__}: {e}")
                    self._fail_all(e)
                    outs = []
                for out in outs:
                    sink = self._sinks.get(out.request_id)
                    if sink is not None:
                        sink(out)
                        if out.finished:
                            del self._sinks[out.request_id]
                if engine.stats["steps"] == steps:  # nothing could be scheduled: do not spin
                    with self._cv:
                        self._cv.wait(0.01)
            self.stats = engine.cache_stats()

    def _fail_all(self, exc: BaseException) -> None:
        for rid, sink in list(self._sinks.items()):
            self.engine.abort(rid)
            sink(exc)
        self._sinks.clear()



# ---- a served model and the server's admission count ------------------------------------------
@dataclass
class ServedModel:
    """A loaded model as requests run on it: its engine, the one thread that steps it, and a bound
    on the bytes one token stands for (prompts it proves too long are refused untokenized).
    `backend`: the server that runs it when it is not our engine (vllm_backend: then `engine` and
    `loop` are its ProxyEngine and ProxyLoop, which the routes use the same way)."""

    name: str
    engine: LLMEngine
    loop: EngineLoop
    token_bytes: int | None
    backend: Any = None


def serve_engine(name: str, engine: LLMEngine, log: Callable[[str], None]) -> ServedModel:
    """The one way a ServedModel is made, for a pinned model and one loaded on demand alike; its
    loop is run by the thread that built the engine (pool.py says why)."""
    return ServedModel(name, engine, EngineLoop(engine, log), max_token_bytes(engine.tokenizer))


@dataclass
class Admission:
    """The engine requests in flight server-wide, over every model: at most max_num_seqs (one
    batch) + max_queue waiting, beyond that a 429; `closing`: the server is stopping, no new ones.
    `metrics` is what each request reports to (TTFT, latency, finish reasons)."""

    max_num_seqs: int
    max_queue: int
    metrics: ServerMetrics
    live: int = 0
    closing: bool = False


# ---- one HTTP request's engine requests --------------------------------------------------------
class Generation:
    """The engine requests behind one HTTP request (one per prompt x n) on `model`, and their
    outputs. `max_tokens_param`, `prompt_param` and `constraint_param` are the request's fields that
    errors name (each API spells them its own way); `on_close` is called once when the request is
    over (the pool's release); `template_kwargs` are extra chat template variables (enable_thinking)."""

    def __init__(self, model: ServedModel, admission: Admission, prompts: list[Prompt], params: list[SamplingParams], *,
                 n: int = 1, max_tokens_param: str = "max_tokens", prompt_param: str = "prompt",
                 constraint_param: str | None = None, template_kwargs: dict | None = None,
                 on_close: Callable[[], None] | None = None):
        self.model, self.admission, self.metrics, self.n = model, admission, admission.metrics, n
        self.template_kwargs = template_kwargs or {}
        self.constraint_param = constraint_param
        self.prompt_ids: list[list[int]] = []
        self.on_close = on_close
        self.prompts = prompts
        self.jobs = [(p, params[j]) for p in prompts for j in range(n)]  # choice index = prompt * n + j
        base = oai.new_id("r")
        self.rids = [f"{base}-{i}" for i in range(len(self.jobs))]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.live: set[int] = set()
        self.finals: dict[int, RequestOutput] = {}
        self.max_tokens_param, self.prompt_param = max_tokens_param, prompt_param
        self.t0 = time.perf_counter()
        self.first_token = False
        self.first_token_at: float | None = None  # Ollama's prompt_eval/eval split

    async def start(self) -> None:
        adm = self.admission
        if adm.closing:
            raise APIError(503, "the server is shutting down", "service_unavailable", code="server_shutting_down")
        loop = self.model.loop
        cap = adm.max_num_seqs + adm.max_queue
        if len(self.jobs) > cap:
            raise APIError(400, f"this request needs {len(self.jobs)} sequences (prompts x n) but the server "
                                f"takes at most {cap} at a time", param="n")
        if adm.live + len(self.jobs) > cap:
            raise APIError(429, f"the server is busy: {adm.live} requests in flight and the queue is full "
                                f"(--max-queue {adm.max_queue}); retry shortly", "rate_limit_error",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"})
        aloop = asyncio.get_running_loop()
        for i in range(len(self.jobs)):  # counted from now: tokenizing takes a while
            self.live.add(i)
            adm.live += 1
        try:
            # off the event loop (and off the engine thread, which would stall every stream)
            from ..model.vision import ImagePrompt

            ids = [await asyncio.to_thread(self._encode, p) for p in self.prompts]
            # an ImagePrompt (ids and images) goes to the engine whole; its ids are the prompt's
            self.prompt_ids = [p.ids if isinstance(p, ImagePrompt) else p for p in ids]
            # a constraint compiles here (a worker process, then a thread): never on the event
            # loop, never on the engine's thread (add_request then only copies the matcher)
            for c in dict.fromkeys(p.constraint for _, p in self.jobs if p.constraint is not None):
                await asyncio.to_thread(self.model.engine.grammars.prepare, c)
        except BaseException as e:
            self.close()
            if isinstance(e, Exception):
                raise self._api_error(e) from None
            raise
        futs = []  # a loop closed meanwhile answers each submit with a ShutdownError (503)
        for i, ((_, params), rid) in enumerate(zip(self.jobs, self.rids)):
            fut = aloop.create_future()
            futs.append(fut)
            loop.submit(_Pending(ids[i // self.n], params, rid, self._sink(aloop, i), self._done(aloop, fut)))
        try:
            results = await asyncio.gather(*futs, return_exceptions=True)
        except asyncio.CancelledError:
            self.close()
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.close()
            raise self._api_error(errors[0])

    def _encode(self, prompt: Prompt) -> list[int]:
        """Prompt (text, token ids or chat messages) -> token ids, in a worker thread. Refuses a
        prompt whose bytes alone prove it is longer than the context, without tokenizing it."""
        engine, bound = self.model.engine, self.model.token_bytes
        if bound and not (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            texts = [prompt] if isinstance(prompt, str) else [_text_of(m.get("content")) for m in prompt]
            nbytes = sum(len(t.encode("utf-8")) for t in texts)
            least = nbytes // bound
            if least >= engine.max_model_len:
                what = "messages" if self.prompt_param == "messages" else "prompt"
                raise APIError(400, f"This model's maximum context length is {engine.max_model_len} tokens. "
                                    f"However, your {what} take {nbytes} bytes: at least {least} tokens. "
                                    f"Please reduce the length of the {what}.",
                               param=self.prompt_param, code="context_length_exceeded")
        if self.template_kwargs and isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            return engine.encode_prompt(prompt, **self.template_kwargs)
        return engine.encode_prompt(prompt)

    def reasoning(self) -> tuple[str | None, bool]:
        """(how the model may think: reasoning.reasons, its reply starts inside <think>) for the
        first prompt (chat)."""
        from ..reasoning import opened, reasons

        engine = self.model.engine
        kind = reasons(engine.tokenizer.chat_template)
        if not kind or not self.prompt_ids:
            return None, False
        tail = engine.tokenizer.decode(self.prompt_ids[0][-16:], skip_special_tokens=False)
        return kind, opened(tail)

    def _sink(self, aloop: asyncio.AbstractEventLoop, i: int):
        def deliver(item):  # on the event loop; bookkeeping here, so it never depends on a reader
            self.queue.put_nowait((i, item))
            if isinstance(item, BaseException) or item.finished:
                self._finish(i, None if isinstance(item, BaseException) else item.finish_reason)

        def put(item):
            try:
                aloop.call_soon_threadsafe(deliver, item)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass
        return put

    @staticmethod
    def _done(aloop: asyncio.AbstractEventLoop, fut: asyncio.Future):
        def resolve(exc):
            if not fut.done():
                fut.set_exception(exc) if exc is not None else fut.set_result(None)

        def done(exc):
            try:
                aloop.call_soon_threadsafe(resolve, exc)
            except RuntimeError:
                pass
        return done

    def _api_error(self, e: BaseException) -> APIError:
        from ..chat import ChatTemplateError
        from ..engine.engine import ContextLengthError
        from ..sampling import SamplingError
        from ..structured import ConstraintError

        if isinstance(e, APIError):
            return e
        if isinstance(e, ConstraintError):
            param = self.constraint_param or "response_format"
            return APIError(400, f"{param}: {e}", param=param)
        if isinstance(e, ContextLengthError):
            mt = self.jobs[0][1].max_tokens
            what = "messages" if self.prompt_param == "messages" else "prompt"
            if mt is not None and e.prompt_tokens < e.limit:
                msg = (f"This model's maximum context length is {e.limit} tokens. However, you requested "
                       f"{e.prompt_tokens + mt} tokens ({e.prompt_tokens} in the {what}, {mt} in the completion). "
                       f"Please reduce the length of the {what} or {self.max_tokens_param}.")
                param = self.max_tokens_param
            else:
                msg = (f"This model's maximum context length is {e.limit} tokens. However, your {what} "
                       f"resulted in {e.prompt_tokens} tokens. Please reduce the length of the {what}.")
                param = self.prompt_param
            return APIError(400, msg, param=param, code="context_length_exceeded")
        if isinstance(e, SamplingError):
            param = self.max_tokens_param if e.param == "max_tokens" else e.param
            return APIError(400, str(e).replace("max_tokens", param, 1), param=param)
        if isinstance(e, ChatTemplateError):
            return APIError(400, str(e), param="messages")
        if isinstance(e, ShutdownError):
            return APIError(503, str(e), "service_unavailable", code="server_shutting_down")
        if isinstance(e, ValueError):  # e.g. token ids out of range, empty prompt
            return APIError(400, f"{self.prompt_param}: {e}", param=self.prompt_param)
        return APIError(500, f"internal error: {type(e).__name__}: {e}", "internal_error")

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, RequestOutput) until every choice finished (or the client went away)."""
        while len(self.finals) < len(self.jobs):
            i, item = await self.queue.get()
            if i is None:  # see watch_disconnect
                return
            if isinstance(item, BaseException):
                raise self._api_error(item)
            if item.finish_reason == "error":  # the constraint's matcher failed: never a stop
                param = self.constraint_param or "response_format"
                raise APIError(400, f"{param}: {item.error}", param=param)
            if not self.first_token and item.new_token_ids:
                self.first_token = True
                self.first_token_at = time.perf_counter()
                self.metrics.ttft.observe(time.perf_counter() - self.t0)
            if item.finished:
                self.finals[i] = item
            yield i, item
        self.metrics.e2e.observe(time.perf_counter() - self.t0)

    async def watch_disconnect(self, request: Request) -> None:
        """For non-streaming answers: abort at once when the client hangs up (streams get this from
        Starlette, which cancels the event generator)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.close()
        self.queue.put_nowait((None, None))

    async def collect(self, request: Request) -> bool:
        """Run to the end; False if the client disconnected first."""
        watcher = asyncio.create_task(self.watch_disconnect(request))
        try:
            async for _ in self.outputs():
                pass
        finally:
            watcher.cancel()
            self.close()
        return len(self.finals) == len(self.jobs)

    def _finish(self, i: int, reason: str | None) -> None:
        if i in self.live:
            self.live.discard(i)
            self.admission.live -= 1
            self.metrics.finished[reason or "error"] += 1

    def close(self) -> None:
        """Abort whatever is still running (client gone, error, shutdown)."""
        for i in list(self.live):
            self.model.loop.abort(self.rids[i])
            self._finish(i, "abort")
        if self.on_close is not None:
            on_close, self.on_close = self.on_close, None
            on_close()

    def usage(self) -> dict:
        finals = [self.finals.get(i) for i in range(len(self.jobs))]
        firsts = [o for i, o in enumerate(finals) if o is not None and i % self.n == 0]
        return oai.usage(sum(o.num_prompt_tokens for o in firsts),
                         sum(len(o.token_ids) for o in finals if o is not None),
                         sum(o.num_cached_tokens for o in firsts))



def max_token_bytes(tokenizer: LLMTokenizer) -> int | None:
    """An upper bound on the input bytes one token can stand for, so that len(bytes) // bound
    tokens at least: the longest vocabulary entry in UTF-8 (byte-level and SentencePiece entries
    take at least as many bytes as the text they match), x3 when a normalizer may shrink the text
    first (NFC composes three 3-byte jamo into one 3-byte syllable). None when a token may stand
    for unbounded text (an unknown-word token without byte fallback, non-BPE models)."""
    tok = getattr(tokenizer, "tok", None)
    model = getattr(tok, "model", None)
    if type(model).__name__ != "BPE" or (model.unk_token is not None and not model.byte_fallback):
        return None
    longest = max((len(t.encode("utf-8")) for t in tok.get_vocab(with_added_tokens=True)), default=0)
    return longest * (1 if tok.normalizer is None else 3) or None


def sse_response(gen: Generation, events: AsyncIterator[str]) -> StreamingResponse:
    # background=gen.close: runs however the response ends, even when the client left before the
    # event generator was first iterated (then its own `finally` never runs)
    return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(gen.close),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
