"""Registry entries of vision models: a GGUF variant with its mmproj is pulled whole (both files,
one folder) from the loopback hub mirror, and then `run --dry-run`, `show` and the loader find
the pair; the planner counts a registry entry's tower before anything is downloaded; `list`
names the vision entries of the real models.toml. The pair is tests/vision_gguf.py's tiny Gemma 3
(transformers' own checkpoint, written under llama.cpp's names)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from hub_mirror import HubMirror, make_repo
from typer.testing import CliRunner
from vision_gguf import write_pair
from vision_models import gemma3

from localllm.cli import app
from localllm.model.vision.mmproj import Mmproj

GGUF_REPO = "test-org/tiny-vision-GGUF"
TEXT, MMPROJ = "tiny-vision-F32.gguf", "mmproj-tiny-vision-f16.gguf"


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory, fp32_model, gguf_path):
    """A GGUF repo's folder: the tiny Gemma 3's text GGUF and its mmproj under the hub's names."""
    root = tmp_path_factory.mktemp("vision-registry")
    hf = gemma3(root / "hf", fp32_model.tokenizer)
    text, mmproj = write_pair(hf, "gemma3", gguf_path, root / "pair")
    repo = root / "repo"
    repo.mkdir()
    shutil.copyfile(text, repo / TEXT)
    shutil.copyfile(mmproj, repo / MMPROJ)
    (repo / "README.md").write_text("# tiny vision GGUF\n")
    return repo


@pytest.fixture
def env(pair_dir, tmp_path, monkeypatch):
    """A registry with the pair as one entry's GGUF variant (and one whose mmproj the repo lacks),
    an empty HF cache, the mirror serving the repo."""
    vision = Mmproj(pair_dir / MMPROJ).params()
    (tmp_path / "models.toml").write_text(f"""
default = "tiny-vision"
[models."tiny-vision"]
repo = "test-org/tiny-vision"
params = 1000000
context = 1024
vision_params = {vision}
[models."tiny-vision".variants]
gguf = {{ repo = "{GGUF_REPO}", file = "{TEXT}", mmproj = "{MMPROJ}" }}
[models."tiny-vision-pair"]
repo = "{GGUF_REPO}"
file = "{TEXT}"
mmproj = "{MMPROJ}"
params = 1000000
vision_params = {vision}
[models."no-mmproj"]
repo = "test-org/no-mmproj"
params = 1000000
[models."no-mmproj".variants]
gguf = {{ repo = "{GGUF_REPO}", file = "{TEXT}", mmproj = "mmproj-missing.gguf" }}
""")
    monkeypatch.setenv("LOCALLLM_MODELS", str(tmp_path / "models.toml"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with HubMirror({GGUF_REPO: make_repo(pair_dir)}) as mirror:
        monkeypatch.setenv("HF_ENDPOINT", mirror.url)
        yield mirror, vision


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def test_pull_fetches_the_gguf_and_its_mmproj(env, pair_dir):
    from localllm.hub import cached_snapshot
    from localllm.model.loader import load_model
    from localllm.models_cli import local_path
    from localllm.registry import resolve_model

    mirror, vision = env
    r = cli("pull", "tiny-vision", "--quant", "gguf")
    assert r.exit_code == 0, r.output
    assert f"pulled {GGUF_REPO} (2 files" in r.output
    got = sorted(path.rsplit("/", 1)[1] for _, path, _ in mirror.gets())
    assert got == sorted([TEXT, MMPROJ])  # the README stays on the hub
    snap = cached_snapshot(GGUF_REPO, "main", TEXT, MMPROJ)
    assert snap is not None and (snap / MMPROJ).read_bytes() == (pair_dir / MMPROJ).read_bytes()
    assert local_path(resolve_model("tiny-vision")) == snap / TEXT
    # what run/chat/serve load: the text GGUF with the mmproj beside it (no --mmproj given)
    loaded = load_model(snap / TEXT, "float32")
    assert loaded.vision is not None and loaded.vision.family == "gemma3"
    # pulled again: nothing downloaded
    mirror.clear()
    r = cli("pull", "tiny-vision", "--quant", "gguf")
    assert r.exit_code == 0 and "is up to date (2 files" in r.output and mirror.gets() == []


def test_a_gguf_entry_is_pulled_whole(env):
    """An entry whose repo is a GGUF repo (file + mmproj): `pull NAME` fetches both files; `list`
    names it a gguf; it has no other form."""
    mirror, _ = env
    rows = {row["name"]: row for row in json.loads(cli("list", "--json").output)}
    assert (rows["tiny-vision-pair"]["variant"], rows["tiny-vision-pair"]["status"]) == ("gguf", "available")
    r = cli("pull", "tiny-vision-pair")
    assert r.exit_code == 0 and f"pulled {GGUF_REPO} (2 files" in r.output, r.output
    assert sorted(p.rsplit("/", 1)[1] for _, p, _ in mirror.gets()) == sorted([TEXT, MMPROJ])
    assert cli("pull", "tiny-vision-pair", "--quant", "bf16").output.strip().endswith(
        f"tiny-vision-pair is a GGUF entry ({GGUF_REPO}/{TEXT}): it has no BF16 variant")


@pytest.mark.slow  # a server process (~20 s); the pull it runs is the CLI's (test_a_gguf_entry_is_pulled_whole)
def test_api_pull_fetches_the_gguf_and_its_mmproj(env, tmp_path):
    """Ollama's /api/pull on a real server (every model on demand) fetches both files too."""
    import os

    import httpx
    from server_proc import running

    mirror, _ = env
    with running("--threads", "1", "--enforce-eager", model=None, env=dict(os.environ)) as server:
        r = httpx.post(server.base + "/api/pull", json={"model": "tiny-vision-pair", "stream": False}, timeout=120)
        assert r.status_code == 200 and r.json() == {"status": "success"}, r.text
    assert sorted(p.rsplit("/", 1)[1] for _, p, _ in mirror.gets()) == sorted([TEXT, MMPROJ])
    from localllm.hub import cached_snapshot

    assert cached_snapshot(GGUF_REPO, "main", TEXT, MMPROJ) is not None


def test_show_and_dry_run_report_the_tower(env):
    _, vision = env
    r = cli("show", "tiny-vision")  # not downloaded yet: the registry's figure
    assert r.exit_code == 0 and f"images in (a vision tower of {vision:,} parameters)" in r.output, r.output
    assert json.loads(cli("show", "tiny-vision", "--json").output)["vision_params"] == vision
    assert cli("pull", "tiny-vision", "--quant", "gguf").exit_code == 0
    r = cli("show", "tiny-vision", "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["vision"] is True and info["mmproj"].endswith(MMPROJ)
    r = cli("run", "tiny-vision", "--dry-run", "--device", "cpu", "--max-memory", "4")
    assert r.exit_code == 0, r.output
    # the plan read the pulled files: the tower as the loader holds it on CPU (fp32)
    assert f"vision tower: {vision / 1e6:.0f}M parameters, {4 * vision / (1 << 30):.2f} GiB of the weights" in r.output


def test_a_missing_mmproj_is_named_and_nothing_is_written(env):
    from localllm.hub import hub_cache

    r = cli("pull", "no-mmproj", "--quant", "gguf")
    assert r.exit_code == 1
    assert r.output.strip().splitlines()[-1].startswith(f"Error: {GGUF_REPO} has no file 'mmproj-missing.gguf'")
    assert not list(hub_cache().glob("models--*/snapshots/*/*"))


def test_the_planner_counts_an_entry_tower_before_download(env):
    """Nothing pulled: the registry's vision_params, held as the loader holds the tower (fp32 on
    CPU, 16 bits on a GPU), on top of the text model's weights (shapes known or estimated)."""
    from localllm.planner import DeviceFacts, facts_for, plan
    from localllm.registry import REGISTRY_PATH, ModelRef, load_registry

    real = load_registry(REGISTRY_PATH)
    specs = [load_registry().lookup("tiny-vision"), *(real.lookup(n) for n in ("gemma3-4b", "smolvlm-256m",
                                                                            "qwen2.5-vl-3b", "qwen3-vl-2b"))]
    for spec in specs:
        f = facts_for(ModelRef(spec.name, repo=spec.repo, revision=spec.revision, spec=spec))
        assert f.vision_params == spec.vision_params > 0, spec.name
        text = dataclasses.replace(f, vision_params=0)
        for device, per in (("cpu", 4), ("cuda", 2)):
            p, q = plan(f, DeviceFacts(device, 256 << 30), "auto", 4096), plan(text, DeviceFacts(device, 256 << 30),
                                                                               "auto", 4096)
            assert p.precision == q.precision, spec.name
            assert p.weights_bytes - q.weights_bytes == p.vision_bytes == per * spec.vision_params, spec.name
        assert "vision tower:" in p.describe() and "vision tower:" not in q.describe()


def test_list_shows_the_vision_entries(monkeypatch, tmp_path):
    monkeypatch.delenv("LOCALLLM_MODELS", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    r = cli("list", "--json")
    assert r.exit_code == 0, r.output
    rows = {row["name"]: row for row in json.loads(r.output)}
    for name, repo in (("gemma3-4b", "google/gemma-3-4b-it"), ("gemma3-12b", "google/gemma-3-12b-it"),
                       ("gemma3-27b", "google/gemma-3-27b-it"), ("qwen2.5-vl-3b", "Qwen/Qwen2.5-VL-3B-Instruct"),
                       ("qwen2.5-vl-7b", "Qwen/Qwen2.5-VL-7B-Instruct"), ("qwen3-vl-2b", "Qwen/Qwen3-VL-2B-Instruct"),
                       ("smolvlm-256m", "HuggingFaceTB/SmolVLM-256M-Instruct"),
                       ("smolvlm-500m", "HuggingFaceTB/SmolVLM-500M-Instruct"),
                       ("smolvlm-2.2b", "HuggingFaceTB/SmolVLM-Instruct")):
        assert rows[name]["repo"] == repo and rows[name]["status"] == "available", name
    from localllm.hub import variant_for
    from localllm.registry import resolve_model

    v = variant_for(resolve_model("gemma3:4b"), "gguf")
    assert (v.repo, v.filename, v.mmproj) == ("ggml-org/gemma-3-4b-it-GGUF", "gemma-3-4b-it-Q4_K_M.gguf",
                                               "mmproj-model-f16.gguf")
