"""Split GGUF files (NAME-00001-of-00003.gguf, ...), as llama.cpp's gguf-split and the converter's
--split-max-tensors write them and the hub's big GGUFs come: named by the first shard, read whole
(its metadata, every shard's tensors), pulled whole, and refused with a clear error when a shard
is missing, renamed or not the first."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hub_mirror import HubMirror, make_repo
from test_families import gguf_reader

from localllm.model.convert_cache import weights_fingerprint
from localllm.model.gguf import GGUFError, read_gguf


def split_copy(src, out, shards: int = 3):
    """`src` rewritten in `shards` shards by gguf-py's writer (split_max_tensors, as
    convert_hf_to_gguf.py --split-max-tensors writes them): the first shard's path."""
    import gguf

    reader, ours = gguf_reader(src), read_gguf(src)
    per = -(-len(ours.tensors) // shards)
    w = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents(), split_max_tensors=per)
    for key, fld in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = fld.types[0]
        w.add_key_value(key, fld.contents(), vtype, fld.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for name, t in ours.tensors.items():
        w.add_tensor(name, np.asarray(t.data), raw_dtype=gguf.GGMLQuantizationType(t.qtype.id))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    first = out.with_name(f"{out.stem}-00001-of-{shards:05d}.gguf")
    assert first.is_file()
    return first


@pytest.fixture(scope="module")
def split(tmp_path_factory, gguf_path):
    return split_copy(gguf_path, tmp_path_factory.mktemp("split") / "smol.gguf")


def cli(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localllm.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_a_split_gguf_reads_and_runs_as_the_whole_file(split, gguf_path):
    """`localllm run FIRST-SHARD` as a user types it answers as the unsplit file does; the reader
    holds every shard's tensors, byte for byte the whole file's; `show` counts every shard."""
    whole, parts = read_gguf(gguf_path), read_gguf(split)
    assert [p.name for p in parts.paths] == [f"smol-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert parts.tensors.keys() == whole.tensors.keys()
    assert len({t.path for t in parts.tensors.values()}) == 3
    for name, t in whole.tensors.items():
        assert np.array_equal(parts.read(parts.tensors[name]), whole.read(t)), name
    assert parts.metadata["tokenizer.ggml.tokens"] == whole.metadata["tokenizer.ggml.tokens"]
    args = ("Hello", "-n", "8", "--temperature", "0")
    mine, want = cli("run", str(split), *args), cli("run", str(gguf_path), *args)
    assert mine.returncode == 0, mine.stderr
    assert mine.stdout.strip() and mine.stdout == want.stdout
    shown = json.loads(cli("show", str(split), "--json").stdout)
    assert shown["size_bytes"] == sum(p.stat().st_size for p in parts.paths)


def test_a_shard_changed_is_a_new_file_for_the_caches(split, tmp_path):
    folder = shutil.copytree(split.parent, tmp_path / "copy")
    first = folder / split.name
    key = weights_fingerprint(first, "how")
    third = folder / "smol-00003-of-00003.gguf"
    os.utime(third, ns=(third.stat().st_atime_ns, third.stat().st_mtime_ns + 10**9))
    assert weights_fingerprint(first, "how") != key


def test_what_is_not_a_whole_split_gguf_is_refused_clearly(split, tmp_path):
    folder = shutil.copytree(split.parent, tmp_path / "copy")
    second = folder / "smol-00002-of-00003.gguf"
    with pytest.raises(GGUFError, match=r"shard 2 of 3 of a split GGUF; pass the first shard "
                                        r"\(smol-00001-of-00003\.gguf\)"):
        read_gguf(second)
    r = cli("run", str(second), "Hello", "-n", "2")
    assert r.returncode == 1 and "pass the first shard (smol-00001-of-00003.gguf)" in r.stderr, r.stderr
    renamed = folder / "smol-first.gguf"
    shutil.copy(folder / split.name, renamed)
    with pytest.raises(GGUFError, match="its name does not say where the others are"):
        read_gguf(renamed)
    shutil.copy(second, folder / "smol-00003-of-00003.gguf")  # shard 2's bytes under shard 3's name
    with pytest.raises(GGUFError, match="does not make it shard 3 of 3 of smol-00001-of-00003.gguf "
                                        r"\(it says shard 2 of 3\)"):
        read_gguf(folder / split.name)
    (folder / "smol-00003-of-00003.gguf").unlink()
    with pytest.raises(GGUFError, match="shard 3 of 3 of this split GGUF is missing: .*smol-00003-of-00003.gguf"):
        read_gguf(folder / split.name)
    r = cli("run", str(folder / split.name), "Hello", "-n", "2")
    assert r.returncode == 1 and "shard 3 of 3 of this split GGUF is missing" in r.stderr, r.stderr


def test_a_registry_entry_naming_a_split_gguf_pulls_every_shard(split, tmp_path):
    """An entry whose `file` is a first shard (ggml-org's gpt-oss-120b GGUF is three): `localllm
    run ALIAS` pulls every shard, then answers as the local file does; offline it is complete."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for p in read_gguf(split).paths:
        shutil.copy(p, repo / p.name)
    (repo / "other-q8_0.gguf").write_bytes(b"GGUF")  # another file of the repo: not taken
    registry = tmp_path / "models.toml"
    registry.write_text('default = "smol-split"\n[models."smol-split"]\nrepo = "test-org/smol-GGUF"\n'
                        f'file = "{split.name}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_HOME=str(tmp_path / "hf"), LOCALLLM_MODELS=str(registry), HF_HUB_DISABLE_TELEMETRY="1")
    args = ("Hello", "-n", "8", "--temperature", "0")
    with HubMirror({"test-org/smol-GGUF": make_repo(repo)}) as hub:
        r = cli("run", "smol-split", *args, env=env | {"HF_ENDPOINT": hub.url})
        fetched = sorted(p.rsplit("/", 1)[1] for _, p, _ in hub.gets())
    assert r.returncode == 0, r.stderr
    assert fetched == [p.name for p in read_gguf(split).paths]
    assert r.stdout == cli("run", str(split), *args).stdout
    offline = cli("run", "smol-split", *args, env=env | {"HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 0 and offline.stdout == r.stdout, offline.stderr
