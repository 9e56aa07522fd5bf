"""OpenAI's routes: /v1/models, /v1/chat/completions and /v1/completions, and vLLM's /tokenize and
/detokenize. A request's fields become one SamplingParams per choice and a Generation on the model
it names; the answer goes back whole or as server-sent events, in OpenAI's wire format
(openai_schema.py), each chat reply read through the one ReplyStream (reply_stream.py).
start_chat is how every chat-shaped API (chat completions, Responses, Anthropic Messages) reaches
the engine: responses.py and anthropic.py call it with their requests translated.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..reply_stream import ReplyStream
from . import infill
from . import openai_schema as oai
from .generation import Generation, ServedModel, sse_response
from .openai_schema import APIError
from .state import ServerState

if TYPE_CHECKING:  # for the annotations only: these load torch and llguidance
    from ..sampling import SamplingParams
    from ..structured import Constraint


def router(state: ServerState) -> APIRouter:
    """OpenAI's routes over `state` (the server's model pool, admission and metrics)."""
    api = APIRouter()

    @api.get("/v1/models")
    async def models():
        state.require_ready()
        return {"object": "list", "data": [state.pool.model_card(m) for m in await state.pool.catalog()]}

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        state.require_ready()
        return state.pool.model_card(await state.pool.find(model_id))

    @api.post("/v1/chat/completions")
    async def chat_completions(body: oai.ChatCompletionRequest, request: Request):
        return await _on_model(state, _chat_completion, body, request)

    @api.post("/v1/completions")
    async def completions(body: oai.CompletionRequest, request: Request):
        return await _on_model(state, _completion, body, request)

    @api.post("/tokenize")
    async def tokenize(body: oai.TokenizeRequest):
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of 'prompt' or 'messages'", param="prompt")
        from ..chat import ChatTemplateError

        served, release = await state.acquire(body.model)
        engine = served.engine
        try:  # rendering and encoding off the event loop, as for generation requests
            if body.messages is not None:
                fetched = await oai.fetch_image_urls(body.messages, state.cfg.image_urls)
                tokens = await asyncio.to_thread(engine.encode_prompt, oai.message_dicts(body.messages, fetched))
            else:
                tokens = await asyncio.to_thread(engine.tokenizer.encode, body.prompt,
                                                 add_special_tokens=body.add_special_tokens)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None
        finally:
            release()
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}

    @api.post("/detokenize")
    async def detokenize(body: oai.DetokenizeRequest):
        served, release = await state.acquire(body.model)
        try:
            engine = served.engine
            vocab = engine.model_config.vocab_size
            bad = [t for t in body.tokens if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"token ids must be in 0..{vocab - 1}, got {bad[0]}", param="tokens")
            return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, body.tokens)}
        finally:
            release()

    return api


async def _on_model(state: ServerState, handler: Callable[..., Awaitable[Any]], body: oai._SamplingRequest,
                    request: Request):
    """Run a /v1 handler on the model the body names; the model stays in use (pool mode)
    until the response ends, or is released here when the handler fails."""
    state.metrics.http_requests += 1
    served, release = await state.acquire(body.model, task="chat" if "chat" in request.url.path else "generate")
    try:
        return await handler(state, body, request, served, release)
    except BaseException:
        release()
        raise


async def _chat_completion(state: ServerState, body: oai.ChatCompletionRequest, request: Request, served: ServedModel,
                           release: Callable[[], None]):
    chat = await start_chat(state, body, served, release)
    gen, tools, legacy, thinks, inside = chat.gen, chat.tools, chat.legacy, chat.reasons, chat.inside
    rid, created, name = oai.new_id("chatcmpl"), oai.now(), served.name
    token_text = _token_text(served.engine)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(gen, _chat_events(gen, rid, created, name, include_usage, body.logprobs, token_text,
                                         thinks, inside, tools, legacy))
    if not await gen.collect(request):  # the client went away
        return Response(status_code=499)
    choices = [oai.chat_choice(i, chat.reply().whole(o.text), o.finish_reason,
                               oai.chat_logprobs(o.logprobs, token_text) if body.logprobs else None,
                               thinks, legacy)
               for i, o in sorted(gen.finals.items())]
    return oai.chat_response(rid, created, name, choices, gen.usage())


async def _completion(state: ServerState, body: oai.CompletionRequest, request: Request, served: ServedModel,
                      release: Callable[[], None]):
    _check_common(body, body.max_tokens, "max_tokens", served.engine.model_config.vocab_size)
    for param, bad in (("echo", body.echo), ("best_of", (body.best_of or 1) > 1)):
        if bad:
            raise APIError(400, f"{param} is not supported by this server", param=param)
    if body.logprobs is not None and not 0 <= body.logprobs <= 20:
        raise APIError(400, f"logprobs must be between 0 and 20, got {body.logprobs}", param="logprobs")
    prompt = body.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or any(not p for p in prompts):
        raise APIError(400, "prompt must not be empty", param="prompt")
    if len(prompts) * body.n > 16:
        raise APIError(400, f"at most 16 choices per request (prompts x n), got {len(prompts) * body.n}",
                       param="prompt")
    vocab = served.engine.model_config.vocab_size
    params, constraint_param = _params_list(body, body.max_tokens, "max_tokens", body.logprobs, vocab)
    if body.suffix is not None:  # fill-in-the-middle: each prompt is the text before the hole
        prompts = [await infill.fim_prompt(served, infill.text_fim(p, body.suffix), params) for p in prompts]
    gen = Generation(served, state.admission, prompts, params, n=body.n, constraint_param=constraint_param,
                     on_close=release)
    await gen.start()
    rid, created, name = oai.new_id("cmpl"), oai.now(), served.name
    token_text = _token_text(served.engine)
    want_lp = body.logprobs is not None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(gen, _completion_events(gen, rid, created, name, include_usage, want_lp, token_text))
    if not await gen.collect(request):
        return Response(status_code=499)
    choices = [oai.completion_choice(i, o.text, o.finish_reason,
                                     oai.completion_logprobs(o.logprobs, token_text) if want_lp else None)
               for i, o in sorted(gen.finals.items())]
    return oai.completion_response(rid, created, name, choices, gen.usage())


# ---- request -> engine requests ------------------------------------------------------------------
def _sampling(body: oai._SamplingRequest, max_tokens: int | None, max_tokens_param: str, logprobs: int | None,
              seed_offset: int = 0, constraint=None, logit_bias: dict[int, float] | None = None):
    from ..sampling import SamplingError, SamplingParams

    def pick(v, default):
        return default if v is None else v

    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=pick(body.temperature, 1.0), top_p=pick(body.top_p, 1.0),
            top_k=pick(body.top_k, 0), min_p=pick(body.min_p, 0.0),
            repetition_penalty=pick(body.repetition_penalty, 1.0),
            presence_penalty=pick(body.presence_penalty, 0.0), frequency_penalty=pick(body.frequency_penalty, 0.0),
            seed=None if body.seed is None else body.seed + seed_offset,  # n>1: one per choice
            stop=[] if body.stop is None else body.stop, stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            logprobs=logprobs, min_tokens=body.min_tokens, constraint=constraint, logit_bias=logit_bias)
    except SamplingError as e:
        param = max_tokens_param if e.param == "max_tokens" else e.param
        raise APIError(400, str(e).replace("max_tokens", param, 1), param=param) from None


def _structured(body: oai._SamplingRequest) -> tuple[str, Constraint] | None:
    """(field, Constraint) of the request's structured-output field, if it sets one."""
    from . import output_format

    rf = output_format.response_format(body.response_format)
    vllm = output_format.vllm_fields(body.model_extra or {})
    if rf is not None and vllm is not None:
        raise APIError(400, f"send either response_format or {vllm[0]}, not both", param=vllm[0])
    return (output_format.response_format_field(body.response_format), rf) if rf is not None else vllm


def _check_common(body: oai._SamplingRequest, max_tokens: int | None, max_tokens_param: str, vocab: int) -> None:
    bad = body.unsupported()
    if bad:
        raise APIError(400, bad[1], param=bad[0])
    if not 1 <= body.n <= 16:
        raise APIError(400, f"n must be between 1 and 16, got {body.n}", param="n")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if max_tokens is not None and max_tokens >= 1 and body.min_tokens > max_tokens:  # < 1: SamplingParams names it
        raise APIError(400, f"min_tokens ({body.min_tokens}) must not exceed {max_tokens_param} ({max_tokens})",
                       param="min_tokens")
    out = [t for t in body.stop_token_ids or [] if not 0 <= t < vocab]
    if out:
        raise APIError(400, f"stop_token_ids must be in 0..{vocab - 1}, got {out[0]}", param="stop_token_ids")


def _params_list(body, max_tokens, max_tokens_param, logprobs, vocab: int,
                 forced: tuple[str, Constraint] | None = None) -> tuple[list[SamplingParams], str | None]:
    """One SamplingParams per choice, and the field the constraint came from (None: no constraint).
    `forced`: (field, constraint) of a tool call the request demands."""
    found = _structured(body)
    if forced is not None and found is not None:
        raise APIError(400, f"{found[0]} cannot be combined with forcing a tool call ({forced[0]})", param=found[0])
    found = found or forced
    field_, constraint = found if found else (None, None)
    bias = body.token_bias(vocab)
    return [_sampling(body, max_tokens, max_tokens_param, logprobs, j, constraint, bias)
            for j in range(body.n)], field_


def _tool_setup(body: oai.ChatCompletionRequest, template: str | None
                ) -> tuple[dict | None, bool, list | None, tuple[str, Constraint] | None]:
    """(offered tools: name -> parameters, None when no call can come, a GenericTools when the
    template takes none; whether the deprecated functions API asked; the tools as sent; (field,
    constraint) holding the reply to a call, or for generic tools to a call or a JSON answer)."""
    from .. import tool_calls
    from ..generic_calls import GenericTools
    from . import generic_tools, output_format
    from . import tools as tc

    legacy = body.functions is not None or body.function_call is not None
    if legacy and (body.tools is not None or body.tool_choice is not None):
        raise APIError(400, "send tools/tool_choice or the deprecated functions/function_call, not both",
                       param="functions")
    if legacy:
        if not isinstance(body.functions or [], list):
            raise APIError(400, "functions must be a list of function definitions", param="functions")
        raw = [{"type": "function", "function": f} for f in body.functions or []]
        fc = body.function_call
        choice_in, p_tools, p_choice = ({"type": "function", "function": fc} if isinstance(fc, dict) else fc,
                                        "functions", "function_call")
    else:
        raw, choice_in, p_tools, p_choice = body.tools or [], body.tool_choice, "tools", "tool_choice"
    try:
        tools = tc.check_tools(raw, p_tools)
        choice = tc.choice_of(choice_in, tools, p_choice)
    except tc.ToolError as e:
        raise APIError(400, str(e), param=e.param) from None
    if choice == "none" or not tools:  # as vLLM: with 'none' the tools are not shown to the model
        return None, legacy, None, None
    if not generic_tools.takes_tools(template):  # told in a system message, the reply held to JSON
        # with 'auto' an answer may come: held to response_format's schema when the request sets one
        answer = generic_tools.answer_of(output_format.response_format(body.response_format)) \
            if choice == "auto" else None
        constraint = output_format.make(p_tools, "json_schema", generic_tools.schema(tools, choice, answer))
        return GenericTools(tools, answer), legacy, raw, (p_tools, constraint)
    forced = None
    if choice != "auto":
        grammar = tool_calls.forcing_grammar(tools, choice, tool_calls.style_of(template))
        forced = (p_tools, output_format.make(p_tools, "grammar", grammar))  # p_tools: what a compile error names
    return tools, legacy, raw, forced


@dataclass
class ChatStart:
    """A chat request on its way: its engine requests (started unless asked not to), and how its
    reply is read (the ReplyStream's arguments): the offered tools (None: no calls come; a
    GenericTools: the generic format), the deprecated functions API, `reasons` (a reasoning model)
    and `inside` (its reply starts inside <think>); both False until the requests are started."""

    gen: Generation
    tools: dict | None
    legacy: bool
    reasons: bool = False
    inside: bool = False

    def reply(self) -> ReplyStream:
        """A stream that reads one choice's reply."""
        return ReplyStream(self.reasons, self.inside, self.tools)


async def start_translated_chat(state: ServerState, body: oai.ChatCompletionRequest, names: list[tuple[str, str]],
                                start: bool = True) -> tuple[ServedModel, Callable[[], None], ChatStart]:
    """For an API translated into a chat request (Responses, Anthropic Messages): the model it names,
    acquired, and start_chat on it; an error names that API's fields (`names`: chat field, its own)."""
    served, release = await state.acquire(body.model, task="chat")
    try:
        return served, release, await start_chat(state, body, served, release, start=start)
    except APIError as e:
        release()
        raise e.renamed(names) from None
    except BaseException:
        release()
        raise


async def start_chat(state: ServerState, body: oai.ChatCompletionRequest, served: ServedModel,
                     release: Callable[[], None], start: bool = True) -> ChatStart:
    """Check a chat request, render its messages (the tools through the template, or described for
    generic tool calling) and, with `start`, submit it to the model's engine. The one way every
    chat-shaped API (chat completions, Responses, Anthropic Messages) reaches the engine."""
    from ..generic_calls import GenericTools
    from . import generic_tools
    from .tools import template_messages

    mt_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    vocab = served.engine.model_config.vocab_size
    _check_common(body, max_tokens, mt_param, vocab)
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        raise APIError(400, f"top_logprobs must be between 0 and 20, got {body.top_logprobs}", param="top_logprobs")
    if body.top_logprobs and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    template = served.engine.tokenizer.chat_template
    tools, legacy, raw_tools, forced = _tool_setup(body, template)
    if isinstance(tools, GenericTools) and tools.answer_schema is not None:
        body = body.model_copy(update={"response_format": None})  # held to it inside the generic JSON
    params, constraint_param = _params_list(body, max_tokens, mt_param, logprobs, vocab, forced)
    kwargs = _template_kwargs(body.chat_template_kwargs)
    if body.reasoning_effort is not None:  # (as vLLM: a template variable; gpt-oss's writes "Reasoning: high")
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    fetched = await oai.fetch_image_urls(body.messages, state.cfg.image_urls)
    messages = template_messages(oai.message_dicts(body.messages, fetched))
    if not generic_tools.takes_tools(template):  # the tools (if offered) and tool turns as text turns
        messages = generic_tools.messages(messages, raw_tools if tools is not None else None, template)
    elif tools is not None:
        kwargs["tools"] = raw_tools
    gen = Generation(served, state.admission, [messages], params, n=body.n, max_tokens_param=mt_param,
                     prompt_param="messages", constraint_param=constraint_param, template_kwargs=kwargs,
                     on_close=release)
    if not start:
        return ChatStart(gen, tools, legacy)
    await gen.start()
    reasons, inside = gen.reasoning()
    return ChatStart(gen, tools, legacy, reasons, inside)


def _template_kwargs(kwargs: dict | None) -> dict:
    """vLLM's chat_template_kwargs, less the variables the renderer sets itself."""
    taken = {"messages", "add_generation_prompt", "bos_token", "eos_token"}
    clash = sorted(taken & set(kwargs or {}))
    if clash:
        raise APIError(400, f"chat_template_kwargs: {clash[0]!r} is set by the server", param="chat_template_kwargs")
    return dict(kwargs or {})


def _sse(obj: dict | str) -> str:
    text = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"



def _token_text(engine) -> Callable[[int], str]:
    tok = engine.tokenizer
    return lambda tid: tok.decode([tid], skip_special_tokens=False)




def _usage_null(chunk: dict, include_usage: bool) -> dict:
    """With stream_options.include_usage every chunk before the usage chunk carries "usage": null,
    as OpenAI streams them (clients read the field on every chunk)."""
    if include_usage:
        chunk["usage"] = None
    return chunk


async def _chat_events(gen: Generation, rid: str, created: int, name: str, include_usage: bool, want_lp: bool,
                       token_text, reasons: bool = False, inside: bool = False, tools: dict | None = None,
                       legacy: bool = False) -> AsyncIterator[str]:
    """vLLM's sequence: a role chunk per choice, content deltas, a finish chunk, [usage], [DONE].
    Each choice's reply goes through a ReplyStream (`reasons`: a reasoning model, `inside`: its
    reply starts inside <think>): reasoning as reasoning_content deltas, the answer as content,
    with `tools` the calls as tool_calls."""
    seen = [0] * len(gen.jobs)  # logprob entries already sent, per choice
    replies = [ReplyStream(reasons, inside, tools) for _ in gen.jobs]
    called = [False] * len(gen.jobs)
    try:
        for i in range(len(gen.jobs)):
            yield _sse(_usage_null(oai.chat_chunk(rid, created, name, i, {"role": "assistant", "content": ""}),
                                   include_usage))
        async for i, out in gen.outputs():
            lp = None
            if want_lp:
                entries = out.logprobs[seen[i]:seen[i] + len(out.new_token_ids)]
                seen[i] += len(entries)
                lp = oai.chat_logprobs(entries, token_text) if entries else None
            part = replies[i].feed(out.delta, out.finished)
            called[i] = called[i] or bool(part.tool_calls)
            delta = oai.chat_delta(part, legacy)
            if not delta and not out.finished and lp is None:
                continue  # text held back (partial UTF-8, a possible stop string or reasoning tag)
            reason = out.finish_reason if out.finished else None
            if reason is not None and called[i]:
                reason = oai.calls_finish_reason(legacy)
            yield _sse(_usage_null(oai.chat_chunk(rid, created, name, i, delta, reason, lp), include_usage))
        if include_usage:
            yield _sse(oai.usage_chunk(rid, created, name, "chat.completion.chunk", gen.usage()))
    except APIError as e:  # after the headers: an error event, then [DONE]
        gen.metrics.errors[e.status] += 1
        yield _sse(e.body())
    finally:
        gen.close()
    yield _sse("[DONE]")


async def _completion_events(gen: Generation, rid: str, created: int, name: str, include_usage: bool,
                             want_lp: bool, token_text) -> AsyncIterator[str]:
    seen = [0] * len(gen.jobs)
    offsets = [0] * len(gen.jobs)
    try:
        async for i, out in gen.outputs():
            lp = None
            if want_lp:
                entries = out.logprobs[seen[i]:seen[i] + len(out.new_token_ids)]
                seen[i] += len(entries)
                lp = oai.completion_logprobs(entries, token_text, offsets[i]) if entries else None
                if lp:
                    offsets[i] += sum(len(t) for t in lp["tokens"])
            if not out.delta and not out.finished and lp is None:
                continue
            yield _sse(_usage_null(oai.completion_chunk(rid, created, name, i, out.delta,
                                                        out.finish_reason if out.finished else None, lp),
                                   include_usage))
        if include_usage:
            yield _sse(oai.usage_chunk(rid, created, name, "text_completion", gen.usage()))
    except APIError as e:
        gen.metrics.errors[e.status] += 1
        yield _sse(e.body())
    finally:
        gen.close()
    yield _sse("[DONE]")
