"""OpenAI's Responses API (/v1/responses), the one the OpenAI Agents SDK and Codex speak: a wire
format only. A request is translated into the internal chat request (a ChatCompletionRequest run
by the same openai_routes.start_chat as /v1/chat/completions: templates, tools (through the template or the
generic format), constrained decoding, reasoning), and the reply into Responses' output items
(reasoning, message, function_call) and, streamed, its typed events (response.created,
response.output_item.added, response.output_text.delta, response.function_call_arguments.delta,
response.completed, ...). Stateless: nothing is stored (`store` is reported false), so
`previous_response_id` and `conversation` are a 400 saying to send the conversation in `input`.
Errors are OpenAI's shape, their `param` named as this API names the field.
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
from .openai_routes import ChatStart, start_translated_chat
from .openai_schema import APIError
from .state import ServerState


class ResponsesRequest(oai._Request):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    seed: int | None = None  # not OpenAI's; vLLM and llama.cpp take it here too


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"  # OpenAI's shape: resp_..., msg_..., fc_..., rs_...


# chat request fields -> what this API calls them (in the errors start_chat raises)
_PARAMS = [("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
           ("max_completion_tokens", "max_output_tokens"), ("messages", "input"),
           ("chat_template_kwargs", "reasoning")]


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or input_text/output_text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of content parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal"):
            raise APIError(400, f"{where}.content[{j}]: only text parts are supported (input_text, output_text), "
                                f"got type {kind!r}", param=f"{where}.content")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise APIError(400, f"{where}.content[{j}] needs a 'text' string", param=f"{where}.content")
        texts.append(text)
    return "".join(texts)


def chat_messages(req: ResponsesRequest) -> list[dict]:
    """instructions + input -> chat messages: input_text parts joined, function_call items as the
    assistant turn's tool_calls, function_call_output items as tool turns; reasoning items are
    not carried back (chat templates drop earlier turns' reasoning too)."""
    out: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return [*out, {"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("user", "assistant", "system"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer, got "
                                    f"{item.get('role')!r}", param=f"{where}.role")
            out.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise APIError(400, f"{where}: a function_call item needs call_id, name and arguments strings",
                               param=where)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":  # the same turn: its text, then its calls
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}: a function_call_output item needs a call_id string", param=where)
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _text_of(output, f"{where}.output")})
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise APIError(400, f"{where}: item_reference needs stored items, and this server stores none: send "
                                "the items themselves", param=where)
        else:
            raise APIError(400, f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                                "function_call_output, reasoning)", param=f"{where}.type")
    return out


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' function tools {type, name, description, parameters} -> chat tools."""
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise APIError(400, f"tools[{i}]: only function tools are supported by this server, got type {kind!r}",
                           param=f"tools[{i}].type")
        fn = {"name": t.get("name"), "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if choice is None or isinstance(choice, str):
        return choice
    raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
                   param="tool_choice")


def response_format(text: dict | None) -> dict | None:
    """text.format -> chat's response_format."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object with a 'type'", param="text.format")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return fmt


def chat_request(req: ResponsesRequest) -> oai.ChatCompletionRequest:
    """The chat request a Responses request stands for (APIError naming this API's fields)."""
    for name, why in (("previous_response_id", "send the whole conversation in input"),
                      ("conversation", "send the whole conversation in input"),
                      ("prompt", "send the instructions and input themselves")):
        if getattr(req, name) is not None:
            raise APIError(400, f"{name} is not supported: this server is stateless (it stores no responses, "
                                f"conversations or prompts; store is always false): {why}", param=name)
    if req.background:
        raise APIError(400, "background responses are not supported: this server stores no responses",
                       param="background")
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req), "stream": req.stream,
                            "tools": chat_tools(req.tools), "tool_choice": chat_tool_choice(req.tool_choice),
                            "response_format": response_format(req.text),
                            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
                            "top_p": req.top_p, "seed": req.seed, "user": req.user}
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:  # a reasoning model thinks unless told the least effort (gpt-oss: at that effort)
        body["chat_template_kwargs"] = {"enable_thinking": effort not in ("none", "minimal"), "reasoning_effort": effort}
    if req.top_logprobs:
        body.update(logprobs=True, top_logprobs=req.top_logprobs)
    if not body["messages"]:
        raise APIError(400, "input must not be empty", param="input")
    try:
        return oai.ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise APIError(400, f"{where}: {err.get('msg')}", param=where or None).renamed(_PARAMS) from None


# ---- the reply as output items --------------------------------------------------------------------
class OutputItems:
    """A reply's parts (ReplyStream's ReplyDelta: reasoning, content, tool calls) -> Responses'
    output items, and the stream events each part causes (sequence numbers added by the caller)."""

    def __init__(self):
        self.items: list[dict] = []
        self._open: dict | None = None  # the reasoning or message item being written
        self._text = ""

    def add(self, delta: ReplyDelta) -> list[dict]:
        events: list[dict] = []
        if delta.reasoning:
            events += self._write("reasoning", delta.reasoning)
        if delta.content:
            events += self._write("message", delta.content)
        for c in delta.tool_calls:
            events += self._close()
            call = oai.tool_call(c)  # OpenAI's spelling: the arguments as JSON text
            fn = call["function"]
            item = {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": fn["name"],
                    "arguments": "", "status": "in_progress"}
            index = len(self.items)
            self.items.append(item)
            events.append({"type": "response.output_item.added", "output_index": index, "item": dict(item)})
            events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                           "output_index": index, "delta": fn["arguments"]})
            item.update(arguments=fn["arguments"], status="completed")
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "name": fn["name"], "arguments": fn["arguments"]})
            events.append({"type": "response.output_item.done", "output_index": index, "item": dict(item)})
        return events

    def finish(self, status: str) -> list[dict]:
        """Close what is open; a reply with no message and no call still gets an (empty) message."""
        events = []
        if not any(i["type"] in ("message", "function_call") for i in self.items):
            events += self._write("message", "")
        return events + self._close(status)

    def _write(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            events += self._start(kind)
        item, index = self._open, len(self.items) - 1
        self._text += text
        if text:
            if kind == "reasoning":
                events.append({"type": "response.reasoning_text.delta", "item_id": item["id"], "output_index": index,
                               "content_index": 0, "delta": text})
            else:
                events.append({"type": "response.output_text.delta", "item_id": item["id"], "output_index": index,
                               "content_index": 0, "delta": text, "logprobs": []})
        return events

    def _start(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [], "status": "in_progress"}
        else:
            item = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant",
                    "content": []}
        self._open, self._text = item, ""
        self.items.append(item)
        index = len(self.items) - 1
        events = [{"type": "response.output_item.added", "output_index": index, "item": json.loads(json.dumps(item))}]
        if kind == "message":
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})
        return events

    def _close(self, status: str = "completed") -> list[dict]:
        item = self._open
        if item is None:
            return []
        self._open, index, text = None, len(self.items) - 1, self._text
        item["status"] = status
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            events = [{"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": index,
                       "content_index": 0, "text": text}]
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            events = [{"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                       "content_index": 0, "text": text, "logprobs": []},
                      {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                       "content_index": 0, "part": part}]
        return events + [{"type": "response.output_item.done", "output_index": index, "item": item}]


def _usage(gen, reasoning_tokens: int) -> dict:
    u = gen.usage()
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": u["total_tokens"]}


def _response(rid: str, created: int, req: ResponsesRequest, model: str, status: str, output: list[dict],
              usage: dict | None, incomplete: dict | None = None) -> dict:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "background": False,
            "error": None, "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {}, "model": model,
            "output": output, "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "previous_response_id": None, "reasoning": {"effort": (req.reasoning or {}).get("effort"), "summary": None},
            "store": False, "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled", "usage": usage,
            "user": req.user}


def router(state: ServerState) -> APIRouter:
    """POST /v1/responses on `state` (the server's model pool, admission and metrics)."""
    api = APIRouter()

    @api.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        state.metrics.http_requests += 1
        target, _, chat = await start_translated_chat(state, chat_request(body), _PARAMS)
        return await _answer(body, chat, target, request)

    async def _answer(req: ResponsesRequest, chat: ChatStart, target, request: Request):
        gen, rid, created, name = chat.gen, _id("resp"), oai.now(), target.name
        tok = target.engine.tokenizer

        def done(items: OutputItems, reason: str | None) -> dict:
            thoughts = "".join(c["text"] for i in items.items if i["type"] == "reasoning" for c in i["content"])
            n_reason = len(tok.encode(thoughts, add_special_tokens=False)) if thoughts else 0
            incomplete = {"reason": "max_output_tokens"} if reason == "length" else None
            return _response(rid, created, req, name, "incomplete" if incomplete else "completed", items.items,
                             _usage(gen, n_reason), incomplete)

        if not req.stream:
            if not await gen.collect(request):
                return Response(status_code=499)
            out = gen.finals[0]
            items = OutputItems()
            items.add(chat.reply().whole(out.text))
            items.finish("incomplete" if out.finish_reason == "length" else "completed")
            return done(items, out.finish_reason)

        async def events() -> AsyncIterator[str]:
            seq = 0

            def sse(event: dict) -> str:
                nonlocal seq
                event["sequence_number"] = seq
                seq += 1
                return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"

            items, reply, reason = OutputItems(), chat.reply(), None
            shell = _response(rid, created, req, name, "in_progress", [], None)
            yield sse({"type": "response.created", "response": shell})
            yield sse({"type": "response.in_progress", "response": shell})
            try:
                async for _, out in gen.outputs():
                    part = reply.feed(out.delta, out.finished)
                    for e in items.add(part):
                        yield sse(e)
                    if out.finished:
                        reason = out.finish_reason
                for e in items.finish("incomplete" if reason == "length" else "completed"):
                    yield sse(e)
                final = done(items, reason)
                yield sse({"type": f"response.{final['status']}", "response": final})
            except APIError as e:  # after the headers: an error event, as OpenAI streams one
                state.metrics.errors[e.status] += 1
                e = e.renamed(_PARAMS)
                yield sse({"type": "error", "code": e.code or e.type, "message": e.message, "param": e.param})
            finally:
                gen.close()

        return sse_response(gen, events())

    return api
