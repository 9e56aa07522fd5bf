"""Fill-in-the-middle on `localllm serve`: llama.cpp's /infill (input_prefix, input_suffix,
input_extra files, prompt; answered and streamed like its /completion) and the hook the other
routes call for `suffix` (/v1/completions, Ollama's /api/generate). The FIM format and prompt
come from localllm.fim; this module only maps requests and answers.

Editors (llama.vim, llama.vscode) send llama.cpp's runtime knobs with every keystroke
(cache_prompt, samplers, t_max_predict_ms, n_indent, id_slot, ...): those are accepted and
ignored, as llama.cpp itself ignores what it does not know; the prefix cache is always on.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Union

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from ..fim import FimError, FimRequest, detect, render
from . import openai_schema as oai
from .generation import Generation, ServedModel, sse_response
from .openai_schema import APIError

if TYPE_CHECKING:  # for the annotations only: it loads torch
    from ..sampling import SamplingParams
    from .state import ServerState


async def fim_prompt(target: ServedModel, req: FimRequest, params: list[SamplingParams], param: str = "suffix"
                     ) -> list[int]:
    """`req` rendered with the model's FIM tokens (off the event loop: tokenizing a file takes a
    while); each SamplingParams in `params` also stops at the tokens that end an infill. A model
    without FIM tokens is a 400 naming it."""
    tok = target.engine.tokenizer

    def build() -> tuple[list[int], list[int]]:
        fmt = detect(tok)
        if fmt is None:
            raise FimError(f"{target.name} cannot fill in the middle: its tokenizer has no FIM tokens "
                           "(<|fim_prefix|>/<|fim_suffix|>/<|fim_middle|>, <fim_prefix>, <PRE>/<SUF>/<MID>, "
                           "<｜fim▁begin｜>, [PREFIX]/[SUFFIX], or GGUF tokenizer.ggml.fim_*_token_id); use a "
                           "coder model such as qwen2.5-coder-0.5b")
        return render(tok, fmt, req), fmt.stop_ids()
    try:
        ids, stops = await asyncio.to_thread(build)
    except FimError as e:
        raise APIError(400, str(e), param=param, code="model_cannot_infill") from None
    for p in params:
        p.stop_token_ids = list(dict.fromkeys([*p.stop_token_ids, *stops]))
    return ids


def text_fim(prompt: Any, suffix: str) -> FimRequest:
    """/v1/completions with a suffix: the prompt is the text before the hole (OpenAI's insert mode;
    any suffix, even "", asks for it)."""
    if not isinstance(prompt, str):
        raise APIError(400, "suffix needs a text prompt (the text before the insertion), not token ids",
                       param="suffix")
    return FimRequest(prompt, suffix)


def ollama_fim(prompt: str, suffix: str, system: str | None) -> FimRequest:
    """/api/generate with a suffix: Ollama renders its template's FIM branch (prompt and suffix
    only); with or without `raw` the FIM tokens are no chat template, so both modes insert.
    `system` has no place in a FIM prompt: refused rather than dropped."""
    if system:
        raise APIError(400, "system cannot be combined with suffix (a fill-in-the-middle prompt has no system "
                            "message)", param="system")
    return FimRequest(prompt, suffix)


# ---- llama.cpp's /infill -------------------------------------------------------------------------
class ExtraFile(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    text: str
    filename: str = "tmp"


class InfillRequest(oai._Request):
    """llama.cpp's /infill body, with its /completion sampling fields and defaults."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraFile] = Field(default_factory=list)
    prompt: str = ""  # the text right before the cursor, after input_prefix
    n_predict: int = -1  # -1: until the model stops or the context is full
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = Field(default=-1, ge=-(2 ** 63), lt=2 ** 64)  # -1: random, as llama.cpp
    stop: Union[str, list[str]] = Field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False


def _sampling(body: InfillRequest):
    from ..sampling import SamplingError, SamplingParams

    n = body.n_predict
    try:
        return SamplingParams(
            max_tokens=None if n < 0 else n, temperature=body.temperature, top_p=body.top_p,
            top_k=body.top_k, min_p=body.min_p, repetition_penalty=body.repeat_penalty,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            seed=None if body.seed == -1 else body.seed, stop=body.stop, ignore_eos=body.ignore_eos)
    except SamplingError as e:
        name = {"max_tokens": "n_predict", "repetition_penalty": "repeat_penalty"}.get(e.param, e.param)
        raise APIError(400, f"{name}: {e}", param=name) from None


def _stop_type(out, stops: set[int]) -> str:
    if out.finish_reason == "length":
        return "limit"
    return "eos" if out.token_ids and out.token_ids[-1] in stops else "word"


def _final(gen, out, name: str, stops: set[int], end: float, content: str) -> dict:
    """llama.cpp's last /completion object: the stop reason, counts and timings (ms)."""
    first = gen.first_token_at or end
    prompt_ms, predicted_ms = (first - gen.t0) * 1e3, (end - first) * 1e3
    n_new, n_prompt, cached = len(out.token_ids), out.num_prompt_tokens, out.num_cached_tokens
    return {"index": 0, "content": content, "tokens": [], "id_slot": 0, "stop": True, "model": name,
            "tokens_predicted": n_new, "tokens_evaluated": n_prompt, "tokens_cached": n_prompt + n_new,
            "truncated": False, "stop_type": _stop_type(out, stops), "stopping_word": "",
            "timings": {"cache_n": cached, "prompt_n": n_prompt - cached, "prompt_ms": prompt_ms,
                        "prompt_per_second": (n_prompt - cached) / (prompt_ms / 1e3) if prompt_ms > 0 else 0.0,
                        "predicted_n": n_new, "predicted_ms": predicted_ms,
                        "predicted_per_second": n_new / (predicted_ms / 1e3) if predicted_ms > 0 else 0.0}}


def _sse(obj: dict) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def router(state: ServerState) -> APIRouter:
    """llama.cpp's POST /infill over `state` (the server's model pool, admission and metrics)."""
    api = APIRouter()

    @api.post("/infill")
    async def infill_route(body: InfillRequest, request: Request):
        return await _infill(state, body, request)
    return api


async def _infill(state: ServerState, body: InfillRequest, request: Request):
    state.metrics.http_requests += 1
    target, release = await state.acquire(body.model)
    try:
        params = _sampling(body)
        engine = target.engine
        ctx = engine.max_model_len
        # the extra files fill what the context has left (cut from their start, as llama.cpp
        # does); the prefix and suffix are never cut: too long for the context is a 400
        reserve = params.max_tokens if params.max_tokens is not None else ctx // 4
        req = FimRequest(body.input_prefix, body.input_suffix, body.prompt,
                         [f.model_dump() for f in body.input_extra], repo_level=True,
                         max_prompt_tokens=max(0, ctx - reserve))
        ids = await fim_prompt(target, req, [params], "input_prefix")
        stops = set(params.stop_token_ids) | set(engine.tokenizer.eos_ids)
        gen = Generation(target, state.admission, [ids], [params], max_tokens_param="n_predict",
                         prompt_param="input_prefix", on_close=release)
        await gen.start()
    except BaseException:
        release()
        raise
    name = target.name
    if not body.stream:
        if not await gen.collect(request):
            return Response(status_code=499)
        out = gen.finals[0]
        return _final(gen, out, name, stops, time.perf_counter(), out.text)

    async def events() -> AsyncIterator[str]:
        try:
            async for _, out in gen.outputs():
                if out.delta:
                    yield _sse({"index": 0, "content": out.delta, "tokens": list(out.new_token_ids), "stop": False,
                                "id_slot": 0, "tokens_predicted": len(out.token_ids),
                                "tokens_evaluated": out.num_prompt_tokens})
                if out.finished:
                    yield _sse(_final(gen, out, name, stops, time.perf_counter(), ""))
        except APIError as e:  # after the headers: an error event, as llama.cpp sends it
            state.metrics.errors[e.status] += 1
            yield _sse(e.body())
        finally:
            gen.close()
    return sse_response(gen, events())
