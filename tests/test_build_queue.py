"""Background builds of the compiled step (localllm.model.build_queue): one builder per localllm
home however many models were touched, none left by a one-shot `run` unless asked, listed by
`localllm ps`, ended by `ps --stop`, one model's dropped by `localllm rm`.

Eight tiny GGUFs of different shapes (bench/make_gguf.py's 2-layer test shape, each with another
MLP width, so each needs packages of its own) on a fresh LOCALLLM_HOME; no build is waited for.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_engine

from localllm.model import build_queue
from localllm.sampling import SamplingParams

EXE = [sys.executable, "-m", "localllm.cli"]
WIDTHS = [64, 96, 128, 160, 192, 224, 256, 288]  # MLP widths: eight structures, eight jobs


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    path = tmp_path_factory.mktemp("fresh-home")
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCALLLM_HOME", str(path))
    yield path
    build_queue.stop_all()  # whatever a failed assertion left running
    mp.undo()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> list[Path]:
    import importlib.util

    import gguf

    spec = importlib.util.spec_from_file_location("make_gguf", Path(__file__).parent.parent / "bench" / "make_gguf.py")
    make_gguf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_gguf)
    src = gguf.GGUFReader(make_gguf.source_gguf())  # parsed once for the eight
    out = tmp_path_factory.mktemp("eight")
    paths = []
    for i, width in enumerate(WIDTHS):
        name = f"tiny-ffn{width}"
        make_gguf.SHAPES[name] = dict(make_gguf.SHAPES["tiny"], feed_forward_length=width)
        make_gguf.PEAKED.add(name)
        paths.append(Path(make_gguf.write(name, str(out / f"{name}.Q4_1.gguf"), seed=i, src=src)))
    return paths


def background(home: Path) -> list[tuple[int, str, int]]:
    """(pid, "builder" | "worker", RSS bytes) of every live process building for `home`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
        if f"LOCALLLM_HOME={home}".encode() not in env:
            continue
        if b"localllm.model.build_queue" in cmd:
            found.append((int(pid), "builder", rss))
        elif b"localllm.model.compiled" in cmd:
            found.append((int(pid), "worker", rss))
    return found


def cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LOCALLLM_HOME": str(home), "OMP_NUM_THREADS": "1"}
    return subprocess.run([*EXE, *args], capture_output=True, text=True, timeout=300, env=env)


def ps(home: Path) -> list[dict]:
    r = cli(home, "ps", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_one_shot_run_leaves_nothing_behind_unless_asked(models, home):
    r = cli(home, "run", str(models[0]), "--temperature", "0", "-n", "4", "hi")
    assert r.returncode == 0, r.stderr
    assert "no compiled step for this model yet" in r.stderr and "--build" in r.stderr
    assert background(home) == [] and build_queue.jobs() == []
    assert ps(home) == []
    assert "no background builds" in cli(home, "ps").stdout

    r = cli(home, "run", "--build", str(models[0]), "--temperature", "0", "-n", "4", "hi")  # asked for
    assert r.returncode == 0, r.stderr
    assert "building the compiled step for this model in the background" in r.stderr
    rows = ps(home)
    assert [row["model"] for row in rows] == [str(models[0])]
    assert rows[0]["state"] in ("starting", "building", "paused", "queued")
    procs = background(home)
    assert len([p for p in procs if p[1] == "builder"]) == 1 and len(procs) <= 2, procs
    r = cli(home, "ps", "--stop")
    assert r.returncode == 0 and "stopped the builder" in r.stdout and "dropped 1 queued build" in r.stdout
    assert background(home) == [] and build_queue.jobs() == [] and ps(home) == []


def test_eight_models_one_after_the_other_leave_one_builder(models, home):
    """The stampede of issue 31 (eight models tried in a row, eight builders at once): now one
    builder and its one worker at any moment, the other models' builds queued."""
    from localllm.model.loader import load_model

    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engines = []
    generating = build_queue.BusyFlag()  # another engine generating all along: the worker stays paused
    generating.set(True)
    for i, path in enumerate(models):
        eng = make_engine(load_model(path, "auto"), compile=True)  # chat's and serve's default
        eng.add_request([5, 6, 7, 8], params)
        while eng.has_unfinished():
            eng.step()
        engines.append(eng)
        procs = background(home)
        roles = [p[1] for p in procs]
        assert roles.count("builder") <= 1 and roles.count("worker") <= 1, (i, procs)
    jobs = build_queue.jobs()
    assert sorted(j.model for j in jobs) == sorted(map(str, models))  # eight jobs, one per structure
    builder = [p for p in background(home) if p[1] == "builder"]
    assert len(builder) == 1
    assert builder[0][2] < 64 << 20  # the builder itself imports no torch (the worker holds the model)

    # a second builder (a race between two engines) exits at once, before importing anything
    second = subprocess.run([sys.executable, "-c", build_queue._BOOT, "builder", str(build_queue.aoti_dir())],
                            timeout=30)
    assert second.returncode == 0 and build_queue.builder_pid() == builder[0][0]

    rows = ps(home)
    assert len(rows) == 8 and sorted(r["model"] for r in rows) == sorted(map(str, models))
    assert rows[0]["state"] == "paused" and rows[0]["pid"] == builder[0][0] and rows[0]["rss"] > 0
    assert all(r["state"] == "queued" and r["pid"] is None for r in rows[1:])
    listing = cli(home, "ps").stdout
    assert all(str(m) in listing for m in models)

    queued = Path(rows[-1]["model"])  # `rm` drops a queued build ...
    r = cli(home, "rm", str(queued))
    assert r.returncode == 0, r.stderr
    assert "stopped and dropped 1 queued build" in r.stdout and "itself stays" in r.stdout
    assert str(queued) not in [j.model for j in build_queue.jobs()] and queued.is_file()
    state = build_queue.read_state()
    if state.get("worker"):  # ... and stops the one being built; the builder goes on with the next
        building, worker = state["model"], state["worker"]
        r = cli(home, "rm", building)
        assert r.returncode == 0 and "stopped and dropped 1 queued build" in r.stdout, r.stdout + r.stderr
        assert building not in [j.model for j in build_queue.jobs()]
        assert not Path(f"/proc/{worker}/cmdline").exists() or Path(f"/proc/{worker}/cmdline").read_bytes() == b""
    roles = [p[1] for p in background(home)]
    assert roles.count("builder") == 1 and roles.count("worker") <= 1

    r = cli(home, "ps", "--stop")
    assert r.returncode == 0 and "stopped the builder" in r.stdout
    assert background(home) == [] and build_queue.jobs() == []
    generating.set(False)


def test_a_copy_of_a_model_uses_the_same_packages(models, tmp_path):
    """Packages are keyed by the model's structure, not its path: a copy (another folder, a
    re-download) builds nothing again; another shape has packages of its own."""
    import shutil

    from localllm.model import compiled
    from localllm.model.loader import load_model

    copy = tmp_path / "elsewhere" / models[0].name
    copy.parent.mkdir()
    shutil.copy(models[0], copy)
    a, b, other = (load_model(p, "auto") for p in (models[0], copy, models[1]))
    assert a.model.fingerprint != b.model.fingerprint  # what the conversion cache is keyed by
    for kind in compiled.KINDS:
        assert compiled.package_path(a.model, kind, a.kv_dtype) == compiled.package_path(b.model, kind, b.kv_dtype)
        assert compiled.package_path(a.model, kind, a.kv_dtype) != compiled.package_path(other.model, kind,
                                                                                         other.kv_dtype)
    assert compiled.job_key(a.model, a.kv_dtype) == compiled.job_key(b.model, b.kv_dtype)
