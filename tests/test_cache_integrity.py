"""A damaged cache is never trusted (issue 29, item 7): the conversion cache, the kernel libraries
and the compiled-step packages, each flipped, zeroed at the tail (what a crash after a rename
without fsync leaves) or cut short, are caught before use and built again; the real `localllm run`
then answers exactly as it did before the damage.

The end-to-end runs share one home (its kernel libraries copied from this test run's cache, so
only the damaged one is compiled again, ~5 s); the damage kinds are each checked on the cheap
checks themselves, and on the conversion cache also through load_model of the tiny GGUF."""

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

from localllm.model import cache_file, compiled
from localllm.model.convert_cache import ConvertCache
from localllm_kernels import cpu_attention, cpu_build, cpu_fused, cpu_int4, cpu_q8

EXE = [sys.executable, "-m", "localllm.cli"]
QUESTION = "What is the capital of France?"


def flip(path: Path) -> None:
    """98 runs of 64 bytes inverted, spread over the data (past a safetensors header, else over
    the second half). On the default model's conversion cache read unchecked (the check patched
    out), `run` answered QUESTION with "speedspeedspeed..." and exit 0, as in the issue."""
    n = path.stat().st_size
    start = n // 2
    if path.suffix == ".safetensors":
        with open(path, "rb") as f:
            start = 8 + int.from_bytes(f.read(8), "little")
    with open(path, "r+b") as f:
        for i in range(98):
            f.seek(start + int((i + 0.5) * (n - start - 64) / 98))
            b = f.read(64)
            f.seek(-len(b), 1)
            f.write(bytes(x ^ 0xFF for x in b))


def zero_tail(path: Path) -> None:
    n = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(n - n // 3)
        f.write(bytes(n // 3))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


DAMAGE = {"flipped": flip, "zeroed_tail": zero_tail, "truncated": truncate}


def run(home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "LOCALLLM_HOME": str(home), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    env.pop("LOCALLLM_KERNEL_CACHE", None)  # the kernels in the run's home: $LOCALLLM_HOME/kernels
    return subprocess.run([*EXE, "run", "--eager", "--temperature", "0", QUESTION], capture_output=True,
                          text=True, timeout=300, env=env)


def notices(r: subprocess.CompletedProcess, needle: str) -> list[str]:
    return [ln for ln in r.stderr.splitlines() if needle in ln]


@pytest.fixture(scope="module")
def libraries() -> list[Path]:
    """This test run's kernel libraries (built with their sidecars where missing or damaged)."""
    assert cpu_int4.load() and cpu_q8.load() and cpu_attention.load() and cpu_fused.load()
    return [cpu_int4.library_path(), cpu_q8.library_path(), cpu_attention.library_path(), cpu_fused.library_path()]


@pytest.fixture(scope="module")
def home(tmp_path_factory, libraries) -> Path:
    path = tmp_path_factory.mktemp("damaged-home")
    (path / "kernels").mkdir()
    for lib in libraries:
        for f in (lib, cpu_build.sidecar(lib)):
            shutil.copy2(f, path / "kernels" / f.name)
    return path


@pytest.fixture(scope="module")
def first_answer(home) -> str:
    """The undamaged run: it converts the default model into the home's cache."""
    r = run(home)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout and not notices(r, "building")  # every kernel came from the copy
    assert len(list((home / "converted").glob("*.safetensors"))) == 1
    return r.stdout


@pytest.mark.slow  # ~2 min on a busy 2-core machine (its fixture converts the model in a fresh home): `make test-slow`
def test_flipped_conversion_cache_is_converted_again_and_answers_as_before(home, first_answer):
    (cached,) = (home / "converted").glob("*.safetensors")
    good = cached.read_bytes()
    flip(cached)
    assert cache_file.verify(cached) is not None
    r = run(home)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == first_answer
    assert len(notices(r, "conversion cache")) == 1 and "converting again" in r.stderr
    assert cached.read_bytes() == good  # converted again into the same bytes


@pytest.mark.slow  # ~15 s of compiling a kernel library: `make test-slow` (CI's budget; test_cpu_attention's
# test_damaged_library_is_rebuilt checks the rebuild of a truncated library in CI)
def test_truncated_kernel_library_is_built_again_and_answers_as_before(home, first_answer):
    """Cut in half, the library made every run die of SIGBUS (exit 135) and was never rebuilt."""
    lib = home / "kernels" / cpu_q8.library_path().name
    good = lib.read_bytes()
    truncate(lib)
    r = run(home)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == first_answer
    assert notices(r, "kernel") == [f"the CPU Q8_0 kernel at {lib} does not match its build ({len(good) // 2} "
                                    f"bytes where {len(good)} were built): building it again (a few seconds)"]
    assert cpu_build.check(lib) is None and lib.stat().st_size == len(good)


@pytest.mark.parametrize("damage", DAMAGE)
def test_kernel_library_check_catches_each_damage(libraries, tmp_path, damage):
    lib = tmp_path / libraries[1].name
    shutil.copy2(libraries[1], lib)
    shutil.copy2(cpu_build.sidecar(libraries[1]), cpu_build.sidecar(lib))
    assert cpu_build.check(lib) is None
    DAMAGE[damage](lib)
    assert cpu_build.check(lib) is not None
    cpu_build.sidecar(lib).unlink()  # a library from before sidecars is not trusted either
    shutil.copy2(libraries[1], lib)
    assert cpu_build.check(lib) == "no readable sidecar with its sha256"


def test_kernel_libraries_are_named_by_the_headers_they_include_too(tmp_path):
    """The int4 and int8-lane GEMMs share their activation quantizer (localllm_kernels/cpu/act_quant.h): a
    change to it must rebuild both, so the header is part of each library's name; a header of
    ours that a source does not include is not."""
    cpu = Path(cpu_int4.SOURCE).parent
    headers = ("act_quant.h", "group_scales.h", "moe_route.h")
    for name in ("int4_gemm.cpp", "int8_gemm.cpp", *headers):
        shutil.copy2(cpu / name, tmp_path / name)
    (tmp_path / "unused.h").write_text("// included by no one\n")
    sources = [tmp_path / "int4_gemm.cpp", tmp_path / "int8_gemm.cpp"]
    assert all(sorted(cpu_build.build_inputs(s)) == sorted([s, *(tmp_path / h for h in headers)]) for s in sources)
    before = [cpu_build.library_path(s, ["-O3"]) for s in sources]
    (tmp_path / "unused.h").write_text("// still included by no one\n")
    assert [cpu_build.library_path(s, ["-O3"]) for s in sources] == before
    with open(tmp_path / "act_quant.h", "a") as f:
        f.write("// a change\n")
    after = [cpu_build.library_path(s, ["-O3"]) for s in sources]
    assert all(a != b and a.name.split("-")[0] == b.name.split("-")[0] for a, b in zip(after, before))


def test_kernel_libraries_live_under_localllm_home(tmp_path, monkeypatch):
    """paths.py's promise: LOCALLLM_HOME holds every location, the kernel libraries included
    (cpu_build spells the rule out itself: kernels import nothing from localllm)."""
    from localllm.paths import cache_home

    monkeypatch.delenv("LOCALLLM_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path / "home"))
    assert cpu_build.cache_dir() == cache_home() / "kernels" == tmp_path / "home" / "kernels"
    monkeypatch.delenv("LOCALLLM_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cpu_build.cache_dir() == cache_home() / "kernels" == tmp_path / "xdg" / "localllm" / "kernels"
    monkeypatch.setenv("LOCALLLM_KERNEL_CACHE", str(tmp_path / "kernels"))
    assert cpu_build.cache_dir() == tmp_path / "kernels"


@pytest.fixture(scope="module")
def tiny_converted(tiny_gguf, tmp_path_factory):
    """The tiny GGUF loaded once (converted) in a home of its own: the cache file's bytes and the
    model's weights."""
    from localllm.model.loader import load_model

    mp = pytest.MonkeyPatch()
    mp.setenv("LOCALLLM_HOME", str(tmp_path_factory.mktemp("tiny-home")))
    loaded = load_model(tiny_gguf, "auto")
    ConvertCache.wait_written()  # the file is written in the background
    (cached,) = (Path(os.environ["LOCALLLM_HOME"]) / "converted").glob("*.safetensors")
    yield cached, cached.read_bytes(), loaded.model.state_dict()
    mp.undo()


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_conversion_cache_is_converted_again(tiny_gguf, tiny_converted, damage, caplog):
    from localllm.model.loader import load_model

    cached, good, weights = tiny_converted
    try:
        DAMAGE[damage](cached)
        assert cache_file.verify(cached) is not None
        with caplog.at_level(logging.WARNING, "localllm.model.loader"):
            loaded = load_model(tiny_gguf, "auto")
        said = [r.getMessage() for r in caplog.records if "conversion cache" in r.getMessage()]
        assert len(said) == 1 and said[0].endswith("converting again"), said
        ConvertCache.wait_written(cached)
        assert cached.read_bytes() == good
        state = loaded.model.state_dict()
        assert state.keys() == weights.keys() and all(torch.equal(state[k], weights[k]) for k in weights)
    finally:
        cached.write_bytes(good)


def test_conversion_cache_check_names_what_is_wrong(tmp_path):
    path = tmp_path / "c.safetensors"
    tensors = {"a": torch.arange(1000, dtype=torch.int32), "b": torch.ones(3, 4, dtype=torch.bfloat16),
               "g": torch.tensor(32)}
    cache_file.save(tensors, path)
    assert cache_file.verify(path) is None
    assert not list(tmp_path.glob("*.tmp*"))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # the last byte of the data
    path.write_bytes(bytes(data))
    assert cache_file.verify(path).startswith("1 of 3 tensors do not match their checksums")
    from safetensors.torch import save_file

    save_file(tensors, str(path))  # written before checksums (or by something else)
    assert cache_file.verify(path) == "no checksums in its header"
    # a header that still parses but changes a shape is caught as damaged bytes are
    cache_file.save(tensors, path)
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b'"shape":[3,4]', b'"shape":[4,3]', 1))
    assert "do not match" in cache_file.verify(path)


def test_cache_files_are_fsynced_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b)))
    path = tmp_path / "c.safetensors"
    cache_file.save({"a": torch.zeros(4)}, path)
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"]
    assert events[0][1].startswith(str(path.with_suffix(".tmp")))
    assert events[1][1] == str(path) and events[2][1] == str(tmp_path)


@pytest.mark.parametrize("damage", DAMAGE)
def test_compiled_package_check_catches_each_damage(tmp_path, damage):
    """The compiled step's sidecar check (tests/test_compiled.py rebuilds a truncated package)."""
    path = tmp_path / "decode-d1-x.pt2"
    path.write_bytes(os.urandom(4096))
    path.with_suffix(".json").write_text(json.dumps({"scalars": {}, "sha256": compiled._sha256(path)}))
    DAMAGE[damage](path)
    with pytest.raises(ValueError, match="does not match its recorded sha256"):
        compiled.load_package(None, path)


def test_prebuild_builds_only_the_missing_libraries_concurrently(monkeypatch, tmp_path):
    """cpu_prebuild: the libraries not in the cache are each built once (in a thread pool; the
    real compiles run in `make setup`); a failed build is reported, not raised."""
    from localllm_kernels import cpu_build, cpu_prebuild, cpu_q8

    monkeypatch.setenv("LOCALLLM_KERNEL_CACHE", str(tmp_path))
    q8 = cpu_q8.library_path()
    q8.write_bytes(b"built")  # present: not built again
    built = []

    def fake(source, out, flags):
        built.append(out.name)
        if source.stem == "sampler":
            raise RuntimeError("building sampler.cpp failed:\nno compiler")
        out.write_bytes(b"built")
    monkeypatch.setattr(cpu_build, "build", fake)
    done = cpu_prebuild.build_missing(workers=2)
    assert sorted(done) == sorted(set(cpu_prebuild.MODULES) - {"cpu_q8"}) and q8.name not in built
    assert len(built) == len(done)
    assert done["cpu_sampler"] == "building sampler.cpp failed:" and done["cpu_int8"] is None
    assert cpu_prebuild.missing() == ["cpu_sampler"]


def test_first_load_returns_before_its_cache_is_written(tiny_gguf, tmp_path, monkeypatch):
    """The conversion cache is written in a thread of the loading process: load_model returns
    while the write is held up, a second load of the same file waits for that write and takes the
    cache (converting nothing), and the thread is no daemon (the process exits once it is done)."""
    from localllm.model import loader
    from localllm.model.loader import load_model

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    go, save = threading.Event(), cache_file.save

    def held(*a, **kw):
        assert go.wait(60)
        save(*a, **kw)
    monkeypatch.setattr(cache_file, "save", held)
    first = load_model(tiny_gguf, "auto")
    (writer,) = ConvertCache._writing.values()
    assert writer.is_alive() and not writer.daemon
    assert not list((tmp_path / "converted").glob("*.safetensors"))
    go.set()

    def fail(*a, **kw):
        raise AssertionError("a load after the write converted a layer")
    monkeypatch.setattr(loader, "_linear", fail)
    second = load_model(tiny_gguf, "auto")
    assert not writer.is_alive() and not ConvertCache._writing
    (cached,) = (tmp_path / "converted").glob("*.safetensors")
    assert cache_file.verify(cached) is None
    want, got = first.model.state_dict(), second.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_a_process_that_exits_right_after_its_first_load_still_writes_the_cache(tiny_gguf, tmp_path):
    """The writer thread outlives load_model: a process that returns at once (a `run` printing a
    short answer) exits only once the cache file is complete, and the file verifies."""
    env = {**os.environ, "LOCALLLM_HOME": str(tmp_path)}
    code = ("import time; from localllm.model import cache_file; from localllm.model.loader import load_model\n"
            "orphans = cache_file.remove_orphans\n"  # the writer starts late, as a big file's does
            "cache_file.remove_orphans = lambda *a: (time.sleep(1), orphans(*a))\n"
            f"load_model({str(tiny_gguf)!r}, 'auto')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    (written,) = (tmp_path / "converted").glob("*.safetensors")
    assert cache_file.verify(written) is None
    assert not list((tmp_path / "converted").glob("*.tmp*"))


def test_orphaned_temporaries_of_dead_processes_are_removed(tmp_path):
    """A write cut short leaves `save`'s temporary: the next write of that model removes those of
    processes that are gone, and keeps a live process's (it may still be writing)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    orphan = tmp_path / f"m-0123.tmp{dead}-77"
    live = tmp_path / f"m-0123.tmp{os.getppid()}-78"
    other = tmp_path / f"n-0123.tmp{dead}-79"
    for f in (orphan, live, other):
        f.write_bytes(b"x")
    cache_file.remove_orphans(tmp_path, "m-")
    assert not orphan.exists() and live.exists() and other.exists()


@pytest.mark.parametrize("enabled", [True, False])
def test_load_pauses_the_cycle_collector_and_leaves_it_as_it_was(tiny_gguf, tmp_path, monkeypatch, enabled):
    """load_model runs with Python's cycle collector off (its passes cost ~0.1-0.2 s of a 1B first
    load), and leaves it on or off as the caller had it."""
    import gc

    from localllm.model import loader

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    seen, build = [], loader._linear

    def spy(*a, **kw):
        seen.append(gc.isenabled())
        return build(*a, **kw)
    monkeypatch.setattr(loader, "_linear", spy)
    (gc.enable if enabled else gc.disable)()
    try:
        loader.load_model(tiny_gguf, "auto")
        assert seen and not any(seen) and gc.isenabled() is enabled
    finally:
        gc.enable()
        ConvertCache.wait_written()


def _mapping_rss_kb(path: Path) -> int:
    """This process's resident KB of its mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            inside = len(fields) >= 6 and fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def test_release_pages_drops_a_mapped_views_pages_and_keeps_its_bytes(tmp_path):
    import numpy as np

    from localllm.model.gguf import release_pages

    path = tmp_path / "blob.bin"
    data = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)
    data.tofile(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    with warnings.catch_warnings():  # read-only, as the loader's views of the GGUF
        warnings.simplefilter("ignore")
        view = torch.from_numpy(mm[4096 + 100:])  # an unaligned start: only the whole pages inside go
    assert int(view.sum()) == int(data[4096 + 100:].sum())
    before = _mapping_rss_kb(path)
    release_pages(view)
    after = _mapping_rss_kb(path)
    assert before >= 8 * 1024 - 8 and after <= 8
    assert torch.equal(view, torch.from_numpy(data[4096 + 100:]))  # read back from the page cache


def test_first_load_releases_the_mapped_heads_pages_a_cache_hit_never_read(tiny_gguf, tmp_path, monkeypatch):
    """Building the greedy head's ranking copy reads every row of the Q8_0 head read in place from
    the file: the first load drops those pages from the process as the build passes them, every
    row once; a load that takes the copy from the conversion cache never read them, and releases
    nothing."""
    from localllm.model import loader

    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    released, release = [], loader.release_pages
    monkeypatch.setattr(loader, "release_pages", lambda t: released.append(t) or release(t))
    first = loader.load_model(tiny_gguf, "auto")
    blocks = first.model.head.exact.blocks
    row = blocks[0].numel()
    spans = sorted(((t.data_ptr() - blocks.data_ptr()) // row, t.shape[0]) for t in released)
    assert spans[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(spans, spans[1:]))
    assert sum(n for _, n in spans) == blocks.shape[0] and len(spans) > 1
    assert first.model.head.fast is not None
    ConvertCache.wait_written()
    count = len(released)
    second = loader.load_model(tiny_gguf, "auto")
    assert len(released) == count
    x = torch.randn(2, first.model.head.exact.shape[1])
    assert torch.equal(first.model.head.greedy(x), second.model.head.greedy(x))
    assert torch.equal(first.model.head(x), second.model.head(x))


def _greedy_answers_resident_kb(path: str) -> tuple[int, float, object]:
    """(KB of `path` resident after three 40-token greedy answers, the table's KB, the engine)."""
    from conftest import make_engine

    from localllm.model.loader import load_model
    from localllm.sampling import SamplingParams

    loaded = load_model(path, "auto")
    assert [t.data_ptr() for t in loaded.model.mapped] == [loaded.model.embed.blocks.data_ptr()]
    engine = make_engine(loaded)
    for prompt in ("Tell me a story about a dragon and a castle.", "What is the capital of France?",
                   "Write a poem about the sea."):
        *_, out = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        assert len(out.token_ids) == 40
    return _mapping_rss_kb(path), loaded.model.embed.blocks.numel() / 1024, engine


def test_greedy_decoding_keeps_few_pages_of_a_large_mapped_head(gguf_path, tmp_path, monkeypatch):
    """Greedy steps read a few dozen rows of the table read in place (the embedding and tied head),
    and the kernel maps 16 pages around each: a table of RELEASE_MIN_BYTES or more has its pages
    given back every 8 such steps, a smaller one (the embedded model's 29 MB) keeps them (giving
    them back cost its decode 5%). A sampled step reads the whole head, and its pages stay."""
    from localllm.engine import runner
    from localllm.sampling import SamplingParams

    kept, table_kb, _ = _greedy_answers_resident_kb(shutil.copy(gguf_path, tmp_path / "a.gguf"))
    assert kept > table_kb / 2  # (17-23 MB of the 29)
    monkeypatch.setattr(runner, "RELEASE_MIN_BYTES", 16 << 20)
    copy = shutil.copy(gguf_path, tmp_path / "b.gguf")
    released, _, engine = _greedy_answers_resident_kb(copy)
    assert released < table_kb / 4
    *_, out = engine.generate("Tell me a story.", SamplingParams(temperature=0.7, max_tokens=4, ignore_eos=True, seed=1))
    assert _mapping_rss_kb(copy) > table_kb * 0.8
