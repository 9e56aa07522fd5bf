"""The request fields that ask for structured output, as OpenAI, vLLM and Ollama spell them, mapped
onto one engine Constraint (localllm.structured). Each function raises APIError(400) naming the
field, with llguidance's own message when a schema, regex or grammar does not compile.
"""

from __future__ import annotations

import json
from typing import Any

from ..structured import Constraint, ConstraintError
from .openai_schema import APIError

# vLLM's guided_* fields and the keys of its newer `structured_outputs` object -> constraint kinds
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def make(param: str, kind: str, spec: Any = None) -> Constraint:
    """Constraint.make, its error a 400 naming `param`."""
    try:
        return Constraint.make(kind, spec)
    except ConstraintError as e:
        raise APIError(400, f"{param}: {e}", param=param) from None


def _schema(param: str, value: Any) -> Any:
    """A schema given as an object, or (vLLM accepts both) as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise APIError(400, f"{param}: not a JSON schema: {e}", param=param) from None
    if not isinstance(value, (dict, bool)):
        raise APIError(400, f"{param}: a JSON schema must be an object", param=param)
    return value


def response_format(value: Any) -> Constraint | None:
    """OpenAI's response_format: text (None), json_object, json_schema {name, schema, strict}."""
    param = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type", "text"), str):
        raise APIError(400, f"{param} must be an object with a 'type'", param=param)
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return make(param, "json")
    if kind == "json_schema":
        js = value.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise APIError(400, f"{param}: type 'json_schema' needs json_schema: {{name, schema}}", param=param)
        # strict or not, the output is held to the schema: a looser answer is never better
        return make(f"{param}.json_schema.schema", "json_schema", _schema(f"{param}.json_schema.schema", js["schema"]))
    raise APIError(400, f"{param}: type {kind!r} is not one of 'text', 'json_object', 'json_schema'", param=param)


def response_format_field(value: Any) -> str:
    """The field a compile error of response_format's constraint names (found after the request
    was checked, when the constraint compiles for the model's tokenizer)."""
    if isinstance(value, dict) and value.get("type") == "json_schema":
        return "response_format.json_schema.schema"
    return "response_format"


def vllm_fields(extra: dict[str, Any]) -> tuple[str, Constraint] | None:
    """(field, constraint) from vLLM's guided_json/regex/choice/grammar or structured_outputs, of
    which a request may set one; other guided_* fields are refused by name."""
    found: list[tuple[str, Constraint]] = []
    for name, value in extra.items():
        if value is None:
            continue
        if name in GUIDED:
            spec = _schema(name, value) if name == "guided_json" else value
            found.append((name, make(name, GUIDED[name], spec)))
        elif name == "structured_outputs":
            found.append(_structured_outputs(value))
        elif name.startswith("guided_"):
            raise APIError(400, f"{name} is not supported by this server (it has one decoding backend: "
                                "llguidance)", param=name)
    if len(found) > 1:
        raise APIError(400, f"send one structured-output field, got {' and '.join(n for n, _ in found)}",
                       param=found[1][0])
    return found[0] if found else None


def _structured_outputs(value: Any) -> tuple[str, Constraint]:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise APIError(400, f"{param} must be an object with one of json, regex, choice, grammar", param=param)
    set_ = {k: v for k, v in value.items() if v not in (None, False)}
    if set_.get("json_object") is True and len(set_) == 1:
        return param, make(param, "json")
    keys = [k for k in set_ if k in STRUCTURED_OUTPUTS]
    unknown = [k for k in set_ if k not in STRUCTURED_OUTPUTS]
    if unknown or len(keys) != 1:
        raise APIError(400, f"{param} takes exactly one of json, regex, choice, grammar (or json_object: true), "
                            f"got {sorted(set_)}", param=param)
    key = keys[0]
    spec = _schema(f"{param}.{key}", set_[key]) if key == "json" else set_[key]
    return f"{param}.{key}", make(f"{param}.{key}", STRUCTURED_OUTPUTS[key], spec)


def ollama_format(value: Any) -> Constraint | None:
    """Ollama's format: "json" (JSON mode: any JSON object) or a JSON schema object."""
    if value in (None, ""):
        return None
    if value == "json":
        return make("format", "json")
    if isinstance(value, dict):
        return make("format", "json_schema", value)
    raise APIError(400, f"format must be \"json\" or a JSON schema object, got {value!r}", param="format")
