"""Constrained decoding: a request's output held to a JSON schema, any JSON object, a regex, a
choice of strings or a Lark grammar, through llguidance (a maintained grammar engine: it builds
its tokenizer from the tokenizers JSON we hold, compiles a schema in ~1 ms and fills a token mask
in tens of microseconds; it refuses schema keywords it does not support instead of ignoring them).

The seam to the engine is small: `Constraint` (what the request asks, checked when the request is
made), `Grammars.matcher` (one matcher per request), `allowed` (the tokens the matcher allows next,
applied to the logits before penalties and temperature) and the matcher's own consume_token /
is_stopped / rollback.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .grammar_limits import check as check_limits

KINDS = ("json", "json_schema", "regex", "choice", "grammar")


class ConstraintError(ValueError):
    """A constraint that cannot be compiled; the message says why."""


@dataclass(frozen=True)
class Constraint:
    """kind "json" (any JSON object; spec unused), "json_schema" (spec: the schema, a dict),
    "regex" (spec: a pattern), "choice" (spec: a list of strings), "grammar" (spec: Lark text)."""

    kind: str
    spec: str | tuple | None = None

    @classmethod
    def make(cls, kind: str, spec=None) -> Constraint:
        """A checked constraint (ConstraintError otherwise); a schema dict is kept as JSON text
        so that the constraint is hashable and compiled once."""
        if kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {kind!r} (one of {', '.join(KINDS)})")
        if kind == "json_schema":
            if spec is False:
                raise ConstraintError("invalid json_schema: the schema false accepts no value, so no output "
                                      "can satisfy it")
            if spec is True:  # any JSON value
                spec = {}
            if not isinstance(spec, dict):
                raise ConstraintError("a JSON schema must be an object")
        elif kind == "choice":
            if not isinstance(spec, (list, tuple)) or not spec or not all(isinstance(c, str) and c for c in spec):
                raise ConstraintError("a choice must be a non-empty list of non-empty strings")
            spec = tuple(spec)
        elif kind in ("regex", "grammar"):
            if not isinstance(spec, str) or not spec:
                raise ConstraintError(f"a {kind} must be a non-empty string")
        over = check_limits(kind, spec)  # before anything compiles: these refuse in microseconds
        if over:
            raise ConstraintError(f"invalid {kind}: {over}")
        if kind == "json_schema":
            spec = json.dumps(spec)  # key order kept: properties are generated in it
        c = cls(kind, spec)
        try:
            c.grammar()
        except ValueError as e:  # e.g. nesting past the schema parser's recursion limit (64 levels)
            why = f"it nests too deep ({e})" if "recursion limit" in str(e) else str(e)
            raise ConstraintError(f"invalid {kind}: {why}") from None
        return c

    def grammar(self) -> str:
        return _grammar(self.kind, self.spec)


@functools.lru_cache(maxsize=256)
def _grammar(kind: str, spec) -> str:
    from llguidance import LLMatcher

    # JSON on one line (", " and ": " between items): with free whitespace a small model can pad
    # an object with newlines until max_tokens (seen on the 135M model); a schema's own
    # "x-guidance" options still win
    one_line = {"whitespace_flexible": False}
    if kind == "json":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=one_line)
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec, defaults=one_line)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":  # Lark string literals take JSON's escapes
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
    return LLMatcher.grammar_from_lark(spec)


class Grammars:
    """Matchers for one model's tokenizer. The llguidance tokenizer takes ~0.5 s to build (the
    49k-token vocabulary), so it is built at the first constrained request, not at load.

    `prepare` compiles a constraint once (the worker first, localllm.grammar_worker, then here) and
    keeps the result, a failure too; the server calls it off the event loop and off the engine's
    thread. `matcher` copies a prepared one (a millisecond), preparing it first when nobody did."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_ids: list[int],
                 cache_size: int = 64):
        from .grammar_worker import GrammarChecker

        self._json, self.vocab_size, self.eos_ids = tokenizer_json, vocab_size, eos_ids
        self.checker = GrammarChecker(tokenizer_json, vocab_size, eos_ids)
        self._ready: OrderedDict[Constraint, object] = OrderedDict()  # a matcher, or the ConstraintError
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._tokenizer_lock:  # two first requests at once build it once
            if not hasattr(self, "_tokenizer"):
                from llguidance import LLTokenizer

                self._tokenizer = LLTokenizer(self._json(), n_vocab=self.vocab_size, eos_token=self.eos_ids)
            return self._tokenizer

    def prepare(self, constraint: Constraint):
        """The compiled constraint (a matcher in its initial state, never handed out: see
        matcher), or ConstraintError with llguidance's message, or the worker's (a crash, a
        compile past its time limit)."""
        from .grammar_worker import WorkerError, compile_grammar

        with self._lock:
            done = self._ready.get(constraint)
            if done is not None:
                self._ready.move_to_end(constraint)
        if done is None:
            grammar = constraint.grammar()
            keep = True
            try:
                error = self.checker.check(grammar)
            except WorkerError as e:
                error = str(e)
                keep = "crashed" in error  # a crash is the grammar's; an overrun may be a busy machine's
            if not error:  # the worker survived it: the same compile here is safe
                m = compile_grammar(self.tokenizer, grammar)
                error = m.get_error()
            done = ConstraintError(f"invalid {constraint.kind}: {_message(error)}") if error else m
            if keep:
                with self._lock:
                    self._ready[constraint] = done
                    while len(self._ready) > self._cache_size:
                        self._ready.popitem(last=False)
        if isinstance(done, ConstraintError):
            raise ConstraintError(str(done))
        return done

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh matcher for one sequence."""
        return Matcher(self.prepare(constraint).deep_copy())

    def close(self) -> None:
        self.checker.close()


# the matcher's CPU time for one token (masks + consuming it); normally 0.01-20 ms. CPU time of the
# calling thread, not wall time: a busy machine that preempts the engine thread must not fail a grammar
TOKEN_BUDGET_S = 0.25


class Matcher:
    """One sequence's llguidance matcher, timed: its masks are computed on the engine's thread,
    between every other request's tokens, and an ambiguous grammar (`s: s s s | s s | "x"`) makes
    each token slower than the last (0.5 s after ~150 tokens, 20 s in all) without reaching
    llguidance's own limits. More than `budget_s` for one token puts it in an error state of its
    own, which the engine ends the sequence with, as with llguidance's errors (is_error /
    get_error): no other request is held up by more than that per step."""

    def __init__(self, matcher, budget_s: float = TOKEN_BUDGET_S):
        self._m, self.budget_s = matcher, budget_s
        self._spent = 0.0  # since the last token was consumed
        self._slow: str | None = None

    def _timed(self, fn, *args):
        t0 = time.thread_time()
        result = fn(*args)
        self._spent += time.thread_time() - t0
        if self._spent > self.budget_s and self._slow is None:
            self._slow = (f"it took {self._spent:.2f} s of CPU to decode one token under it, more than the "
                          f"{self.budget_s:g} s this server allows")
        return result

    def compute_bitmask(self) -> bytes:
        return self._timed(self._m.compute_bitmask)

    def consume_token(self, token: int) -> bool:
        ok = self._timed(self._m.consume_token, token) and self._slow is None
        self._spent = 0.0
        return ok

    def is_error(self) -> bool:
        return self._slow is not None or self._m.is_error()

    def get_error(self) -> str:
        return self._slow or self._m.get_error()

    def is_stopped(self) -> bool:
        return self._m.is_stopped()

    def rollback(self, n: int) -> bool:
        return self._m.rollback(n)


def _message(error: str) -> str:
    """llguidance's message on one line, with what its terse names mean."""
    text = " ".join(error.replace("<non-verbose/>", "").split())
    if text.startswith("NoExtensionBias"):
        return "no output can satisfy it (e.g. a $ref that only refers to itself)"
    return text


def allowed(matcher, vocab_size: int) -> torch.Tensor:
    """bool [vocab_size]: the tokens the matcher allows next (its bitmask, bit i of word i // 32).
    A matcher in its error state allows nothing; then every token, so that the row samples as
    usual (an all-refusing row turns the probabilities to NaN) and the engine ends the sequence
    with the matcher's error when it consumes the token."""
    if matcher.is_error():
        return torch.ones(vocab_size, dtype=torch.bool)
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return torch.from_numpy(bits[:vocab_size].astype(bool))


def draft_masks(matcher, drafts: list[int], vocab_size: int) -> torch.Tensor:
    """bool [len(drafts) + 1, vocab_size]: what the matcher allows after the pending token and
    after each prefix of a speculative proposal, for verifying it under the constraint. The
    drafts are consumed only to compute the masks and rolled back: the engine consumes what it
    accepts. Rows past a draft the grammar refuses, or past the grammar's end, allow everything
    (acceptance stops before them; an all-refusing row would turn the probabilities to NaN)."""
    every = torch.ones(vocab_size, dtype=torch.bool)
    masks, consumed = [], 0
    for d in drafts:
        masks.append(allowed(matcher, vocab_size))
        if matcher.is_stopped() or not masks[-1][d] or not matcher.consume_token(d):
            break
        consumed += 1
    if len(masks) == consumed:  # every draft consumed: the bonus token's row
        masks.append(every if matcher.is_stopped() else allowed(matcher, vocab_size))
    masks += [every] * (len(drafts) + 1 - len(masks))
    if consumed:
        matcher.rollback(consumed)
    return torch.stack([m if m.any() else every for m in masks])
