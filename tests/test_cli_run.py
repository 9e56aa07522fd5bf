"""`localllm run` end to end, and the promised errors for bad input."""

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hostile_schemas import chain, deep

from localllm.model.loader import ModelLoadError, load_model

EXE = [sys.executable, "-m", "localllm.cli"]


def run(args, stdin="", env=None, timeout=180):
    e = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), **(env or {})}
    return subprocess.run(EXE + args, input=stdin, capture_output=True, text=True, timeout=timeout, env=e)


def test_pipe_answers_paris():
    r = run(["run", "--temperature", "0", "-v"], stdin="What is the capital of France?\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert r.stdout.endswith("\n") and "\x1b" not in r.stdout  # no escape codes when piped
    assert "prompt tokens: 37" in r.stderr and "finish: stop" in r.stderr


def test_stdin_goes_before_prompt_args_and_system_prompt():
    # the rendered prompt: system, then piped text, blank line, arguments
    from localllm.chat import render_chat
    from localllm.llm import build_engine

    eng = build_engine(None)
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "The cat sat on the mat.\n\nSummarize the text above."}]
    r = run(["run", "--temperature", "0", "-n", "1", "-v", "--system", "Be brief.", "Summarize the text above."],
            stdin="The cat sat on the mat.\n")
    assert r.returncode == 0, r.stderr
    n = len(eng.tokenizer.encode(render_chat(eng.tokenizer.chat_template, msgs)))
    assert f"prompt tokens: {n} " in r.stderr


def test_no_prompt_exits_2():
    r = run(["run"], stdin="")
    assert r.returncode == 2 and "no prompt" in r.stderr and "Traceback" not in r.stderr


def test_unknown_model_lists_close_matches():
    r = run(["run", "smollm2-135x", "hello", "there"])
    assert r.returncode == 1
    assert "unknown model 'smollm2-135x'" in r.stderr and "smollm2-135m" in r.stderr
    assert "Traceback" not in r.stderr


def test_prompt_longer_than_context_names_both_counts():
    r = run(["run", "--ctx", "64", "--temperature", "0"], stdin="word " * 200)
    assert r.returncode == 1, r.stderr
    assert "context is 64 tokens" in r.stderr and "prompt is 2" in r.stderr and r.stdout == ""


def test_bad_sampling_value_is_named():
    r = run(["run", "--top-p", "1.5", "hi"])
    assert r.returncode == 2 and "--top-p" in r.stderr and "Traceback" not in r.stderr


def test_missing_and_corrupt_files(tmp_path, gguf_path):
    r = run(["run", str(tmp_path / "nope.gguf"), "hi"])
    assert r.returncode == 1 and "nope.gguf" in r.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 100)
    with pytest.raises(ModelLoadError, match="bad magic"):
        load_model(bad)
    cut = tmp_path / "cut.gguf"
    with open(gguf_path, "rb") as f:
        cut.write_bytes(f.read(50_000_000))
    with pytest.raises(ModelLoadError, match=r"cut\.gguf: truncated file: tensor"):
        load_model(cut)
    header_cut = tmp_path / "header.gguf"
    with open(gguf_path, "rb") as f:
        header_cut.write_bytes(f.read(500_000))
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(header_cut)
    r = run(["run", str(cut), "hi"])
    assert r.returncode == 1 and "truncated" in r.stderr and "Traceback" not in r.stderr


def test_truncated_and_pickle_only_safetensors_dirs(tmp_path, tiny_model):
    src = Path(tiny_model.source)
    d = tmp_path / "cut"
    shutil.copytree(src, d)
    st = d / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: truncated safetensors file"):
        load_model(d)
    st.write_bytes(b"\xff" * 16)
    with pytest.raises(ModelLoadError, match="corrupt"):
        load_model(d)
    st.unlink()
    (d / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ModelLoadError, match="pickle checkpoints are never loaded"):
        load_model(d)


def test_enforce_eager_and_act_bits_reach_the_engine_config(monkeypatch):
    """--enforce-eager (GPU: no CUDA-graph replay) and --act-bits are passed down in EngineConfig,
    for run and chat (defaults: compiled, 16 bits)."""
    from typer.testing import CliRunner

    import localllm.cli as cli

    seen = []

    def fake_open(model, quant, device, config, max_memory=None):
        seen.append((config.compile, config.act_bits))
        raise SystemExit(3)

    monkeypatch.setattr(cli, "open_engine", fake_open)
    for args in (["run", "hi"], ["run", "--enforce-eager", "hi"], ["chat", "--enforce-eager"],
                 ["run", "--act-bits", "8", "hi"], ["chat", "--act-bits", "8"]):
        assert CliRunner().invoke(cli.app, args, input="").exit_code == 3
    assert seen == [(True, 16), (False, 16), (False, 16), (True, 8), (True, 8)]


def test_serve_passes_act_bits_to_every_model_it_loads(monkeypatch):
    """Plain `serve` (every model on demand) and `serve MODEL` hand --act-bits to the model pool's
    engine config; --engine vllm refuses it (vLLM runs its own kernels)."""
    from typer.testing import CliRunner

    import localllm.cli as cli
    import localllm.server.pool as pool

    seen = []

    def fake_pool(config, log=None):
        seen.append(config.engine_config.act_bits)
        raise SystemExit(3)

    monkeypatch.setattr(pool, "ModelPool", fake_pool)
    for args in (["serve", "--act-bits", "8"], ["serve", "smollm2", "--act-bits", "8"], ["serve"]):
        assert CliRunner().invoke(cli.app, args).exit_code == 3
    assert seen == [8, 8, 16]
    r = CliRunner().invoke(cli.app, ["serve", "smollm2", "--engine", "vllm", "--act-bits", "8"])
    assert r.exit_code == 2 and "--act-bits" in r.output


def test_act_bits_8_answers_and_other_widths_are_refused():
    """--act-bits 8 (the opt-in 8-bit activations in the CPU kernels) runs the default model to its
    answer; a width the kernels do not have is refused, naming the flag."""
    r = run(["run", "--act-bits", "8", "--temperature", "0", "-v"], stdin="What is the capital of France?\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    r = run(["run", "--act-bits", "4", "hi"])
    assert r.returncode == 2 and "--act-bits" in r.stderr and "Traceback" not in r.stderr


def test_gc_is_off_while_loading_and_back_once_the_engine_is_built(monkeypatch):
    """run/chat/serve start with the cyclic GC off (a faster cold start) and turn it back on, with
    the startup objects frozen, when the engine is built, or fails to build."""
    import gc

    import localllm.cli as cli
    import localllm.llm as llm

    states = []

    def fake_build(*a, **k):
        states.append(gc.isenabled())
        raise ValueError("stop here")

    monkeypatch.setattr(llm, "build_engine", fake_build)
    monkeypatch.setattr(sys, "argv", ["localllm", "run", "hi"])
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    frozen = gc.get_freeze_count()
    try:
        with pytest.raises(SystemExit) as e:
            cli.main()
        assert e.value.code == 2 and states == [False]
        assert gc.isenabled() and gc.get_freeze_count() > frozen
    finally:
        gc.unfreeze()
        gc.enable()
    monkeypatch.setattr(sys, "argv", ["localllm", "list"])
    with pytest.raises(SystemExit):
        cli.main()
    assert gc.isenabled()


def test_gguf_type_table_matches_the_gguf_package(gguf_path):
    """Our built-in ggml type table (kept to avoid importing gguf at start) equals the package's,
    and a type outside it is still resolved through the package."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from localllm.model import gguf as g

    for q in g._QTYPES.values():
        ref = GGMLQuantizationType(q.id)
        assert (q.name, (q.block, q.type_size)) == (ref.name, GGML_QUANT_SIZES[ref])
    iq4 = GGMLQuantizationType.IQ4_NL
    assert g.qtype(int(iq4)) == (int(iq4), "IQ4_NL", *GGML_QUANT_SIZES[iq4])
    kinds = {t.qtype.name for t in g.read_gguf(gguf_path).tensors.values()}
    assert {"Q4_1", "F32"} <= kinds


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}


def test_format_json_and_schema(tmp_path):
    """--format json / an inline schema / a schema file, through the installed executable."""
    import json

    import jsonschema

    exe = [str(Path(sys.executable).parent / "localllm"), "run"]

    def answer(*args):
        p = subprocess.run(exe + ["--temperature", "0", "--max-tokens", "80", *args], capture_output=True,
                           text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "2"})
        assert p.returncode == 0, p.stderr
        return p.stdout
    assert isinstance(json.loads(answer("--format", "json", "What is the capital of France? Answer in JSON.")),
                      dict)
    jsonschema.validate(json.loads(answer("--format", json.dumps(PERSON), "Describe a person.")), PERSON)
    f = tmp_path / "person.json"
    f.write_text(json.dumps(PERSON))
    jsonschema.validate(json.loads(answer("--format", str(f), "Describe a person.")), PERSON)




@pytest.mark.parametrize("value,says", [
    ("yaml", "not 'json'"), ("{oops", "not JSON"), ('{"type": "nonsense"}', "invalid json_schema"),
    (chain(1000), "more than the 65536"), (deep(200), "nests too deep"), (False, "accepts no value"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "no output can satisfy it"),
])
def test_bad_format_exits_2_naming_it(tmp_path, value, says):
    """A one-line error and exit 2, never a traceback or a crash: schemas as files (the issue's
    chain1000.json, deep200.json), the first three inline."""
    if not isinstance(value, str):
        f = tmp_path / "schema.json"
        f.write_text(__import__("json").dumps(value))
        value = str(f)
    p = run(["run", "--format", value, "hi"])
    errors = [line for line in p.stderr.splitlines() if line.startswith("Error:")]
    assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stderr, p.stderr
    assert "--format" in errors[0] and says in errors[0], p.stderr
