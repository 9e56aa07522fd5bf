"""Constrained decoding (localllm.structured, llguidance) through the engine on the real model:
outputs that parse and validate, constrained and free requests in one batch, clear errors."""

import json
import re

import jsonschema
import pytest
from conftest import make_engine

from localllm.sampling import SamplingParams
from localllm.structured import Constraint, ConstraintError, allowed

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(int4_model):
    return make_engine(int4_model)


def ask(engine, text: str, constraint: Constraint | None, **kw):
    kw.setdefault("max_tokens", 80)
    *_, last = engine.generate([{"role": "user", "content": text}], SamplingParams(constraint=constraint, **kw))
    return last


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.8, 1), (1.5, 2)])
def test_json_schema_output_validates(engine, temperature, seed):
    out = ask(engine, "Describe a person as JSON.", Constraint.make("json_schema", PERSON),
              temperature=temperature, seed=seed)
    assert out.finish_reason == "stop"
    value = json.loads(out.text)
    jsonschema.validate(value, PERSON)
    assert list(value) == ["name", "age", "tags"]  # generated in the schema's order
    assert engine.block_manager.num_used_blocks >= 0 and not engine.has_unfinished()


def test_any_json_object_regex_and_choice(engine):
    obj = ask(engine, "What is the capital of France? Answer in JSON.", Constraint.make("json"), temperature=0)
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", ask(engine, "A phone number?", Constraint.make("regex", r"[0-9]{3}-[0-9]{4}"),
                                                  temperature=0).text)
    choice = ask(engine, "Is the sky blue?", Constraint.make("choice", ["yes", "no", "it depends"]), temperature=0.9, seed=4)
    assert choice.text in ("yes", "no", "it depends") and choice.finish_reason == "stop"
    grammar = 'start: "(" num ("," num)* ")"\nnum: /[0-9]+/'
    assert re.fullmatch(r"\([0-9]+(,[0-9]+)*\)", ask(engine, "A tuple", Constraint.make("grammar", grammar),
                                                      temperature=0, max_tokens=30).text)


def test_constrained_and_free_requests_share_a_batch(engine):
    """The mask applies to its own row only: a free request's greedy tokens are the same beside a
    constrained one as alone."""
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    *_, alone = engine.generate([{"role": "user", "content": "Tell me about cats."}], free)
    a = engine.add_request([{"role": "user", "content": "Tell me about cats."}], free)
    b = engine.add_request([{"role": "user", "content": "A person as JSON"}],
                           SamplingParams(temperature=0, max_tokens=80, constraint=Constraint.make("json_schema", PERSON)))
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert done[a].token_ids == alone.token_ids
    jsonschema.validate(json.loads(done[b].text), PERSON)


def test_mask_allows_what_the_grammar_allows(engine):
    m = engine.grammars.matcher(Constraint.make("json"))
    ok = allowed(m, engine.model_config.vocab_size)
    tok = engine.tokenizer
    assert ok[tok.encode("{")[0]] and not ok[tok.encode("hello")[0]] and not ok[sorted(engine.eos_ids)[0]]
    assert ok.shape == (engine.model_config.vocab_size,)


@pytest.mark.parametrize("kind,spec,match", [
    ("json_schema", "not a schema", "must be an object"),
    ("json_schema", False, "accepts no value"),
    ("choice", [], "non-empty list"),
    ("xml", None, "unknown constraint kind"),
])
def test_bad_constraints_are_clear_errors(kind, spec, match):
    with pytest.raises(ConstraintError, match=match):
        Constraint.make(kind, spec)


@pytest.mark.parametrize("kind,spec,match", [
    ("json_schema", {"type": "object", "properties": {"a": {"type": "strin"}}}, "invalid json_schema: .*strin"),
    ("regex", "[0-9", "invalid regex"),
    ("grammar", "start: undefined_rule", "invalid grammar"),
    ("json_schema", {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "no output can satisfy it"),
])
def test_constraints_that_do_not_compile_are_clear_errors(engine, kind, spec, match):
    """Compiled for the model's tokenizer (by the worker process, then here), once: the second
    time the same error comes from the cache, and the engine refuses the request with it."""
    c = Constraint.make(kind, spec)
    starts = engine.grammars.checker.starts
    for _ in range(2):
        with pytest.raises(ConstraintError, match=match):
            engine.grammars.prepare(c)
    with pytest.raises(ConstraintError, match=match):
        engine.add_request("Hi", SamplingParams(max_tokens=4, constraint=c))
    assert engine.grammars.checker.starts <= max(starts, 1) and not engine.has_unfinished()


def test_greedy_under_a_mask_is_the_masked_exact_argmax(engine):
    """Greedy constrained rows take the int4 ranking + exact rescoring among allowed tokens: the
    same token as the exact head's masked argmax (always when fewer than k tokens are allowed)."""
    import torch

    head = engine.runner.model.head
    assert head.fast is not None  # the int4 model: the fast path is what runs
    V, H = head.exact.shape
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, H, generator=g) * 3
    for density in (0.5, 0.01, 5 / V):
        mask = torch.rand(6, V, generator=g) < density
        mask[:, 0] = True  # never empty
        want = head(h).masked_fill(~mask, float("-inf")).argmax(-1)
        assert torch.equal(head.greedy(h, mask), want), density


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculation_keeps_working_under_a_constraint(int4_model, temperature):
    """n-gram proposals are verified under the constraint's masks (computed per draft position
    and rolled back): drafts are accepted, and greedy output equals plain constrained decoding."""
    prompt = [{"role": "user", "content": 'Copy this JSON exactly: {"name": "Ada Lovelace", "age": 36, '
                                          '"tags": ["a", "b"]} and again {"name": "Ada Lovelace", "age": 36, '
                                          '"tags": ["a", "b"]}'}]
    params = SamplingParams(temperature=temperature, seed=5, max_tokens=60, constraint=Constraint.make("json_schema", PERSON))
    *_, plain = make_engine(int4_model).generate(prompt, params)
    spec = make_engine(int4_model, speculative="ngram", num_speculative_tokens=4)
    *_, out = spec.generate(prompt, params)
    jsonschema.validate(json.loads(out.text), PERSON)
    stats = spec.cache_stats()["speculative"]
    assert stats["proposed"] > 0 and stats["accepted"] > 0
    if temperature == 0:
        assert out.token_ids == plain.token_ids


def test_a_worker_crash_or_overrun_costs_one_check(engine):
    """The grammar worker (localllm.grammar_worker): a compile past its time limit, and a worker
    that dies of SIGSEGV mid-compile (what a too-deep grammar did to the server), are each a
    WorkerError saying so; the worker is killed, and the next check starts a fresh one."""
    import os
    import signal
    import threading

    from llguidance import LLMatcher

    from localllm.grammar_worker import GrammarChecker, WorkerError

    slow = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(f"c{i}") for i in range(50_000)))
    ok = Constraint.make("json").grammar()
    checker = GrammarChecker(engine.tokenizer.tok.to_str, engine.model_config.vocab_size, sorted(engine.eos_ids),
                             timeout_s=0.5)
    try:
        assert checker.check(ok) == "" and checker.starts == 1
        with pytest.raises(WorkerError, match="more than 0.5 s to compile"):
            checker.check(slow)
        assert checker._proc is None
        checker.timeout_s = 60
        assert checker.check(ok) == "" and checker.starts == 2
        pid = checker._proc.pid
        killer = threading.Timer(0.3, os.kill, (pid, signal.SIGSEGV))
        killer.start()
        with pytest.raises(WorkerError, match=r"crashed the grammar compiler \(signal 11\)"):
            checker.check(slow)
        killer.join()
        assert checker.check(ok) == "" and checker.starts == 3
    finally:
        checker.close()
    assert checker._proc is None
