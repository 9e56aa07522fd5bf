"""The OpenAI wire format: request models (pydantic), response/chunk builders, OpenAI-shaped errors.

Responses are plain dicts built here so their shape is exactly what OpenAI/vLLM send (which
keys are present, which are null) and nothing depends on pydantic's serialisation options.
Unknown request fields are ignored, as vLLM does; fields we cannot honour (audio, echo, suffix,
best_of) are refused with a 400 naming them rather than silently dropped. Structured
output (response_format, vLLM's guided_* and structured_outputs) is mapped in output_format. Types are strict where OpenAI's schema is (`max_tokens: true` or
`logprobs: "yes"` are errors, not 1 and true), and no text with a lone UTF-16 surrogate (legal
JSON, not encodable text) gets past the request models.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from ..reply_stream import ReplyDelta
from ..tool_calls import ToolCall

if TYPE_CHECKING:
    from ..model.vision.fetch import ImageURLPolicy


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def renamed(self, names: list[tuple[str, str]]) -> APIError:
        """This error in another API's field names ((chat request field, that API's) pairs): the
        Responses and Anthropic routes run the chat request's checks and name their own fields."""
        message, param = self.message, self.param
        for old, new in names:
            message = message.replace(old, new)
            if param is not None and param.startswith(old):
                param = new + param[len(old):]
        return APIError(self.status, message, self.type, param, self.code, self.headers)


# ---- requests ---------------------------------------------------------------------------------
class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


# arrays/objects inside each other in a request body: no request we take needs a tenth of this,
# and the JSON parser itself gives up near 1000 (RecursionError: app.py names the same limit)
MAX_BODY_DEPTH = 512


class BodyTooDeep(ValueError):
    def __init__(self, where: str):
        super().__init__(where)
        self.where = where


def surrogate_path(obj: Any, max_depth: int = MAX_BODY_DEPTH) -> tuple[str, str] | None:
    """(field path, offending character) of the first string in a parsed JSON body that holds a
    lone UTF-16 surrogate ("a\\ud800b" is legal JSON but no UTF-8 text: the tokenizer and the
    response encoder would fail on it), or None. Raises BodyTooDeep (with the top-level field)
    where arrays/objects nest more than `max_depth` levels. Iterative: nesting costs no stack."""
    stack: list[tuple[str, Any, int]] = [("", obj, 1)]
    while stack:
        path, o, depth = stack.pop()
        if isinstance(o, str):
            if not o.isascii():
                try:
                    o.encode("utf-8")
                except UnicodeEncodeError as e:
                    return path or "body", o[e.start]
        elif isinstance(o, (dict, list)):
            if depth > max_depth:
                raise BodyTooDeep(path.partition(".")[0] or "body")
            if isinstance(o, dict):
                stack.extend((f"{path}.{k}" if path else str(k), v, depth + 1) for k, v in reversed(list(o.items())))
                stack.extend((path or "body", k, depth) for k in o if isinstance(k, str))  # keys first
            else:
                stack.extend((f"{path}.{i}" if path else str(i), v, depth + 1)
                             for i, v in reversed(list(enumerate(o))))
    return None


class _Request(_Model):
    """A top-level request body: its text is checked once for lone surrogates before validation."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        try:
            found = surrogate_path(data)
        except BodyTooDeep as e:
            raise PydanticCustomError(
                "body_too_deep", "{where}: the request body is nested too deeply (arrays/objects more than "
                "{limit} levels inside each other; nothing this server takes nests that deep)",
                {"where": e.where, "limit": MAX_BODY_DEPTH}) from None
        if found:
            where, ch = found
            raise PydanticCustomError(
                "invalid_text", "{where}: invalid text: lone UTF-16 surrogate {code} (not valid Unicode; "
                "send the full surrogate pair or the character itself)",
                {"where": where, "code": f"\\u{ord(ch):04x}"})
        return data


class StreamOptions(_Model):
    include_usage: bool = False


class ChatMessage(_Model):
    role: str
    # a string, or OpenAI content parts [{"type": "text", "text": ...}]; null for e.g. tool-call turns
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, carried back
    tool_call_id: str | None = None  # a tool turn: the call it answers


class _SamplingRequest(_Request):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI + vLLM extras)."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(default=None, ge=-(2 ** 63), lt=2 ** 64)  # what torch's generator takes
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in -100..100
    response_format: Any = None  # checked in output_format (its errors name the field)
    # other unknown fields are kept (not validated) so that guided_* (vLLM) are seen by name
    model_config = ConfigDict(extra="allow", strict=True)

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for the first field this server would otherwise silently ignore."""
        return None

    def token_bias(self, vocab: int) -> dict[int, float] | None:
        """logit_bias with integer token ids in 0..vocab-1 (APIError naming logit_bias otherwise)."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            tid = int(key) if key.isascii() and key.strip().isdigit() else -1
            if not 0 <= tid < vocab:
                raise APIError(400, f"logit_bias: keys must be token ids in 0..{vocab - 1}, got {key!r}",
                               param="logit_bias")
            out[tid] = bias
        return out


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: extra variables for the chat template
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None  # gpt-oss's template reads it
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.modalities is not None and self.modalities != ["text"]:
            return "modalities", f"only text output is supported (modalities: [\"text\"]), got {self.modalities!r}"
        for name in ("audio", "prediction"):
            if getattr(self, name) is not None:
                return name, f"{name} is not supported by this server"
        return super().unsupported()


class CompletionRequest(_SamplingRequest):
    # int lists before str lists: pydantic's smart union picks the exact match either way
    prompt: Union[str, list[int], list[list[int]], list[str]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


def image_part(url: Any, where: str, fetched: dict[str, bytes] | None = None) -> dict:
    """An OpenAI image_url part -> our image part (its bytes, decoded with the prompt): a data: URL's
    bytes, or an http(s) URL's as fetch_image_urls fetched them (refused when it did not)."""
    from ..model.vision import ImageInputError
    from ..model.vision.images import decode_data_url

    url = _image_url(url, where)
    if fetched is not None and url in fetched:
        return {"type": "image", "image": fetched[url]}
    try:
        return {"type": "image", "image": decode_data_url(url, f"{where}.image_url")}
    except ImageInputError as e:
        raise APIError(400, str(e), param=where) from None


def _image_url(url: Any, where: str) -> str:
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str):
        raise APIError(400, f"{where}: a part of type 'image_url' needs image_url.url (a data: URL)", param=where)
    return url


async def fetch_image_urls(messages: list[ChatMessage], policy: ImageURLPolicy) -> dict[str, bytes]:
    """The http(s) image_url parts' bytes, fetched concurrently (each URL once) where `policy`
    allows it; {} where it does not (message_dicts then refuses them, saying how to allow them).
    A failed fetch is a 400 naming the part and the problem."""
    from ..model.vision import ImageInputError
    from ..model.vision.fetch import fetch_image, is_http_url

    if not policy.allow:
        return {}
    wanted: dict[str, str] = {}  # url -> the first part that names it
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    where = f"messages[{i}].content[{j}]"
                    url = _image_url(part.get("image_url"), where)
                    if is_http_url(url):
                        wanted.setdefault(url, where)
    if not wanted:
        return {}

    async def one(url: str, where: str) -> bytes:
        try:
            return await fetch_image(url, policy, f"{where}.image_url")
        except ImageInputError as e:
            raise APIError(400, str(e), param=where) from None

    bodies = await asyncio.gather(*(one(u, w) for u, w in wanted.items()))
    return dict(zip(wanted, bodies))


def message_dicts(messages: list[ChatMessage], fetched: dict[str, bytes] | None = None) -> list[dict]:
    """ChatMessage models -> {"role", "content"} dicts for the chat template: text parts joined,
    or, with images, a list of text and image parts ({"type": "image", "image": bytes}); `fetched`:
    the http(s) image URLs' bytes (fetch_image_urls)."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if isinstance(content, list):
            items = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                if part.get("type") == "image_url":
                    items.append(image_part(part.get("image_url"), where, fetched))
                    continue
                if part.get("type") != "text":
                    raise APIError(400, f"{where}: only text and image_url content parts are supported "
                                        f"(got type {part.get('type')!r})", param=f"messages[{i}].content")
                if not isinstance(part.get("text"), str):
                    raise APIError(400, f"{where}: a part of type 'text' needs a 'text' string",
                                   param=f"messages[{i}].content")
                items.append({"type": "text", "text": part["text"]})
            content = (items if any(p["type"] == "image" for p in items)
                       else "".join(p["text"] for p in items))
        d = {"role": m.role, "content": content or ""}
        for key in ("tool_calls", "tool_call_id", "name"):
            if getattr(m, key) is not None:
                d[key] = getattr(m, key)
        out.append(d)
    return out


# ---- responses --------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_response(rid: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": use, "system_fingerprint": None}


def chat_choice(index: int, reply: ReplyDelta, finish_reason: str | None, logprobs: dict | None,
                reasons: bool = False, legacy: bool = False) -> dict:
    """A whole reply (reply_stream.ReplyStream.whole) as a choice: `reasons` (a reasoning model)
    adds reasoning_content as vLLM's reasoning parser does (null when it did not think); calls
    become tool_calls (`legacy`: the deprecated functions API's one function_call)."""
    message: dict = {"role": "assistant", "content": reply.content}
    if reasons:
        message["reasoning_content"] = reply.reasoning or None
    if reply.tool_calls:
        message["content"] = reply.content.strip() or None  # the text around the calls, if any
        message.update(_calls_field(reply.tool_calls, legacy))
        finish_reason = calls_finish_reason(legacy)
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_delta(d: ReplyDelta, legacy: bool = False) -> dict:
    """A streamed part of a reply as a chat chunk's delta: reasoning_content, content, and the
    calls (sent whole, with the reply's last delta) as tool_calls."""
    delta: dict = {}
    if d.reasoning:
        delta["reasoning_content"] = d.reasoning
    if d.content:
        delta["content"] = d.content
    if d.tool_calls:
        delta.update(_calls_field(d.tool_calls, legacy, stream=True))
    return delta


def calls_finish_reason(legacy: bool) -> str:
    """The finish_reason of a reply that made calls."""
    return "function_call" if legacy else "tool_calls"


def tool_call(call: ToolCall, index: int | None = None) -> dict:
    """A call as OpenAI spells it: arguments as JSON text; `index` in a streamed delta."""
    d = {"id": call.id, "type": "function",
         "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
    return d if index is None else {"index": index, **d}


def _calls_field(calls: list[ToolCall], legacy: bool, stream: bool = False) -> dict:
    if legacy:  # the deprecated functions API has one call per reply
        return {"function_call": tool_call(calls[0])["function"]}
    return {"tool_calls": [tool_call(c, k if stream else None) for k, c in enumerate(calls)]}


def completion_response(rid: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": use, "system_fingerprint": None}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict, finish_reason: str | None = None,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str,
                     finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, created: int, model: str, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def chat_logprobs(entries: list[dict], token_text) -> dict:
    """Engine logprob entries {"token_id", "logprob", "top": [(id, lp)]} -> OpenAI chat logprobs."""
    def item(tid: int, lp: float) -> dict:
        s = token_text(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**item(e["token_id"], e["logprob"]),
                         "top_logprobs": [item(t, lp) for t, lp in e["top"]]} for e in entries]}


def completion_logprobs(entries: list[dict], token_text, offset: int = 0) -> dict:
    """Engine logprob entries -> OpenAI legacy completions logprobs (tokens, token_logprobs, ...)."""
    tokens, offsets = [], []
    for e in entries:
        s = token_text(e["token_id"])
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{token_text(t): lp for t, lp in e["top"]} for e in entries],
            "text_offset": offsets}
