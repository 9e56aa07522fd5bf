"""SentencePiece-style ("llama") GGUF vocabularies: a synthetic file checked against transformers'
own GGUF tokenizer loading and against a direct implementation of the SentencePiece BPE
encoding llama.cpp runs (highest-scoring adjacent pair first, then byte fallback)."""

import random
from pathlib import Path

import pytest

from localllm.chat import render_chat
from localllm.model.gguf import read_gguf
from localllm.tokenizer import IncrementalDetokenizer, LLMTokenizer

gguf = pytest.importorskip("gguf")

SPECIALS = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>", "<think>"]
TYPES = {"<unk>": 2, "<think>": 4}  # the others are control (3); <think> user-defined
WORDS = ["hello", "help", "held", "world", "word", "the", "there", "lowest", "lower", "newer", "new", "wider",
         "token", "tokenizer", "model", "user", "café", "über", "你好"]
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + (message['role'] if message['role'] != "
    "'assistant' else 'model') + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")

TEXTS = [
    "hello world", "the lowest newer wider", "helloworld", "tokenizer token", "Hello World!",
    "xyzzy quux", "café über", "你好世界", "emoji 😀 here", "  two leading", "trailing  ", "a   b   c",
    " ", "", "line one\nline two\n\n", "\n", "\thello\t", "ü", "héllo",
    "<start_of_turn>user\nhello there<end_of_turn>\n<start_of_turn>model\n",
    "<s>hello</s>", "hello<think>world", "<start_of_turn>  spaced", "<end_of_turn><end_of_turn>",
]


def _pieces() -> list[str]:
    """Normal pieces: every character of the words, and substrings of "▁word" reachable by
    joining two shorter pieces (as a trained SentencePiece BPE vocabulary is)."""
    chars = sorted({c for w in WORDS for c in "▁" + w} | set("abcdefghijklmnopqrstuvwxyz,.!?"))
    pieces = set(chars)
    for w in WORDS:
        s = "▁" + w
        for n in range(2, len(s) + 1):
            for i in range(len(s) - n + 1):
                sub = s[i:i + n]
                if (n <= 3 or (i == 0 and n == len(s))) and any(sub[:k] in pieces and sub[k:] in pieces
                                                          for k in range(1, n)):
                    pieces.add(sub)
    return chars + sorted(pieces - set(chars))


def vocab(seed: int, score_order: bool) -> tuple[list[str], list[float], list[int]]:
    """Specials, the 256 byte tokens, then normal pieces with shuffled scores (so merge order
    depends on scores, not on word order); `score_order` lists the normal pieces best-first."""
    rng = random.Random(seed)
    normal = _pieces()
    scores = [-float(s) for s in rng.sample(range(1, 10 * len(normal)), len(normal))]
    pairs = list(zip(normal, scores))
    if score_order:
        pairs.sort(key=lambda p: -p[1])
    else:
        rng.shuffle(pairs)
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + [p for p, _ in pairs]
    scores = [0.0] * (len(SPECIALS) + 256) + [s for _, s in pairs]
    types = [TYPES.get(t, 3) for t in SPECIALS] + [6] * 256 + [1] * len(pairs)
    return tokens, scores, types


def write_vocab_gguf(path: Path, arch: str, prefix: bool, seed: int = 0, score_order: bool = False,
                     eot: int | None = None, tensors: dict | None = None) -> Path:
    tokens, scores, types = vocab(seed, score_order)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("spm-test")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(prefix)
    w.add_chat_template(GEMMA_TEMPLATE)
    if eot is not None:
        w.add_eot_token_id(eot)
    if tensors:  # a 1-layer model: 2 heads of 16, one KV head
        w.add_block_count(1)
        w.add_context_length(128)
        w.add_embedding_length(tensors["token_embd.weight"].shape[1])
        w.add_feed_forward_length(tensors["blk.0.ffn_up.weight"].shape[0])
        w.add_head_count(2)
        w.add_head_count_kv(1)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-5)
        for name, t in tensors.items():
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def spm_encode(text: str, tokens: list[str], scores: list[float], types: list[int], prefix: bool) -> list[int]:
    """SentencePiece BPE as llama.cpp runs it, written out directly: control/user-defined tokens
    cut the text first; each other fragment gets "▁" for spaces (and one in front with the prefix),
    then the adjacent pair whose join is the best-scoring normal piece merges (leftmost on ties);
    what is left outside the vocabulary becomes <0xNN> byte tokens."""
    ids = {t: i for i, t in enumerate(tokens)}
    specials = sorted((t for t, ty in zip(tokens, types) if ty in (3, 4)), key=len, reverse=True)
    normal = {t: scores[i] for i, t in enumerate(tokens) if types[i] == 1}
    out, frag, i = [], "", 0

    def flush(frag: str) -> None:
        if not frag:
            return
        syms = list(("▁" if prefix else "") + frag.replace(" ", "▁"))
        while True:
            cands = [(normal[a + b], -k) for k, (a, b) in enumerate(zip(syms, syms[1:])) if a + b in normal]
            if not cands:
                break
            k = -max(cands)[1]
            syms[k:k + 2] = [syms[k] + syms[k + 1]]
        for s in syms:
            out.extend([ids[s]] if s in normal else [ids[f"<0x{b:02X}>"] for b in s.encode()])

    while i < len(text):
        hit = next((s for s in specials if text.startswith(s, i)), None)
        if hit is None:
            frag += text[i]
            i += 1
            continue
        flush(frag)
        frag = ""
        out.append(ids[hit])
        i += len(hit)
    flush(frag)
    return out


def load(path: Path) -> LLMTokenizer:
    return LLMTokenizer.from_gguf(read_gguf(path).metadata, str(path))


def transformers_tokenizer(path: Path):
    """transformers' GGUF tokenizer (the `tokenizers` object it builds) and its config."""
    pytest.importorskip("transformers")
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    arch, tok_dict, cfg = get_gguf_tokenizer(str(path))
    return convert_gguf_tokenizer(arch, tok_dict)[0], cfg


# transformers builds the tokenizer llama.cpp runs (prefix before every fragment, by a normalizer)
# for arch "phi3", and the one without a prefix for "gemma2" (merges by file order there, so that
# file lists its pieces best-first); its plain "llama" builder uses Metaspace, which differs on
# leading spaces and after special tokens.
CASES = {"prefix": ("phi3", True, False), "no-prefix": ("gemma2", False, True)}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    arch, prefix, score_order = CASES[request.param]
    path = write_vocab_gguf(tmp_path_factory.mktemp("spm") / "vocab.gguf", arch, prefix, seed=1,
                            score_order=score_order)
    tokens, scores, types = vocab(1, score_order)
    return path, prefix, load(path), (tokens, scores, types)


def test_encode_matches_transformers_gguf_tokenizer(case):
    path, _, tok, _ = case
    ref, cfg = transformers_tokenizer(path)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids, text
    assert (tok.bos_token, tok.eos_token, tok.add_bos) == (cfg["bos_token"], cfg["eos_token"], cfg["add_bos_token"])


def test_encode_matches_sentencepiece_bpe_reference(case):
    _, prefix, tok, (tokens, scores, types) = case
    for text in TEXTS:
        assert tok.encode(text) == spm_encode(text, tokens, scores, types, prefix), text


def test_multi_step_merges_follow_scores(case):
    """The test vocabulary is only a test if merge order changes results: merges ranked by piece
    id (where ids do not follow scores) or by reversed score tokenize these words differently."""
    _, prefix, tok, (tokens, scores, types) = case
    alternatives = [[-s for s in scores]]
    normal = [s for s, ty in zip(scores, types) if ty == 1]
    if normal != sorted(normal, reverse=True):
        alternatives.append([-float(i) for i in range(len(tokens))])
    for alt in alternatives:
        differs = [w for w in WORDS if spm_encode(w, tokens, alt, types, prefix) != tok.encode(w)]
        assert len(differs) >= 3
    assert any(len(tok.encode(w)) > 1 for w in WORDS) and any(len(tok.encode(("" if prefix else " ") + w)) == 1 for w in ("hello", "world"))


def test_decode_round_trips_and_matches_transformers(case):
    path, _, tok, _ = case
    ref, _ = transformers_tokenizer(path)
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False), text
        if not any(s in text for s in SPECIALS):
            assert tok.decode(ids) == text
    # streamed pieces join to the full text (byte-fallback characters arrive whole)
    text = "hello 你好世界 😀 café\nworld"
    ids, det = tok.encode(text), IncrementalDetokenizer(tok)
    parts = [det.add([i]) for i in ids]
    assert "".join(parts) + det.flush() == text
    assert all("\ufffd" not in p for p in parts)


def test_hf_export_reloads_the_same_tokenizer(case, tmp_path):
    _, _, tok, _ = case
    tok.save_hf(tmp_path)
    again = LLMTokenizer.from_dir(tmp_path)
    assert (again.bos_id, again.eos_id, again.add_bos) == (tok.bos_id, tok.eos_id, tok.add_bos)
    for text in TEXTS:
        ids = tok.encode(text)
        assert again.encode(text) == ids and again.decode(ids, False) == tok.decode(ids, False), text


def test_special_tokens_and_chat(case):
    path, prefix, tok, (tokens, scores, types) = case
    sot, eot = tokens.index("<start_of_turn>"), tokens.index("<end_of_turn>")
    assert tok.bos_id == 1 and tok.eos_ids == {2, eot}  # no eot_token_id: <end_of_turn> by name
    assert tok.special_ids == {1, 2, sot, eot}  # control tokens; <think> (user-defined) is not special
    messages = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "new world"},
                {"role": "user", "content": "lower?"}]
    text = render_chat(tok.chat_template, messages, bos_token=tok.bos_token, eos_token=tok.eos_token)
    ids = tok.encode(text, add_special_tokens=True)
    assert ids[:2] == [1, sot] and ids.count(1) == 1  # BOS from the template, not doubled
    assert ids.count(sot) == 4 and ids.count(eot) == 3
    assert ids == spm_encode(text, tokens, scores, types, prefix)
    if not prefix:  # with the prefix, each fragment after a special token decodes with a space in front
        assert tok.decode(ids) == text.replace("<s>", "").replace("<start_of_turn>", "").replace("<end_of_turn>", "")
    assert tok.encode("hello", add_special_tokens=True)[0] == 1  # add_bos_token


def test_eot_token_id_key_and_bos_default(tmp_path):
    path = write_vocab_gguf(tmp_path / "eot.gguf", "llama", True, eot=5)
    tok = load(path)
    assert tok.eos_ids == {2, 5}
    meta = dict(read_gguf(path).metadata)
    del meta["tokenizer.ggml.add_bos_token"]  # llama.cpp's default for this vocabulary type
    assert LLMTokenizer.from_gguf(meta).add_bos


def test_unsupported_tokenizer_kind_is_one_clear_line(tmp_path):
    meta = dict(read_gguf(write_vocab_gguf(tmp_path / "v.gguf", "llama", True)).metadata)
    meta["tokenizer.ggml.model"] = "bert"
    with pytest.raises(ValueError, match=r"'bert' is not supported \(supported: 'gpt2' .*'llama'") as e:
        LLMTokenizer.from_gguf(meta, "x.gguf")
    assert "\n" not in str(e.value)


def test_model_gguf_with_a_sentencepiece_vocab_loads(tmp_path):
    """A tiny Llama GGUF (random F32 tensors) carrying this vocabulary, through localllm's model loader."""
    from localllm.model.loader import load_model

    tokens, scores, types = vocab(0, False)
    path = write_vocab_gguf(tmp_path / "m.gguf", "llama", True, tensors=_tiny_llama_tensors(len(tokens)))
    loaded = load_model(path, "float32")
    text = "<start_of_turn>user\nhello world 你好<end_of_turn>\n"
    ids = loaded.tokenizer.encode(text)
    assert ids == spm_encode(text, tokens, scores, types, True)
    assert tokens.index("<end_of_turn>") in loaded.eos_ids and 2 in loaded.eos_ids
    assert loaded.config.vocab_size == loaded.tokenizer.vocab_size == len(tokens)


def _tiny_llama_tensors(vocab_size: int, hidden: int = 32, inter: int = 64, kv: int = 16) -> dict:
    import numpy as np

    rng = np.random.default_rng(0)

    def r(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    return {"token_embd.weight": r(vocab_size, hidden), "output_norm.weight": np.ones(hidden, np.float32),
            "blk.0.attn_norm.weight": np.ones(hidden, np.float32), "blk.0.ffn_norm.weight": np.ones(hidden, np.float32),
            "blk.0.attn_q.weight": r(hidden, hidden), "blk.0.attn_k.weight": r(kv, hidden),
            "blk.0.attn_v.weight": r(kv, hidden), "blk.0.attn_output.weight": r(hidden, hidden),
            "blk.0.ffn_gate.weight": r(inter, hidden), "blk.0.ffn_up.weight": r(inter, hidden),
            "blk.0.ffn_down.weight": r(hidden, inter)}


# ---- the header's string arrays: read from the mapping when used ------------------------------------------
def _string_array_gguf(path: Path) -> tuple[Path, list[str]]:
    """A vocabulary-sized string array with what could trip a search in the raw bytes: empty
    strings, duplicates, multi-byte UTF-8, U+FFFD itself, NULs and strings that are the bytes of
    a length field, and pairs whose joined bytes spell another entry."""
    rng = random.Random(3)
    odd = ["", "", "a", "ab", "b", "é", "\ufffd", "x\ufffd", "\x00", "\x01" + "\x00" * 7, "\x02\x00\x00\x00\x00\x00\x00\x00ab",
           "你好", "<|im_start|>", "<|im_start|>", "im_start"]
    strings = odd + [f"{rng.choice(WORDS)}{i}" for i in range(6000)] + odd
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("tokenizer.ggml.tokens", strings)
    w.add_array("general.tags", ["a", "b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path, strings


def test_string_arrays_read_in_place_equal_the_file(tmp_path):
    import gguf as gguf_py
    import numpy as np

    path, strings = _string_array_gguf(tmp_path / "s.gguf")
    meta = read_gguf(path).metadata
    arr = meta["tokenizer.ggml.tokens"]
    assert type(arr) is not list and meta["general.tags"] == ["a", "b"]  # short arrays stay plain lists
    field = gguf_py.GGUFReader(path).fields["tokenizer.ggml.tokens"]
    assert list(arr) == field.contents() == strings and arr == strings and len(arr) == len(strings)
    assert [arr[i] for i in (0, 1, 6, -1, -len(strings))] == [strings[i] for i in (0, 1, 6, -1, -len(strings))]
    assert arr[3:40:7] == strings[3:40:7] and arr[::-1][:20] == strings[::-1][:20]
    with pytest.raises(IndexError):
        arr[len(strings)]
    probes = set(strings[:15]) | {strings[100], strings[-1], "", "ba", "b\x00", "\x00\x00", "abé", "im_", "zzz",
                                  "\x01", "<|im_start|>im_start", "\ufffd\ufffd"}
    for s in probes:  # found at a string's start only, first occurrence, as a list finds it
        assert (s in arr) == (s in strings), s
        if s in strings:
            assert arr.index(s) == strings.index(s), s
            later = strings.index(s) + 1
            if s in strings[later:]:
                assert arr.index(s, later) == strings.index(s, later), s
        else:
            with pytest.raises(ValueError):
                arr.index(s)
    assert np.array_equal(np.array(list(arr)), np.array(strings))


def test_the_cached_header_does_not_hold_the_vocabulary_as_python_strings(tmp_path):
    """The parsed header stays cached for the process's life: its vocabulary must not be held
    as decoded strings (8 MB for a 49k one) but as offsets into the mapping."""
    import gc
    import os
    import tracemalloc

    from localllm.model import gguf as reader

    path, strings = _string_array_gguf(tmp_path / "s.gguf")
    st = os.stat(path)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        header = reader._read_gguf.__wrapped__(path, st.st_size, st.st_mtime_ns)
        held = tracemalloc.get_traced_memory()[0] - base
        decoded = list(header.metadata["tokenizer.ggml.tokens"])
        as_strings = tracemalloc.get_traced_memory()[0] - base - held
    finally:
        tracemalloc.stop()
    assert decoded == strings
    assert held < as_strings / 4, (held, as_strings)


# the published tokenizer.json regexes (what llama.cpp's pre-tokenizer names stand for)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")  # Qwen/Qwen2.5-7B-Instruct, deepseek-ai/DeepSeek-R1-Distill-Qwen-*
TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
                r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")  # mistralai/Mistral-Nemo-Instruct-2407
SPLIT_TEXTS = ["Hello world, it's 2024!", "camelCaseWords and HTTPServer", "x=12345; (paren) 'quoted' don't",
               "path/to/file.py\r\n  indented\n\nÉcole naïve ÑANDÚ", "ABCdef GHIjkl 3.14159", "  spaces   here  "]


@pytest.mark.parametrize("pre, split", [("deepseek-r1-qwen", QWEN2_SPLIT), ("qwen2", QWEN2_SPLIT),
                                        ("tekken", TEKKEN_SPLIT)])
def test_pre_tokenizer_names_split_as_their_tokenizer_json(gguf_path, pre, split):
    """A byte-level GGUF's tokenizer.ggml.pre names its family's split (DeepSeek-R1's Qwen distills say
    "deepseek-r1-qwen" for Qwen2's, Mistral NeMo "tekken"): the words our tokenizer hands the BPE are
    the published tokenizer.json regex's on the same text, and not GPT-2's (the default)."""
    import regex
    from test_families import tokenizer_fields

    meta = {k: v for k, v, _, _ in tokenizer_fields(gguf_path)}

    def words(name: str, text: str) -> list[str]:
        tok = LLMTokenizer.from_gguf(meta | {"tokenizer.ggml.pre": name}).tok
        return [tok.decoder.decode([w]) for w, _ in tok.pre_tokenizer.pre_tokenize_str(text)]

    for text in SPLIT_TEXTS:
        assert words(pre, text) == regex.findall(split, text), text
    assert any(words(pre, t) != words("default", t) for t in SPLIT_TEXTS)


def test_an_unknown_pre_tokenizer_name_is_said(gguf_path, caplog):
    """A name no family has gets GPT-2's split, as llama.cpp gives it, and a warning says so; the
    names llama.cpp gives GPT-2's split itself say nothing."""
    from test_families import tokenizer_fields

    meta = {k: v for k, v, _, _ in tokenizer_fields(gguf_path)}
    with caplog.at_level("WARNING", logger="localllm"):
        unknown = LLMTokenizer.from_gguf(meta | {"tokenizer.ggml.pre": "some-new-model"})
    assert "tokenizer.ggml.pre 'some-new-model' is no pre-tokenizer we know" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="localllm"):
        gpt2 = LLMTokenizer.from_gguf(meta | {"tokenizer.ggml.pre": "gpt-2"})
    assert caplog.text == ""
    assert unknown.encode(SPLIT_TEXTS[0]) == gpt2.encode(SPLIT_TEXTS[0])
