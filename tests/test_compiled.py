"""The compiled CPU step (localllm.engine.compiled_step, on the packages of localllm.model.compiled):
the default path of every engine.

CI-cheap: a 2-layer int4 GGUF, so each package compiles in seconds. The module's packages are
built once, by the real background builder process an engine starts; every test then checks
that the compiled steps give the eager path's tokens (alone, batched, with speculation, with
prefix-cache hits), and how damaged, stale or half-built packages are handled. The same check on
the real 30-layer model is `python bench/check_compiled.py`.
"""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import make_engine
from test_engine import prompts, run_all

from localllm.engine import compiled_step
from localllm.model import build_queue, compiled
from localllm.sampling import SamplingParams


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    path = tmp_path_factory.mktemp("localllm-home")
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCALLLM_HOME", str(path))  # packages of the test model stay out of ~/.cache
    yield path
    mp.undo()


@pytest.fixture(scope="module")
def tiny_int4(tiny_gguf, home):
    """Stored as the default model is: Q4_1 layers, the Q8_0 embedding and head read in place."""
    from localllm.model.layers import Q8Matrix
    from localllm.model.loader import load_model

    loaded = load_model(tiny_gguf, "auto")
    assert "int4" in loaded.precision and isinstance(loaded.model.head.exact, Q8Matrix)
    return loaded


@pytest.fixture(scope="module")
def background_build(tiny_int4):
    """An engine with the default config on a model that has no package yet: it answers eagerly,
    starts the background builder once, and switches to the packages at a step boundary."""
    reqs = prompts(2, seed=3)
    eager = run_all(make_engine(tiny_int4), reqs)
    notices = []
    handler = logging.Handler()
    handler.emit = lambda record: notices.append(record.getMessage())
    compiled_step.log.addHandler(handler)
    try:
        eng = make_engine(tiny_int4, compile=True)
        notices_at_start = list(notices)
        step = eng.runner.captured
        assert isinstance(step, compiled_step.CompiledStep)
        first = run_all(eng, reqs)
        calls_before = step.steps
        builder = step.builder
        assert step.wait(timeout=900), (compiled.cache_dir() / "build.log").read_text()[-3000:]
        again = run_all(eng, reqs)
    finally:
        compiled_step.log.removeHandler(handler)
    return {"eager": eager, "first": first, "again": again, "calls_before": calls_before, "step": step,
            "builder": builder, "notices_at_start": notices_at_start, "notices": notices}


def test_build_notice_comes_before_any_answer(background_build):
    """Said once, when the engine starts: from the first decode step it landed mid-answer."""
    at_start, all_notices = background_build["notices_at_start"], background_build["notices"]
    assert len(at_start) == 1 and "building the compiled step" in at_start[0]
    assert all_notices == at_start


def test_background_build_then_switch(background_build, tiny_int4):
    b = background_build
    assert isinstance(b["builder"], subprocess.Popen)  # started once, as a separate process
    assert b["builder"].wait(timeout=60) == 0
    assert b["calls_before"] == 0  # nothing waited for the build: the first answers were eager
    assert b["first"] == b["eager"] and b["again"] == b["eager"]
    assert b["step"].steps > 0 and b["step"].failed is None
    for kind in compiled.KINDS:
        path = compiled.package_path(tiny_int4.model, kind, tiny_int4.kv_dtype)
        assert path.is_file() and path.with_suffix(".json").is_file()
    assert not list(compiled.cache_dir().glob("*.tmp*"))


def test_compiled_equals_eager_alone_batched_and_with_prefix_hits(background_build, tiny_int4):
    reqs = prompts(4, seed=5)
    reqs.append(reqs[0][:40] + [7, 8, 9])  # a prefix-cache hit: its extend step has a cached prefix
    eager_alone = [run_all(make_engine(tiny_int4), [p])[0] for p in reqs]
    eng = make_engine(tiny_int4, compile=True)
    got_alone = [run_all(eng, [p])[0] for p in reqs]
    assert eng.runner.captured.kinds_used >= {"d1", "v1"}  # decode, and the prefix-hit extend
    assert eng.stats["cached_tokens"] > 0
    eng = make_engine(tiny_int4, compile=True, num_kv_blocks=300)  # another cache size
    got_batched = run_all(eng, reqs)
    assert "n" in eng.runner.captured.kinds_used
    assert got_alone == eager_alone and got_batched == eager_alone


@pytest.mark.parametrize("k", [2, 4])
def test_speculation_runs_compiled_and_keeps_the_tokens(background_build, tiny_int4, k):
    """n-gram speculation never pauses: its verify steps (pending + k tokens) go through the
    packages, and greedy output equals plain compiled decode."""
    reqs = [p * 3 for p in prompts(3, seed=11)]  # repeats: the n-gram proposer finds matches
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = run_all(make_engine(tiny_int4, compile=True), reqs, params)
    eng = make_engine(tiny_int4, compile=True, speculative="ngram", num_speculative_tokens=k)
    spec = run_all(eng, [list(p) for p in reqs], params)
    assert spec == plain
    assert eng.cache_stats()["speculative"]["proposed"] > 0
    assert {"v1", "n"} & eng.runner.captured.kinds_used


def test_compiled_step_serves_sampling_and_logprobs(background_build, tiny_int4):
    """Non-greedy requests use the package's hidden states with the eager sampler."""
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True, logprobs=2)
    reqs = prompts(2, seed=4)
    ref = run_all(make_engine(tiny_int4), reqs, params)
    eng = make_engine(tiny_int4, compile=True)
    assert run_all(eng, reqs, params) == ref
    assert eng.runner.captured.steps > 0


@pytest.mark.slow  # ~19 s of rebuilding: `make test-slow` (CI's budget; test_cache_integrity damages the other caches in CI)
def test_damaged_package_is_never_loaded_and_is_built_again(background_build, tiny_int4):
    path = compiled.package_path(tiny_int4.model, "d1", tiny_int4.kv_dtype)
    good = path.read_bytes()
    try:
        path.write_bytes(good[: len(good) // 2])  # a truncated copy
        with pytest.raises(ValueError, match="sha256"):
            compiled.load_package(tiny_int4.model, path)
        step = compiled_step.CompiledStep(tiny_int4.model, make_engine(tiny_int4).runner.kv_caches, background=False)
        assert step._runner("d1") is None and not path.exists()  # deleted, so it gets built again
        assert compiled.build_missing(tiny_int4.model, tiny_int4.kv_dtype) == ["d1"]
        assert compiled.load_package(tiny_int4.model, path) is not None
    finally:
        if not path.is_file():
            path.write_bytes(good)


@pytest.mark.slow  # ~18 s; `make test-slow`, outside CI's 20-minute budget
def test_killed_build_leaves_nothing_that_loads(background_build, tiny_int4, home, tmp_path):
    """A worker killed mid-way leaves no package under the real name (at most a temporary
    file, removed by the next build) and releases its lock."""
    path = compiled.package_path(tiny_int4.model, "v1", tiny_int4.kv_dtype)
    saved = path.read_bytes(), path.with_suffix(".json").read_bytes()
    path.unlink()
    job = tmp_path / "job.json"  # a job outside the queue: no builder picks it up
    job.write_text(json.dumps(compiled.job_spec(tiny_int4.model, tiny_int4.kv_dtype)))
    try:
        proc = build_queue.spawn_worker(job, home / "kill.log")
        deadline = time.monotonic() + 300
        while compiled.builder_pid(tiny_int4.model) != proc.pid and time.monotonic() < deadline:
            assert proc.poll() is None, (home / "kill.log").read_text()
            time.sleep(0.05)
        time.sleep(1.0)  # into the export / compile
        assert proc.poll() is None, "the builder finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert not path.exists()
        assert compiled.builder_pid(tiny_int4.model) is None  # the lock died with it
        assert compiled.build_missing(tiny_int4.model, tiny_int4.kv_dtype) == ["v1"]
        assert not list(compiled.cache_dir().glob("*.tmp*"))
    finally:
        if not path.is_file():
            path.write_bytes(saved[0])
            path.with_suffix(".json").write_bytes(saved[1])


@pytest.mark.slow  # ~22 s of building a second package: `make test-slow` (test_build_queue checks that rm drops a model's jobs)
def test_stale_packages_are_removed_and_rm_deletes_a_models_packages(background_build, tiny_int4, tmp_path):
    path = compiled.package_path(tiny_int4.model, "d1", tiny_int4.kv_dtype)
    stale = path.with_name(path.name.rsplit("-", 1)[0] + "-000000000000.pt2")
    stale.write_bytes(b"old code")
    saved = path.read_bytes(), path.with_suffix(".json").read_bytes()
    path.unlink()
    assert compiled.build_missing(tiny_int4.model, tiny_int4.kv_dtype) == ["d1"]
    assert path.is_file() and not stale.exists()
    elsewhere = compiled.remove_packages(tmp_path)  # another model's folder: nothing of ours
    assert elsewhere == 0 and path.is_file()
    try:
        assert compiled.remove_packages(tiny_int4.source) == len(compiled.KINDS)
        assert not list(compiled.cache_dir().glob("decode-*"))
    finally:
        path.write_bytes(saved[0])
        path.with_suffix(".json").write_bytes(saved[1])


def test_eager_config_has_no_captured_step(tiny_int4):
    assert make_engine(tiny_int4, compile=False).runner.captured is None


def proc_state(pid: int) -> str:
    """'T' when stopped (by SIGSTOP), else R/S/D/Z."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


SLEEPER = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGHUP, signal.SIG_IGN); "
           "print('ready', flush=True); time.sleep(60)"]


def wait_state(pid: int, stopped: bool, timeout: float = 10.0) -> bool:
    """Signals land asynchronously: poll until the process is (not) stopped."""
    deadline = time.monotonic() + timeout
    while (proc_state(pid) == "T") != stopped and time.monotonic() < deadline:
        time.sleep(0.01)
    return (proc_state(pid) == "T") == stopped


def test_builder_is_stopped_while_the_engine_has_work(tiny_int4, home, tmp_path):
    """A build beside a decode costs the decode ~94% on 2 cores (bench/build_slowdown.py): the
    engine stops the builder's worker (its process group) for each step and continues it when
    idle. Any compiled engine does, not only the one that queued the build."""
    eng = make_engine(tiny_int4, compile=True)
    eng.runner.captured.background = False  # no real build here: a stand-in process plays the worker
    proc = build_queue.spawn_in_group(SLEEPER, tmp_path / "log")
    state = build_queue.aoti_dir() / "builder.json"
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"pid": 0, "worker": proc.pid}))
    try:
        seen = []
        real = eng.runner.step

        def spy(*a, **kw):  # (a stop lands when the process is next scheduled: slow on a loaded machine)
            seen.append(wait_state(proc.pid, stopped=True))
            return real(*a, **kw)

        eng.runner.step = spy
        run_all(eng, prompts(2, seed=5))
        assert seen and all(seen)  # stopped during every step
        assert wait_state(proc.pid, stopped=False)  # continued once the engine had nothing left
        rid = eng.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=50))
        eng.step()
        assert wait_state(proc.pid, stopped=True)
        other = build_queue.BusyFlag()  # a second engine starts generating ...
        other.set(True)
        eng.abort(rid)  # ... so this one's going idle continues nothing
        assert wait_state(proc.pid, stopped=True)
        other.set(False)  # the last one busy: continued
        assert wait_state(proc.pid, stopped=False)
    finally:
        state.unlink(missing_ok=True)
        proc.kill()
        proc.wait()


def test_the_builder_continues_a_build_whose_engine_died_busy(tiny_int4, home):
    """An engine killed while it generates (its busy lock held, the worker stopped): the kernel
    drops the lock and the builder continues the worker."""
    path = compiled.package_path(tiny_int4.model, "n", tiny_int4.kv_dtype)
    saved = (path.read_bytes(), path.with_suffix(".json").read_bytes()) if path.is_file() else None
    path.unlink(missing_ok=True)  # (the rm test before this one left only d1)
    try:
        build_queue.enqueue(compiled.job_key(tiny_int4.model, tiny_int4.kv_dtype),
                            compiled.job_spec(tiny_int4.model, tiny_int4.kv_dtype))
        builder = build_queue.ensure_builder() or pytest.fail(f"a builder was running: {build_queue.read_state()}")
        deadline = time.monotonic() + 300  # (a loaded machine)
        while not (build_queue.read_state() or {}).get("worker") and time.monotonic() < deadline:
            assert builder.poll() is None, (compiled.cache_dir() / "build.log").read_text()[-3000:]
            time.sleep(0.05)
        worker = build_queue.read_state()["worker"]
        code = ("import sys, time; from localllm.model.build_queue import BusyFlag; f = BusyFlag(); f.set(True); "
                "print('busy', flush=True); time.sleep(1.5); import os; os._exit(0)")
        engine = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert engine.stdout.readline() == "busy\n"
        assert wait_state(worker, stopped=True)  # stopped by the engine at once
        time.sleep(0.5)
        assert proc_state(worker) == "T"  # and kept stopped by the builder while it is busy
        engine.wait(timeout=30)  # dies busy
        assert wait_state(worker, stopped=False)
        assert builder.poll() is None and build_queue.read_state()["worker"] == worker  # still on it
    finally:
        build_queue.stop_all()
        if saved and not path.is_file():
            path.write_bytes(saved[0])
            path.with_suffix(".json").write_bytes(saved[1])
