"""README.md is executable: every example in it (tests/readme_examples.py says how they are read)
runs here exactly as printed, through bash, with this venv's bin first on PATH (`localllm` and
`python` are the project's), in a scratch working directory with its own LOCALLLM_HOME and HF_HOME
(empty: only the embedded model is local) and HF_ENDPOINT on loopback (the test mirror for `pull`;
elsewhere a closed port, so nothing reaches the internet). What the README shows it printing is
checked line by line; the parts that change between runs are named per test (VOLATILE).

EXERCISED_BY lists every example, by its key (a command on one line, or `python: ` + a program's
first line), with the test that runs it. test_every_readme_example_is_exercised fails when the
README has an example the table lacks, or the table names one the README no longer has: a new
example is one line there plus a test (or an existing test) that runs it. Tests marked `slow`
(minutes: quantizing, the benchmarks) run with `make test-slow`; those marked `gpu` only on a CUDA
machine (`pytest -m gpu`); `make test` is the suite itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import end_builders
from pty_term import PtyProcess
from readme_examples import Example, check_output, readme_examples

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SUITE = "the suite itself: .ci/run runs `make test` on every change"
SLOW_SUITE = "the slow suite itself (the tests marked slow here)"

# README example (its key) -> the test that runs it, or what runs it when no test can
EXERCISED_BY = {
    "make run": "test_make_run",
    "make test": SUITE,
    "make test-slow": SLOW_SUITE,
    'echo "What is the capital of France?" | localllm run --temperature 0 -v': "test_run_verbose",
    "localllm run smollm2-135x hello": "test_run_errors",
    'localllm run --image photo.png "What is in this picture?"': "test_vision_text_only_model",
    "localllm run < /dev/null": "test_run_errors",
    "localllm run --temperature -1 hi": "test_run_errors",
    "yes word | head -200 | localllm run --ctx 64": "test_run_errors",
    "localllm chat --temperature 0": "test_chat_transcript",
    "localllm pull test-org/tiny": "test_pull_transcript",
    "HF_HUB_OFFLINE=1 localllm pull qwen2.5-0.5b": "test_pull_transcript",
    "localllm list": "test_list_show_rm",
    "localllm show --prompt hi": "test_list_show_rm",
    "localllm rm smollm2-135m": "test_list_show_rm",
    "localllm serve --api-key sk-local": "test_serve_transcript",
    "curl -s localhost:8000/v1/chat/completions -H \"Authorization: Bearer sk-local\" -H 'Content-Type: "
    "application/json' -d '{\"model\": \"smollm2\", \"messages\": [{\"role\": \"user\", \"content\": \"What is "
    "the capital of France?\"}], \"temperature\": 0, \"max_tokens\": 32}'": "test_serve_transcript",
    "curl -sN localhost:8000/v1/completions -H \"Authorization: Bearer sk-local\" -H 'Content-Type: "
    "application/json' -d '{\"model\": \"smollm2\", \"prompt\": \"1, 2, 3,\", \"temperature\": 0, "
    "\"max_tokens\": 4, \"stream\": true}'": "test_serve_transcript",
    "curl -s localhost:8000/v1/chat/completions -H \"Authorization: Bearer sk-local\" -H 'Content-Type: "
    "application/json' -d '{\"model\": \"smollm2\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], "
    "\"max_tokens\": 9000}'": "test_serve_transcript",
    "curl -s localhost:8000/v1/models": "test_serve_transcript",
    "curl -s localhost:8000/v1/responses -H \"Authorization: Bearer sk-local\" -H 'Content-Type: application/json' "
    "-d '{\"model\": \"smollm2\", \"input\": \"What is the capital of France?\", \"temperature\": 0, "
    "\"max_output_tokens\": 32}'": "test_serve_transcript",
    "curl -s localhost:8000/v1/messages -H \"x-api-key: sk-local\" -H 'Content-Type: application/json' -d "
    "'{\"model\": \"smollm2\", \"max_tokens\": 32, \"temperature\": 0, \"messages\": [{\"role\": \"user\", "
    "\"content\": \"What is the capital of France?\"}]}'": "test_serve_transcript",
    "curl -s localhost:8000/v1/chat/completions -H \"Authorization: Bearer sk-local\" -H 'Content-Type: "
    "application/json' -d '{\"model\": \"smollm2\", \"messages\": [{\"role\": \"user\", \"content\": \"What "
    "is the weather in Paris?\"}], \"temperature\": 0, \"tools\": [{\"type\": \"function\", \"function\": "
    "{\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": "
    "{\"type\": \"string\"}}, \"required\": [\"city\"]}}}]}'": "test_serve_transcript",
    "cat oai.py": "test_serve_transcript",
    "python oai.py": "test_serve_transcript",
    "localllm pull qwen2.5-coder-0.5b": "test_fim_example",
    "curl -sf localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{\"model\": "
    "\"qwen2.5-coder-0.5b\", \"prompt\": \"def add(a, b):\\n    return \", \"suffix\": "
    "\"\\n\\nprint(add(1, 2))\\n\", \"max_tokens\": 16, \"temperature\": 0}'": "test_fim_example",
    "curl -sf localhost:8000/infill -H 'Content-Type: application/json' -d '{\"model\": \"qwen2.5-coder-0.5b\", "
    "\"input_extra\": [{\"filename\": \"util.py\", \"text\": \"import math\\n\"}], \"input_prefix\": "
    "\"def area(r):\\n    return \", \"input_suffix\": \"\\n\", \"n_predict\": 16}'": "test_fim_example",
    "python: from localllm import LLM, SamplingParams": "test_python_api",
    "localllm run --dry-run": "test_planner_dry_runs",
    "localllm run llama3.1-8b --dry-run --max-memory 12 --device cpu": "test_planner_dry_runs",
    "localllm run qwen2.5-7b --dry-run --max-memory 6": "test_planner_dry_runs",
    "localllm quantize smollm2-135m --method gptq -o smol-gptq": "test_quantize_transcript",
    'localllm run ./smol-gptq --temperature 0 -n 12 "What is the capital of France?"': "test_quantize_transcript",
    "localllm quantize smollm2-135m --method rtn -o smol-rtn": "test_quantize_transcript",
    "printf 'Rewrite this code with one change: rename the variable total to result.\\n\\ndef summarize(values):"
    "\\n    total = 0\\n    for v in values:\\n        total += v\\n    return total\\n' | localllm run "
    "--temperature 0 -v --draft ngram": "test_speculative_ngram",
    "localllm run --build -n 4 hi > /dev/null": "test_ps_transcript",
    "localllm ps": "test_ps_transcript",
    "localllm ps --stop": "test_ps_transcript",
    "localllm bench --threads 2": "test_benchmarks_block",
    "make bench-setup": "test_benchmarks_block",
    "python bench/make_gguf.py llama-1b": "test_benchmarks_block",
    "python bench/compare.py --threads 2": "test_benchmarks_block",
    "python bench/check_compiled.py": "test_benchmarks_block",
    "python bench/build_slowdown.py": "test_benchmarks_block",
    "python bench/serve_decode.py": "test_benchmarks_block",
    "python bench/check_kv.py": "test_benchmarks_block",
    'localllm embed "The cat sat on the mat." "A kitten rested on the rug."': "test_embed_cli",
    "localllm serve": "test_embeddings_transcript",
    "curl -s localhost:8000/api/embed -d '{\"model\": \"all-minilm\", \"input\": [\"The cat sat on the mat.\", "
    "\"A kitten rested on the rug.\"], \"dimensions\": 4}'": "test_embeddings_transcript",
    "curl -s localhost:8000/v1/embeddings -H 'Content-Type: application/json' -d '{\"model\": \"all-minilm\", "
    "\"input\": \"hello\", \"dimensions\": 4}'": "test_embeddings_transcript",
    "curl -s localhost:8000/api/chat -d '{\"model\": \"all-minilm\", \"messages\": [{\"role\": \"user\", "
    "\"content\": \"hi\"}]}'": "test_embeddings_transcript",
    "bash bench/gpu_check.sh": "test_gpu_check_block",
    "python bench/gpu_e2e.py --models smollm2-135m --batches 1,8": "test_gpu_check_block",
}
LABELS = {SUITE, SLOW_SUITE}

# the first run of a model in a fresh LOCALLLM_HOME says this once (the README shows it under
# "The compiled step"); the transcripts are of later runs
BUILD_NOTICE = r"building the compiled step for this model in the background \(.*\) into .*"
# a one-shot run's first use of a model says this once instead (also shown there)
RUN_HINT = r"no compiled step for this model yet: decode runs eagerly; .*"
# the first use of a CPU kernel on a machine builds it once (a fresh CI machine has none yet)
KERNEL_NOTICE = r"building the CPU .* kernel \(once per machine, a few seconds\) into .*"
TIMING = [r"TTFT: \d+ ms", r"\d+(\.\d+)? tok/s"]
KERNEL = [r"AVX-512 VNNI|AVX2"]  # the CPU's instruction set, in the int4 kernel's name


def examples_by_key() -> dict[str, list[Example]]:
    by: dict[str, list[Example]] = {}
    for ex in readme_examples():
        by.setdefault(ex.key, []).append(ex)
    return by


def block_of(key: str) -> list[Example]:
    """The examples of the README block that holds `key`'s (first) example, in order."""
    first = examples_by_key()[key][0]
    return [ex for ex in readme_examples() if ex.block == first.block]


def test_every_readme_example_is_exercised():
    by = examples_by_key()
    print("README examples:\n" + "\n".join(f"  line {exs[0].line}: {key}" for key, exs in by.items()))
    missing = [f"line {exs[0].line}: {key}" for key, exs in by.items() if key not in EXERCISED_BY]
    stale = [key for key in EXERCISED_BY if key not in by]
    assert not missing and not stale, (
        "README examples no test runs (add each to EXERCISED_BY with its test):\n  " + "\n  ".join(missing)
        + "\nEXERCISED_BY names examples the README no longer has:\n  " + "\n  ".join(stale))
    for key, by_what in EXERCISED_BY.items():
        if by_what not in LABELS:
            assert callable(globals().get(by_what)) and by_what.startswith("test_"), f"{key!r}: no test {by_what}"
    # the labels are honest: `make test` is what CI runs, `make test-slow` runs the slow tests
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert "-m slow" in (ROOT / "Makefile").read_text()


# ---- running an example -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """(environment, working directory) for the examples: a user's shell with this venv first on PATH."""
    root = tmp_path_factory.mktemp("readme")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "LOCALLLM_MODELS"))}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", LOCALLLM_HOME=str(root / "home"),
               HF_HOME=str(root / "hf"), HF_ENDPOINT="http://127.0.0.1:9", PYTHONUNBUFFERED="1")
    (root / "work").mkdir()
    yield env, root / "work"
    end_builders([env["LOCALLLM_HOME"]])


def sh(ex: Example, env: dict, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """The example's text through bash, stdout and stderr into one stream as a terminal shows them."""
    try:
        return subprocess.run(["bash", "-c", ex.text], env=env, cwd=cwd, stdin=subprocess.DEVNULL, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    finally:
        end_builders([env["LOCALLLM_HOME"]])  # the compiled step's builder competes for the CPU with what follows


def check(ex: Example, rc: int, out: str, volatile=(), shown=None) -> None:
    where = f"README line {ex.line}: {ex.key}"
    assert rc == ex.exit_code, f"{where}: exit {rc}, the README says {ex.exit_code}\n{out}"
    shown = ex.output if shown is None else shown
    if shown is not None:  # a ```bash example shows no output: its exit status is the check
        check_output(out, shown, volatile, [BUILD_NOTICE, RUN_HINT, KERNEL_NOTICE], where)


def run_block(key: str, env, cwd, volatile=()) -> None:
    for ex in block_of(key):
        r = sh(ex, env, cwd)
        check(ex, r.returncode, r.stdout, volatile)


# ---- the examples ---------------------------------------------------------------------------------
def test_make_run(tmp_path):
    """`make run` with the project's Makefile in a checkout whose .venv is this test run's (already
    set up: make's setup step is then done, and nothing is installed)."""
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    os.utime(tmp_path / "pyproject.toml", (0, 0))  # older than .venv/.installed
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "localllm").symlink_to(BIN / "localllm")
    (tmp_path / ".venv" / ".installed").touch()
    # a make run by the suite under `make test` would otherwise inherit the outer make's level
    # and print "make[1]: Entering directory ..."
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    env["LOCALLLM_HOME"] = str(tmp_path / "home")
    for ex in examples_by_key()["make run"]:
        r = sh(ex, env, tmp_path)
        check(ex, r.returncode, r.stdout)


def test_run_verbose(sandbox):
    run_block('echo "What is the capital of France?" | localllm run --temperature 0 -v', *sandbox, volatile=TIMING)


def test_run_errors(sandbox):
    run_block("localllm run smollm2-135x hello", *sandbox)


def test_vision_text_only_model(sandbox):
    """A vision model is no README download (gated, gigabytes): tests/test_vision*.py run the
    image paths on a tiny Gemma 3 checkpoint; here the embedded text-only model refuses one."""
    run_block('localllm run --image photo.png "What is in this picture?"', *sandbox)


def test_speculative_ngram(sandbox):
    run_block(next(k for k in EXERCISED_BY if k.startswith("printf 'Rewrite")), *sandbox,
              volatile=[*TIMING, r"\d+/\d+ proposals accepted \(\d+%\), \d+\.\d\d tokens"])


def test_planner_dry_runs(sandbox):
    # what is free on this machine; the rest of the plan is fixed by --max-memory
    run_block("localllm run --dry-run", *sandbox, volatile=[r"\d+\.\d\d GiB available"])


def test_list_show_rm(sandbox):
    run_block("localllm list", *sandbox)


def test_ps_transcript(sandbox):
    """`run --build` leaves the builder running after it exits; ps lists it, ps --stop ends it (the
    examples run one after the other without ending the builder in between)."""
    env, cwd = sandbox
    try:
        for ex in block_of("localllm ps --stop"):
            r = subprocess.run(["bash", "-c", ex.text], env=env, cwd=cwd, stdin=subprocess.DEVNULL, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
            check(ex, r.returncode, r.stdout)
    finally:
        end_builders([env["LOCALLLM_HOME"]])


def test_python_api(sandbox):
    env, cwd = sandbox
    (ex,) = examples_by_key()["python: from localllm import LLM, SamplingParams"]
    (cwd / "api_example.py").write_text(ex.text)
    r = subprocess.run(["bash", "-c", "python api_example.py"], env=env, cwd=cwd, text=True, timeout=300,
                       capture_output=True)
    end_builders([env["LOCALLLM_HOME"]])
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()[:2]
    ids = json.loads(first.split(" stop ")[1])
    assert first.startswith("The capital of France is Paris. stop [") and len(ids) == 8, r.stdout
    assert second.strip(), r.stdout


def test_chat_transcript(sandbox):
    """The REPL on a terminal (TERM=dumb: prompt-toolkit's plain prompt, the screen is plain lines):
    each `>>> TEXT` is typed at the prompt, a lone `>>>` is Ctrl-C there, and the reply line with
    `^C` gets Ctrl-C once it starts."""
    env, cwd = sandbox
    (ex,) = examples_by_key()["localllm chat --temperature 0"]
    term = PtyProcess(ex.text, {**env, "TERM": "dumb"}, str(cwd))
    prompts = 0
    try:
        for line in ex.output[1:]:
            if line.startswith(">>>"):
                term.wait_for(lambda n=prompts: term.raw.count(b">>> ") > n and term.echo_off(), 180, "prompt")
                prompts += 1
                term.write(line[4:].encode() + b"\r" if line.strip() != ">>>" else b"\x03")
            elif "^C" in line:
                start = line[:16].encode()
                term.wait_for(lambda s=start: s in term.raw.rsplit(b">>> ", 1)[-1], 180, f"reply {start!r}")
                term.write(b"\x03")
        rc, screen = term.finish(60)
    finally:
        term.kill()
        end_builders([env["LOCALLLM_HOME"]])
    # the reply Ctrl-C stopped: where it stopped depends on the machine's speed
    check(ex, rc, screen, [*TIMING, *KERNEL, r"(?<=Once upon a time).*\^C.*"])


def test_pull_transcript(sandbox, tmp_path):
    """On a terminal (the progress display is drawn only there), against the loopback hub mirror,
    into a fresh HF_HOME; the README's $HF_HOME is /tmp/llm-demo/hf."""
    from hub_mirror import HubMirror, make_repo, tiny_checkpoint

    env, cwd = sandbox
    hf = tmp_path / "hf"
    with HubMirror({"test-org/tiny": make_repo(tiny_checkpoint())}) as mirror:
        for ex in block_of("localllm pull test-org/tiny"):
            term = PtyProcess(ex.text, {**env, "HF_HOME": str(hf), "HF_ENDPOINT": mirror.url}, str(cwd))
            rc, screen = term.finish(120)
            shown = [s.replace("/tmp/llm-demo/hf", str(hf)) for s in ex.output]
            check(ex, rc, screen, [r"━+", r"(?:\d+\.\d MB/s|\?) +(?=\d:\d\d:\d\d)", r"\d:\d\d:\d\d", r"in \d+\.\d s, \d+\.\d MB/s"],
                  shown=shown)


def port_8000_is_free() -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", 8000))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def serving(command: str, env: dict, cwd: Path, log_path: Path):
    """`command` (a README `localllm serve` line) running on port 8000 until the block ends, then
    SIGTERM (as Ctrl-C in its terminal); yields (the process, its log file) once /health answers."""
    assert port_8000_is_free(), "port 8000 is in use: the README's server example listens there; stop what holds it"
    log = open(log_path, "w+")
    proc = subprocess.Popen(["bash", "-c", command], env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, f"the server did not start:\n{log.read()}"
            try:
                if httpx.get("http://127.0.0.1:8000/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield proc, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
        end_builders([env["LOCALLLM_HOME"]])


def test_serve_transcript(sandbox):
    """`localllm serve --api-key sk-local` as printed (so on port 8000, which the README's curl
    lines and oai.py use), then each command of the transcript in order while it runs; its own
    output is checked once it has stopped (SIGTERM, as Ctrl-C in its terminal)."""
    env, cwd = sandbox
    exs = block_of("localllm serve --api-key sk-local")
    serve, rest = exs[0], exs[1:]
    with serving(serve.text, env, cwd, cwd / "serve.log") as (proc, log):
        for ex in rest:
            if ex.key == "cat oai.py":  # the README gives the file by showing it
                (cwd / "oai.py").write_text("\n".join(ex.output) + "\n")
            r = sh(ex, env, cwd)
            check(ex, r.returncode, r.stdout, [r'(?<="created":)\d+'])
    rc = proc.returncode
    log.seek(0)
    check(serve, rc, log.read(), [r"loaded in \d+\.\d s"])


@pytest.mark.slow  # a coder checkpoint written by transformers, a server and a pull: tests/test_fim.py covers FIM in CI
def test_fim_example(sandbox, tmp_path):
    """The fill-in-the-middle commands as printed, with plain `localllm serve` on port 8000 and the
    loopback hub mirror holding a 2-layer checkpoint with Qwen2.5-Coder's FIM tokens under the
    registry's repo id (the hub itself is out of reach here): each must exit 0 (curl -f: no HTTP
    error) and answer an insertion."""
    from hub_mirror import HubMirror, make_repo, tiny_coder_checkpoint

    env, cwd = sandbox
    repo = "Qwen/Qwen2.5-Coder-0.5B"
    with HubMirror({repo: make_repo(tiny_coder_checkpoint(tmp_path / "coder"))}) as mirror:
        env = {**env, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": mirror.url}
        with serving("localllm serve", env, cwd, tmp_path / "serve.log"):
            for ex in block_of("localllm pull qwen2.5-coder-0.5b"):
                r = sh(ex, env, cwd)
                check(ex, r.returncode, r.stdout)
                if "/v1/completions" in ex.text:
                    body = json.loads(r.stdout)
                    assert body["choices"][0]["finish_reason"] in ("stop", "length") and body["usage"]["completion_tokens"]
                elif "/infill" in ex.text:
                    body = json.loads(r.stdout)
                    assert body["stop"] is True and body["tokens_predicted"] >= 1


def test_embed_cli(sandbox):
    run_block('localllm embed "The cat sat on the mat." "A kitten rested on the rug."', *sandbox)


def test_embeddings_transcript(sandbox):
    """`localllm serve` (port 8000, as the README's curl lines) and the Embeddings section's requests
    while it runs; its own output is checked once it has stopped."""
    env, cwd = sandbox
    exs = block_of("localllm serve")
    serve, rest = exs[0], exs[1:]
    with serving(serve.text, env, cwd, cwd / "serve-embed.log") as (proc, log):
        for ex in rest:
            r = sh(ex, env, cwd)
            check(ex, r.returncode, r.stdout, [r'(?<="total_duration":)\d+', r'(?<="load_duration":)\d+'])
    rc = proc.returncode
    log.seek(0)
    check(serve, rc, log.read(), [r"loaded in \d+\.\d s"])


@pytest.mark.slow
def test_quantize_transcript(sandbox):
    """GPTQ takes a minute or more on 2 cores (make test-slow)."""
    run_block("localllm quantize smollm2-135m --method rtn -o smol-rtn", *sandbox,
              volatile=[r"\d+ s\)"])


@pytest.mark.slow
def test_benchmarks_block():
    """The benchmarks, in the README's order (bench-setup before the comparison that needs it), in
    the checkout itself as the README means them; tens of minutes (make test-slow)."""
    for ex in block_of("localllm bench --threads 2"):
        r = subprocess.run(["bash", "-c", ex.text], cwd=ROOT, env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"},
                           text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=3600)
        assert r.returncode == 0, f"README line {ex.line}: {ex.key} exited {r.returncode}:\n{r.stdout[-4000:]}"


@pytest.mark.gpu
def test_gpu_check_block():
    """Only on a CUDA machine (pytest -m gpu): the GPU check of "The compiled step"."""
    for ex in block_of("bash bench/gpu_check.sh"):
        r = subprocess.run(["bash", "-c", ex.text], cwd=ROOT, env={**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"},
                           text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=1200)
        assert r.returncode == 0, f"README line {ex.line}: {ex.key} exited {r.returncode}:\n{r.stdout[-4000:]}"
