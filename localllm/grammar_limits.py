"""Bounds on what one request may ask the grammar compiler (llguidance) to build, checked in pure
Python, in microseconds, before anything is compiled.

Why: llguidance's compile time grows faster than the input (50,000 choices took 11 s, an anyOf of
5,000 objects 1.7 s, 10,000 required properties 3.6 s, a 1 MB regex ran out of fuel after 1 s) and
it recurses once per `$ref` link or Lark rule, which overflowed an 8 MiB stack (SIGSEGV) past
~700 links. Under these bounds every shape measured compiles in about 0.1 s or less (see the
tests), and the compile runs in a thread with a 64 MiB stack (localllm.grammar_worker), which held
5,000 links. What these bounds miss, the worker process catches.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    schema_bytes: int = 64 << 10  # a JSON schema, as compact JSON text
    subschemas: int = 1_000  # JSON objects anywhere in a schema (each property, branch, definition)
    choices: int = 2_000  # guided_choice strings
    choice_bytes: int = 64 << 10  # all of them together
    regex_bytes: int = 16 << 10  # guided_regex, and each schema "pattern"
    lark_bytes: int = 64 << 10  # guided_grammar (and the grammar forcing a tool call)
    lark_rules: int = 1_000  # rule and terminal definitions
    repeat_chars: int = 20_000  # what counted repetitions ({n}, {n,m}, ~ n..m) add when written out


LIMITS = Limits()

_COUNT = re.compile(r"\{\s*(\d*)\s*(,\s*(\d*)\s*)?\}")
_LARK_COUNT = re.compile(r"~\s*(\d+)\s*(\.\.\s*(\d+))?")
_LARK_RULE = re.compile(r"(?m)^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(\.-?\d+)?[ \t]*:")


def check(kind: str, spec, limits: Limits = LIMITS) -> str | None:
    """Why the constraint (a kind of localllm.structured, its spec as the request gave it) is over
    a bound, or None. Nothing here compiles anything."""
    if kind == "json_schema":
        return _check_schema(spec, limits)
    if kind == "choice":
        if len(spec) > limits.choices:
            return f"{len(spec)} choices, more than the {limits.choices} this server compiles"
        size = sum(len(c.encode("utf-8")) for c in spec)
        if size > limits.choice_bytes:
            return f"the choices take {size} bytes, more than the {limits.choice_bytes} this server compiles"
        return None
    if kind == "regex":
        return _check_regex(spec, "the regex", limits)
    if kind == "grammar":
        size = len(spec.encode("utf-8"))
        if size > limits.lark_bytes:
            return f"the grammar is {size} bytes, more than the {limits.lark_bytes} this server compiles"
        rules = len(_LARK_RULE.findall(spec))
        if rules > limits.lark_rules:
            return f"the grammar defines {rules} rules, more than the {limits.lark_rules} this server compiles"
        return _check_repeats(spec, "the grammar", limits, lark=True)
    return None


def _check_schema(schema, limits: Limits) -> str | None:
    try:
        size = len(json.dumps(schema, separators=(",", ":")).encode("utf-8"))
    except RecursionError:
        return "the schema nests too deep"
    if size > limits.schema_bytes:
        return f"the schema is {size} bytes, more than the {limits.schema_bytes} this server compiles"
    objects, todo = 0, [schema]
    while todo:  # a loop, not recursion: the depth is the request's
        value = todo.pop()
        if isinstance(value, dict):
            objects += 1
            if objects > limits.subschemas:
                return f"the schema has more than {limits.subschemas} subschemas (JSON objects), more than " \
                       "this server compiles"
            pattern = value.get("pattern")
            if isinstance(pattern, str):
                error = _check_regex(pattern, "a pattern", limits)
                if error:
                    return error
            todo.extend(value.values())
        elif isinstance(value, list):
            todo.extend(value)
    return None


def _check_regex(rx: str, what: str, limits: Limits) -> str | None:
    size = len(rx.encode("utf-8"))
    if size > limits.regex_bytes:
        return f"{what} is {size} bytes, more than the {limits.regex_bytes} this server compiles"
    return _check_repeats(rx, what, limits)


def _check_repeats(text: str, what: str, limits: Limits, lark: bool = False) -> str | None:
    added = expanded_length(text, lark) - len(text)
    if lark:  # a terminal repeats the terminals it names: bound by all the counts multiplied
        product = 1
        for m in (*_COUNT.finditer(text), *_LARK_COUNT.finditer(text)):
            product *= max(int(m[3] or m[1] or 1), 1)
            if product > limits.repeat_chars:
                break
        added = max(added, product - 1)
    if added > limits.repeat_chars:
        return f"{what}'s counted repetitions unroll to {added} more characters, more than the " \
               f"{limits.repeat_chars} this server compiles"
    return None


def expanded_length(rx: str, lark: bool = False) -> int:
    """An upper bound on the length of `rx` with its counted repetitions written out: `(a{1000}){1000}`
    is 15 characters that the lexer unrolls to 10^6. Groups nest, alternatives add up (never less
    than the real size), a character class or an escape counts as one character; `{n,}` counts n
    (what follows n is a star, which costs nothing extra). `lark`: also Lark's `item ~ n..m`."""
    sums, last, i, n = [0], 0, 0, len(rx)
    while i < n:
        c = rx[i]
        count = None
        if c == "{":
            m = _COUNT.match(rx, i)
            if m and (m[1] or m[3]):
                count = int(m[3] or m[1]) if m[2] and m[3] else int(m[1] or 0)
        elif c == "~" and lark:
            m = _LARK_COUNT.match(rx, i)
            if m:
                count = int(m[3] or m[1])
        if count is not None:  # the last atom, `count` times instead of once
            sums[-1] += last * (max(count, 1) - 1)
            last *= max(count, 1)
            i = m.end()
            continue
        if c == "(":
            sums.append(0)
            last, i = 0, i + 1
            continue
        if c == ")" and len(sums) > 1:
            last = max(sums.pop(), 1)
            sums[-1] += last
            i += 1
            continue
        if c == "\\":
            i += 2
        elif c == "[":
            i = _class_end(rx, i)
        elif lark and c in " \t":  # Lark puts blanks between an item and its `~`
            i += 1
            continue
        else:
            i += 1
        last = 1
        sums[-1] += 1
    return sum(sums)


def _class_end(rx: str, i: int) -> int:
    """The index after the character class that opens at rx[i]: at its first unescaped ']' (after
    a leading '^' and a literal ']'). A nested class ends it early, so that its tail is counted as
    atoms: more, never less, than the real size. The end of the text when it is not closed."""
    i += 1
    if rx.startswith("^", i):
        i += 1
    if rx.startswith("]", i):
        i += 1
    while i < len(rx):
        if rx[i] == "\\":
            i += 2
        elif rx[i] == "]":
            return i + 1
        else:
            i += 1
    return i
