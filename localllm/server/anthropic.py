"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), the one Claude Code and
every Anthropic-SDK tool speak: a wire format only. A request is translated into the internal
chat request (a ChatCompletionRequest run by the same openai_routes.start_chat as /v1/chat/completions:
templates, tools through the template or the generic format, reasoning), and the reply into
content blocks (thinking, text, tool_use) with Anthropic's stop_reason and usage, streamed as its
events (message_start, content_block_start/delta/stop, message_delta, message_stop). Errors on
these paths are Anthropic's {"type": "error", "error": {"type", "message"}}; the API key may come
as `x-api-key` (app.py's key check takes it).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Union

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ConfigDict, ValidationError

from ..reply_stream import ReplyDelta
from . import openai_schema as oai
from .generation import sse_response
from .openai_routes import start_translated_chat
from .openai_schema import APIError
from .state import ServerState

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(err: APIError) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


class CountRequest(oai._Request):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    messages: list[dict[str, Any]]
    system: Union[str, list[dict[str, Any]], None] = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", "schema"}}: structured output


def _text_blocks(content: Any, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content blocks", param=where)
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text" or not isinstance(block.get("text"), str):
            raise APIError(400, f"{where}[{j}]: only text blocks are supported here, got type {kind!r}",
                           param=where)
        texts.append(block["text"])
    return "\n".join(texts) if where == "system" else "".join(texts)


# chat request fields -> what this API calls them (in the errors start_chat raises)
_PARAMS = [("response_format.json_schema.schema", "output_config.format.schema"),
           ("response_format", "output_config.format"), ("chat_template_kwargs", "thinking")]


def chat_messages(req: CountRequest) -> list[dict]:
    """system + messages -> chat messages: a user turn's tool_result blocks become tool turns (before
    its text), an assistant turn's tool_use blocks its tool_calls; thinking blocks are not carried
    back (chat templates drop earlier turns' reasoning too)."""
    out = [{"role": "system", "content": _text_blocks(req.system, "system")}] if req.system else []
    for i, m in enumerate(req.messages):
        where, role, content = f"messages[{i}]", m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise APIError(400, f"{where}.role must be 'user' or 'assistant', got {role!r}", param=f"{where}.role")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(400, f"{where}.content must be a string or a list of content blocks",
                           param=f"{where}.content")
        texts, calls = [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise APIError(400, f"{at}: a tool_use block needs id and name strings", param=at)
                calls.append({"id": block["id"], "type": "function",
                              "function": {"name": block["name"],
                                           "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise APIError(400, f"{at}: a tool_result block needs a tool_use_id string", param=at)
                result = block.get("content")
                text = _text_blocks(result if result is not None else "", f"{at}.content")
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": f"Error: {text}" if block.get("is_error") else text})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue
            else:
                raise APIError(400, f"{at}: content blocks of type {kind!r} are not supported in a {role} turn "
                                    "(text, tool_use, tool_result, thinking)", param=at)
        if texts or calls or role == "assistant":
            msg: dict = {"role": role, "content": "".join(texts) or (None if calls else "")}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Anthropic tools {name, description, input_schema} -> chat tools; server tools are refused."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            kind = t.get("type") if isinstance(t, dict) else None
            raise APIError(400, f"tools[{i}]: only client tools (name, input_schema) are supported by this server, "
                                f"got type {kind!r}", param=f"tools[{i}]")
        fn = {"name": t.get("name"), "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: dict | None) -> Any:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise APIError(400, f"tool_choice.type must be auto, any, tool or none, got {kind!r}", param="tool_choice")


def chat_request(req: CountRequest) -> oai.ChatCompletionRequest:
    """The chat request a Messages request stands for."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req), "tools": chat_tools(req.tools),
                            "tool_choice": chat_tool_choice(req.tool_choice)}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                    top_p=req.top_p, top_k=req.top_k, stream=req.stream)
        fmt = (req.output_config or {}).get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
                raise APIError(400, "output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                               param="output_config.format")
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    kind = (req.thinking or {}).get("type")
    if kind is not None:
        if kind not in ("enabled", "disabled", "adaptive", "between_tools"):
            raise APIError(400, f"thinking.type must be enabled, disabled, adaptive or between_tools, got {kind!r}",
                           param="thinking.type")
        body["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
    if not body["messages"]:
        raise APIError(400, "messages must not be empty", param="messages")
    try:
        return oai.ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise APIError(400, f"{where}: {err.get('msg')}", param=where or None) from None


# ---- the reply as content blocks -----------------------------------------------------------------
class ContentBlocks:
    """A reply's parts (ReplyStream's ReplyDelta) -> Anthropic content blocks, and the stream events
    each part causes."""

    def __init__(self):
        self.blocks: list[dict] = []
        self._open: str | None = None  # "thinking" or "text": the block being written
        self.called = False

    def add(self, delta: ReplyDelta) -> list[dict]:
        events: list[dict] = []
        if delta.reasoning:
            events += self._write("thinking", delta.reasoning)
        if delta.content:
            events += self._write("text", delta.content)
        for call in delta.tool_calls:
            events += self._close()
            fn = oai.tool_call(call)["function"]  # the arguments as JSON text, for input_json_delta
            block = {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}
            index, self.called = len(self.blocks), True
            self.blocks.append(block)
            events += [{"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
                       {"type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}},
                       {"type": "content_block_stop", "index": index}]
        return events

    def finish(self) -> list[dict]:
        return self._close()

    def _write(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open != kind:
            events += self._close()
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                {"type": "text", "text": ""}
            self.blocks.append(block)
            self._open = kind
            events.append({"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)})
        self.blocks[-1][kind] += text
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" else {"type": "text_delta",
                                                                                          "text": text}
        return events + [{"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}]

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


def _stop(out, called: bool, stops: list[str] | None, tokenizer) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished reply; which stop sequence ended it is read off
    the text its tokens decode to (the engine reports a stop, not which)."""
    if called:
        return "tool_use", None
    if out.finish_reason == "length":
        return "max_tokens", None
    if stops and out.finish_reason == "stop":
        tail = tokenizer.decode(out.token_ids, skip_special_tokens=True)[len(out.text):]
        for s in sorted(stops, key=tail.find):
            if s in tail:
                return "stop_sequence", s
    return "end_turn", None


def _usage(gen) -> dict:
    u = gen.usage()
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u["prompt_tokens_details"]["cached_tokens"]}


def router(state: ServerState) -> APIRouter:
    """POST /v1/messages and /v1/messages/count_tokens on `state` (the server's model pool,
    admission and metrics)."""
    api = APIRouter()

    async def _started(body: CountRequest, start: bool):
        return await start_translated_chat(state, chat_request(body), _PARAMS, start)

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountRequest):
        import asyncio

        from ..chat import ChatTemplateError

        state.metrics.http_requests += 1
        target, release, chat = await _started(body, start=False)
        try:  # rendered and encoded off the event loop, exactly as /v1/messages renders it
            ids = await asyncio.to_thread(target.engine.encode_prompt, chat.gen.prompts[0], **chat.gen.template_kwargs)
        except ChatTemplateError as e:
            raise APIError(400, str(e), param="messages") from None
        finally:
            release()
        return {"input_tokens": len(ids)}

    @api.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        state.metrics.http_requests += 1
        target, _, chat = await _started(body, start=True)
        gen, mid, name, tok = chat.gen, f"msg_{uuid.uuid4().hex}", target.name, target.engine.tokenizer

        def message(blocks: list[dict], stop: tuple[str | None, str | None], usage: dict) -> dict:
            return {"id": mid, "type": "message", "role": "assistant", "model": name, "content": blocks,
                    "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

        if not body.stream:
            if not await gen.collect(request):
                return Response(status_code=499)
            out = gen.finals[0]
            blocks = ContentBlocks()
            blocks.add(chat.reply().whole(out.text))
            return message(blocks.blocks, _stop(out, blocks.called, body.stop_sequences, tok), _usage(gen))

        async def events() -> AsyncIterator[str]:
            def sse(event: dict) -> str:
                return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"

            blocks, reply = ContentBlocks(), chat.reply()
            start_usage = {"input_tokens": len(gen.prompt_ids[0]), "output_tokens": 0,
                           "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
            yield sse({"type": "message_start", "message": message([], (None, None), start_usage)})
            try:
                final = None
                async for _, out in gen.outputs():
                    part = reply.feed(out.delta, out.finished)
                    for e in blocks.add(part):
                        yield sse(e)
                    if out.finished:
                        final = out
                for e in blocks.finish():
                    yield sse(e)
                if final is not None:
                    reason, seq = _stop(final, blocks.called, body.stop_sequences, tok)
                    yield sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                               "usage": _usage(gen)})
                    yield sse({"type": "message_stop"})
            except APIError as e:  # after the headers: Anthropic's error event
                state.metrics.errors[e.status] += 1
                yield sse(error_body(e.renamed(_PARAMS)))
            finally:
                gen.close()

        return sse_response(gen, events())

    return api
