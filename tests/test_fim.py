"""Fill-in-the-middle (issue #33): the FIM format read from a tokenizer's special tokens or a GGUF's
tokenizer.ggml.fim_*_token_id keys and the prompt rendered in it (Qwen2.5-Coder, StarCoder2,
DeepSeek-Coder, CodeLlama's spacing, Codestral's suffix-first order), checked against the ids the
tokenizer itself gives; on real servers (plain `localllm serve` with a 2-layer Qwen2 checkpoint,
written by transformers, pulled from a loopback hub mirror; and the same model pinned behind
--api-key): `suffix` through the openai SDK and the ollama client, llama.cpp's /infill (whole and
streamed, input_extra in the repository format), greedy text equal to transformers fp32 on the
rendered ids, a model without FIM tokens answered 400 naming it, and consecutive keystrokes over
one file served from the prefix cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import ollama
import pytest
from hub_mirror import QWEN_FIM, HubMirror, make_repo, tiny_coder_checkpoint
from server_proc import openai_client, running

from localllm import fim
from localllm.tokenizer import LLMTokenizer

FIM_MODEL = "test-org/tiny-coder"
KEY = "sk-fim-test"
PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n\nprint(add(1, 2))\n"
BLOCK = 16  # the KV cache's block size: the prefix cache reuses whole blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_coder_checkpoint(tmp_path_factory.mktemp("fim") / "tiny-coder")


@pytest.fixture(scope="module")
def hf(model_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir)


def published(hf, prefix: str, suffix: str) -> list[int]:
    """Qwen2.5-Coder's published FIM prompt, <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>,
    in the ids transformers' tokenizer gives."""
    tid = hf.convert_tokens_to_ids
    return ([tid("<|fim_prefix|>")] + hf.encode(prefix, add_special_tokens=False) + [tid("<|fim_suffix|>")]
            + hf.encode(suffix, add_special_tokens=False) + [tid("<|fim_middle|>")])


def hf_text(hf):
    return lambda s: hf.encode(s, add_special_tokens=False)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """Plain `localllm serve` (every local model on demand; fp32 so that greedy tokens are
    transformers'), after the coder model was pulled from a loopback hub mirror."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    with HubMirror({FIM_MODEL: make_repo(model_dir)}) as mirror:
        env.update(HF_HOME=str(tmp_path_factory.mktemp("hf")), HF_ENDPOINT=mirror.url, HF_HUB_DISABLE_TELEMETRY="1")
        with running("--ctx", "2048", "--kv-memory", "128MiB", "--threads", "1", "--enforce-eager", "--quant",
                     "float32", model=None, env=env) as s:
            r = httpx.post(s.base + "/api/pull", json={"model": FIM_MODEL, "stream": False}, timeout=120)
            assert r.json() == {"status": "success"}, r.text
            yield s


# ---- the formats ------------------------------------------------------------------------------------
def test_qwen_prompt_is_the_published_format_token_by_token(model_dir, hf):
    tok = LLMTokenizer.from_dir(model_dir)
    fmt = fim.detect(tok)
    ids = {n: hf.convert_tokens_to_ids(n) for n in QWEN_FIM}
    assert (fmt.name, fmt.prefix_id, fmt.suffix_id, fmt.middle_id) == (
        "qwen", ids["<|fim_prefix|>"], ids["<|fim_suffix|>"], ids["<|fim_middle|>"])
    assert sorted(fmt.stop_ids()) == sorted(ids[n] for n in ("<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"))
    assert fim.render(tok, fmt, fim.FimRequest(PREFIX, SUFFIX)) == published(hf, PREFIX, SUFFIX)
    # a file that contains a FIM token's name keeps it as text: the hole stays where it is
    text = "s = '<|fim_suffix|>'\n"
    got = fim.render(tok, fmt, fim.FimRequest(text, ""))
    assert got.count(ids["<|fim_suffix|>"]) == 1 and hf.decode(got[1:-2]) == text
    # llama.cpp's repository layout: <|repo_name|>myproject\n <|file_sep|>name\n text ... <|file_sep|>filename\n
    extra = [{"filename": "util.py", "text": "import os\n"}, {"filename": "b.py", "text": "X = 1\n"}]
    enc = hf_text(hf)
    want = ([ids["<|repo_name|>"]] + enc("myproject\n")
            + [ids["<|file_sep|>"]] + enc("util.py\n") + enc("import os\n")
            + [ids["<|file_sep|>"]] + enc("b.py\n") + enc("X = 1\n")
            + [ids["<|file_sep|>"]] + enc("filename\n")
            + [ids["<|fim_prefix|>"]] + enc(PREFIX) + enc("ret") + [ids["<|fim_suffix|>"]] + enc(SUFFIX)
            + [ids["<|fim_middle|>"]])
    assert fim.render(tok, fmt, fim.FimRequest(PREFIX, SUFFIX, "ret", extra, repo_level=True)) == want
    # extra files are cut from their start to fit; the prefix and suffix never are
    cut = fim.render(tok, fmt, fim.FimRequest(PREFIX, SUFFIX, "ret", extra, True, max_prompt_tokens=len(want) - 5))
    assert cut == want[5:]


def _spm_meta(tokens_extra: list[str], fim_keys: dict[str, str] | None = None) -> dict:
    """GGUF metadata of a small SentencePiece ("llama") vocabulary with `tokens_extra` as control
    tokens (CodeLlama and Mistral vocabularies are SentencePiece: a space before every text)."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [2, 3, 3] + [6] * 256
    words = ["▁", *"abcdefghijklmnopqrstuvwxyz():=+,.", "▁d", "▁de", "▁def", "▁r", "▁re", "▁ret", "▁a", "▁b"]
    pieces += words + tokens_extra
    types += [1] * len(words) + [3] * len(tokens_extra)
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": [-float(i) for i in range(len(pieces))], "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.add_bos_token": True}
    for key, name in (fim_keys or {}).items():
        meta[f"tokenizer.ggml.{key}_token_id"] = pieces.index(name)
    return meta


def test_codellama_spacing_and_codestral_order():
    tok = LLMTokenizer.from_gguf(_spm_meta(["▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"]))
    fmt = fim.detect(tok)
    assert fmt.name == "codellama" and fmt.eot_id == tok.tok.token_to_id("▁<EOT>")
    ids = fim.render(tok, fmt, fim.FimRequest("def f(a):", "a+b"))
    tid = tok.tok.token_to_id
    pre, suf = ids.index(tid("▁<PRE>")), ids.index(tid("▁<SUF>"))
    assert ids[0] == tok.bos_id and pre == 1 and ids[-1] == tid("▁<MID>")
    # Meta's "<PRE> {prefix} <SUF>{suffix} <MID>": the prefix gets SentencePiece's space, the suffix none
    assert ids[pre + 1:suf] == tok.encode("def f(a):") and tok.id_to_token(ids[pre + 1]).startswith("▁")
    assert tok.decode(ids[suf + 1:-1]) == "a+b" and not tok.id_to_token(ids[suf + 1]).startswith("▁")
    assert tok.decode(ids, skip_special_tokens=False) == "<s> <PRE> def f(a): <SUF>a+b <MID>"

    tok = LLMTokenizer.from_gguf(_spm_meta(["[PREFIX]", "[SUFFIX]", "[MIDDLE]"]))
    fmt = fim.detect(tok)
    ids = fim.render(tok, fmt, fim.FimRequest("def f(a):", "a+b"))
    # mistral-common's encode_fim: [BOS][SUFFIX]suffix[PREFIX]prefix, no middle token
    tid = tok.tok.token_to_id
    assert fmt.name == "codestral" and fmt.middle_id is None
    assert ids == [tok.bos_id, tid("[SUFFIX]"), *ids[2:ids.index(tid("[PREFIX]"))], tid("[PREFIX]"),
                   *tok.encode("def f(a):")]
    assert tok.decode(ids[2:ids.index(tid("[PREFIX]"))]) == "a+b" and tid("[MIDDLE]") not in ids


@pytest.mark.parametrize("names,family", [
    (["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"], "starcoder"),
    (["<｜fim▁begin｜>", "<｜fim▁end｜>", "<｜fim▁hole｜>"], "deepseek"),  # prefix, middle, suffix
])
def test_starcoder_and_deepseek(tmp_path, names, family):
    """The embedded model's vocabulary (StarCoder's: it has <repo_name> and <file_sep>) with a
    family's FIM tokens added: <fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle> and
    <｜fim▁begin｜>{prefix}<｜fim▁hole｜>{suffix}<｜fim▁end｜>."""
    from tokenizers import AddedToken, Tokenizer

    from localllm.model.gguf import read_gguf
    from localllm.registry import resolve_model

    LLMTokenizer.from_gguf(read_gguf(resolve_model("smollm2-135m").local_path).metadata).save_hf(tmp_path)
    t = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    t.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    t.save(str(tmp_path / "tokenizer.json"))
    tok = LLMTokenizer.from_dir(tmp_path)
    fmt = fim.detect(tok)
    tid = t.token_to_id
    pre, mid, suf = (tid(n) for n in names[:3])
    assert (fmt.name, fmt.prefix_id, fmt.suffix_id, fmt.middle_id) == (family, pre, suf, mid)
    if family == "starcoder":  # the repository tokens the vocabulary already had
        assert (fmt.pad_id, fmt.repo_id, fmt.file_sep_id) == (tid("<fim_pad>"), tid("<repo_name>"), tid("<file_sep>"))
    assert fim.render(tok, fmt, fim.FimRequest(PREFIX, SUFFIX)) == [
        pre, *t.encode(PREFIX, add_special_tokens=False).ids, suf, *t.encode(SUFFIX, add_special_tokens=False).ids,
        mid]


def test_gguf_fim_keys(tmp_path):
    """A GGUF written by the gguf package declaring its FIM tokens by id: names no family uses, so
    only the keys can find them; the old prefix/suffix/middle key names are read too."""
    import gguf

    from localllm.model.gguf import read_gguf

    for keys in (("fim_pre", "fim_suf", "fim_mid"), ("prefix", "suffix", "middle")):
        path = tmp_path / f"{keys[0]}.gguf"
        meta = _spm_meta(["<A>", "<B>", "<C>", "<D>"])
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tokenizer_model("llama")
        w.add_token_list(meta["tokenizer.ggml.tokens"])
        w.add_token_types(meta["tokenizer.ggml.token_type"])
        w.add_token_scores(meta["tokenizer.ggml.scores"])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        names = meta["tokenizer.ggml.tokens"]
        for key, name in zip(keys, ("<B>", "<A>", "<C>")):  # suffix first in the vocabulary, as some are
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", names.index(name))
        w.add_uint32("tokenizer.ggml.fim_pad_token_id", names.index("<D>"))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tok = LLMTokenizer.from_gguf(read_gguf(path).metadata)
        fmt = fim.detect(tok)
        assert (fmt.name, fmt.source) == ("generic", "GGUF tokenizer.ggml.fim_*_token_id")
        assert (fmt.prefix_id, fmt.suffix_id, fmt.middle_id) == tuple(names.index(n) for n in ("<B>", "<A>", "<C>"))
        assert fmt.stop_ids() == [names.index("<D>")]
        ids = fim.render(tok, fmt, fim.FimRequest("ab", "cd"))
        assert ids == [1, names.index("<B>"), *tok.encode("ab"), names.index("<A>"), *tok.encode("cd"),
                       names.index("<C>")]
    # declared ids of a known family keep that family's order and spacing (CodeLlama's converter writes them)
    meta = _spm_meta(["▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"], {"fim_pre": "▁<PRE>", "fim_suf": "▁<SUF>",
                                                               "fim_mid": "▁<MID>"})
    fmt = fim.detect(LLMTokenizer.from_gguf(meta))
    assert (fmt.name, fmt.bare_suffix, fmt.source) == ("codellama", True, "GGUF tokenizer.ggml.fim_*_token_id")


# ---- a real server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def greedy(model_dir):
    """transformers' fp32 greedy continuation of token ids: the reference the server must equal."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def run(ids: list[int], n: int) -> list[int]:
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None)
        return out[0, len(ids):].tolist()
    return run


def test_suffix_through_the_clients_is_transformers_greedy(server, greedy, hf):
    want_ids = published(hf, PREFIX, SUFFIX)
    ref = hf.decode(greedy(want_ids, 8))
    client = openai_client(server)
    r = client.completions.create(model=FIM_MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == len(want_ids) and r.choices[0].text == ref
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=FIM_MODEL, prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == ref
    o = ollama.Client(host=server.base, timeout=60)
    opts = {"temperature": 0, "num_predict": 8}
    for raw in (False, True):  # FIM tokens are no chat template: raw or not, the same prompt
        g = o.generate(model=FIM_MODEL, prompt=PREFIX, suffix=SUFFIX, raw=raw, options=opts)
        assert (g.response, g.prompt_eval_count) == (ref, len(want_ids))
    # at the top of a file: no text before the hole is still an insertion, not a load-only call
    g = o.generate(model=FIM_MODEL, prompt="", suffix=SUFFIX, options=opts)
    assert g.prompt_eval_count == len(published(hf, "", SUFFIX)) and g.eval_count == 8
    # Continue reads Ollama's "insert" capability to decide whether a model can fill in the middle
    caps = {m: httpx.post(server.base + "/api/show", json={"model": m}, timeout=30).json()["capabilities"]
            for m in (FIM_MODEL, "smollm2-135m")}
    assert "insert" in caps[FIM_MODEL] and "insert" not in caps["smollm2-135m"]
    r = httpx.post(server.base + "/api/generate", timeout=30, json={
        "model": FIM_MODEL, "prompt": PREFIX, "suffix": SUFFIX, "system": "be brief", "stream": False})
    assert r.status_code == 400 and "system cannot be combined with suffix" in r.json()["error"]


def test_infill_in_llama_cpp_shape(server, greedy, hf):
    extra = [{"filename": "util.py", "text": "import os\n"}]
    enc = hf_text(hf)
    tid = hf.convert_tokens_to_ids
    want_ids = ([tid("<|repo_name|>")] + enc("myproject\n") + [tid("<|file_sep|>")] + enc("util.py\n")
                + enc("import os\n") + [tid("<|file_sep|>")] + enc("filename\n") + published(hf, PREFIX, SUFFIX))
    ref = greedy(want_ids, 6)
    body = {"model": FIM_MODEL, "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": extra,
            "n_predict": 6, "temperature": 0, "cache_prompt": True, "samplers": ["top_k", "infill"]}
    r = httpx.post(server.base + "/infill", json=body, timeout=60)
    assert r.status_code == 200, r.text
    j = r.json()
    assert (j["content"], j["stop"], j["stop_type"], j["tokens_predicted"], j["tokens_evaluated"]) == (
        hf.decode(ref), True, "limit", 6, len(want_ids))
    assert j["timings"]["predicted_n"] == 6 and j["timings"]["prompt_n"] + j["timings"]["cache_n"] == len(want_ids)
    events = []
    with httpx.stream("POST", server.base + "/infill", json={**body, "stream": True}, timeout=60) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        for line in s.iter_lines():
            if line:
                assert line.startswith("data: ")
                events.append(json.loads(line[6:]))
    assert [t for e in events[:-1] for t in e["tokens"]] == ref and all(not e["stop"] for e in events[:-1])
    assert "".join(e["content"] for e in events) == hf.decode(ref) and events[-1]["stop"] is True
    assert events[-1]["timings"]["cache_n"] >= BLOCK * ((len(want_ids) - 1) // BLOCK)  # the same prompt again
    r = httpx.post(server.base + "/infill", json={**body, "input_extra": [{"filename": "x"}]}, timeout=30)
    assert r.status_code == 400 and "input_extra" in r.json()["error"]["message"]


def test_a_model_without_fim_tokens_is_a_400_naming_it(server):
    client = openai_client(server)
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2-135m", prompt=PREFIX, suffix=SUFFIX, max_tokens=2)
    assert e.value.body["param"] == "suffix" and e.value.body["code"] == "model_cannot_infill", e.value.body
    assert "smollm2-135m cannot fill in the middle: its tokenizer has no FIM tokens" in e.value.body["message"]
    r = httpx.post(server.base + "/api/generate", json={"model": "smollm2-135m", "prompt": "a", "suffix": "b"},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"].startswith("smollm2-135m cannot fill in the middle")
    r = httpx.post(server.base + "/infill", json={"input_prefix": "a", "input_suffix": "b"}, timeout=60)  # default model
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("smollm2-135m cannot fill in the middle")
    with pytest.raises(openai.BadRequestError, match="suffix needs a text prompt"):
        client.completions.create(model=FIM_MODEL, prompt=[1, 2, 3], suffix="x", max_tokens=2)


def _file(n_lines: int, tag: str) -> str:
    return "".join(f"def f_{tag}_{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(n_lines))


def _keystrokes(server, send) -> None:
    """An editor typing at the end of a ~600-token prefix: each request after the first is served
    from the prefix cache up to the block holding the cursor (the suffix after it is recomputed)."""
    head = _file(20, str(server.port))
    cached = [send(head + text) for text in ("", "r", "re", "ret")]
    assert cached[0] < cached[1] and cached[1] >= BLOCK * ((len(head) // 8) // BLOCK)
    assert all(c >= cached[1] - BLOCK for c in cached[2:])  # every keystroke hits


def test_keystrokes_hit_the_prefix_cache(server):
    client = openai_client(server)

    def openai_send(prefix: str) -> int:
        r = client.completions.create(model=FIM_MODEL, prompt=prefix, suffix=SUFFIX, max_tokens=2, temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens
    _keystrokes(server, openai_send)

    def infill_send(prefix: str) -> int:
        r = httpx.post(server.base + "/infill", timeout=60, json={
            "model": FIM_MODEL, "input_prefix": "# infill\n" + prefix, "input_suffix": SUFFIX, "n_predict": 2})
        return r.json()["timings"]["cache_n"]
    _keystrokes(server, infill_send)


@pytest.fixture(scope="module")
def pinned(model_dir):
    with running("--ctx", "2048", "--kv-memory", "128MiB", "--threads", "1", "--enforce-eager", "--api-key", KEY,
                 model=str(model_dir)) as s:
        yield s


@pytest.mark.slow  # a second server (~15 s): `make test-slow`; the default run covers the plain on-demand server
def test_pinned_with_api_key(pinned, model_dir, hf):
    r = httpx.post(pinned.base + "/infill", json={"input_prefix": PREFIX, "input_suffix": SUFFIX}, timeout=30)
    assert r.status_code == 401
    import openai

    client = openai.OpenAI(base_url=pinned.base + "/v1", api_key=KEY, max_retries=0, timeout=60)
    r = client.completions.create(model=str(model_dir), prompt=PREFIX, suffix=SUFFIX, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == len(published(hf, PREFIX, SUFFIX)) and r.usage.completion_tokens == 4
    auth = {"Authorization": f"Bearer {KEY}"}
    j = httpx.post(pinned.base + "/infill", headers=auth, timeout=60, json={
        "input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 4, "temperature": 0}).json()
    assert j["tokens_predicted"] == 4 and j["model"] == str(model_dir)
    g = ollama.Client(host=pinned.base, headers=auth, timeout=60).generate(
        model=str(model_dir), prompt=PREFIX, suffix=SUFFIX, options={"temperature": 0, "num_predict": 4})
    assert g.prompt_eval_count == len(published(hf, PREFIX, SUFFIX))

    def send(prefix: str) -> int:
        r = client.completions.create(model=str(model_dir), prompt=prefix, suffix=SUFFIX, max_tokens=2)
        return r.usage.prompt_tokens_details.cached_tokens
    _keystrokes(pinned, send)
