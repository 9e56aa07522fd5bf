"""A GGUF without `tokenizer.chat_template` gets its family's published template, and BOS / EOS go
where the file asks on every path. Tiny vocabularies written with the gguf package (SentencePiece
for Gemma, byte-level BPE for Llama 3 and Qwen); the reference is transformers: its own GGUF
tokenizer for the same file and apply_chat_template with the publisher's template string."""

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from conftest import make_engine
from server_proc import running
from test_families import GEMMA, GEMMA3_TEMPLATE, PHI3_TEMPLATE, PHI4_TEMPLATE, peaked, write_gguf
from test_tokenizer_gguf import _pieces
from typer.testing import CliRunner

from localllm.chat import ChatTemplateError, render_chat
from localllm.cli import app
from localllm.family_templates import gguf_chat_template
from localllm.model.gguf import read_gguf
from localllm.model.loader import load_model
from localllm.reasoning import reasons
from localllm.tokenizer import LLMTokenizer

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

QWEN3_TEMPLATE = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
# meta-llama/Meta-Llama-3-8B-Instruct, tokenizer_config.json
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CONVERSATIONS = [
    QUESTION,
    [{"role": "system", "content": "Be brief."}, *QUESTION],
    [*QUESTION, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And the lowest word?"}],
]
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_spm_vocab(path: Path, arch: str, specials: list[str], bos: int, eos: int, add_bos: bool = True,
                    add_eos: bool | None = None, template: str | None = None, name: str = "tiny") -> Path:
    """A SentencePiece vocabulary as Gemma files store theirs: specials, 256 byte tokens, then
    pieces best-first (transformers' Gemma builder merges in file order), no space prefix."""
    pieces = _pieces()
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))])
    w.add_token_types([2 if t == "<unk>" else 3 for t in specials] + [6] * 256 + [1] * len(pieces))
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    w.add_add_space_prefix(False)
    if template is not None:
        w.add_chat_template(template)
    _finish(w)
    return path


def _byte_chars() -> list[str]:
    """GPT-2's byte -> character table (printable bytes stand for themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def write_bpe_vocab(path: Path, arch: str, pre: str, specials: list[str], bos: str, eos: str,
                    add_bos: bool | None, user_defined: tuple[str, ...] = (), name: str = "tiny") -> Path:
    """A byte-level BPE vocabulary: the 256 byte symbols, left-to-right merges spelling a few
    words, then the specials (control tokens) and `user_defined` ones."""
    chars = _byte_chars()
    tokens, merges = list(chars), []
    for word in ("Ġthe", "Ġcapital", "Ġof", "ĠFrance", "What", "Ġis", "user", "assistant", "system", "Ġbrief",
                 "Ġlowest", "Ġword", "hello", "Ġworld", "Paris"):
        left = word[0]
        for c in word[1:]:
            if left + c not in tokens:
                tokens.append(left + c)
                merges.append(f"{left} {c}")
            left += c
    types = [1] * len(tokens) + [3] * len(specials) + [4] * len(user_defined)
    tokens += specials + list(user_defined)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index(bos))
    w.add_eos_token_id(tokens.index(eos))
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    _finish(w)
    return path


def reference_ids(path: Path, template: str, messages: list[dict], **kwargs) -> list[int]:
    """transformers: its GGUF tokenizer for the file, apply_chat_template with the published template."""
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    arch, tok_dict, cfg = get_gguf_tokenizer(str(path))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=convert_gguf_tokenizer(arch, tok_dict)[0],
                                               bos_token=cfg["bos_token"], eos_token=cfg["eos_token"])
    out = tok.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=True,
                                  **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def load_tok(path: Path, drop: tuple[str, ...] = (), **extra) -> LLMTokenizer:
    meta = {k: v for k, v in read_gguf(path).metadata.items() if k not in drop} | extra
    return LLMTokenizer.from_gguf(meta, str(path))


def chat_ids(tok: LLMTokenizer, messages: list[dict], **kwargs) -> list[int]:
    """What the engine sends for a chat request (LLMEngine.encode_prompt's chat branch)."""
    return tok.encode_chat(render_chat(tok.chat_template, messages, bos_token=tok.bos_token,
                                       eos_token=tok.eos_token, **kwargs))


# ---- Gemma 3: the file a user downloads, shaped small -------------------------------------------
@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(GGUF path, vocabulary GGUF, loaded model): a Gemma-3-shaped model (6 layers, five sliding to
    one global) with a Gemma vocabulary, written with no chat template and add_bos_token true."""
    out = tmp_path_factory.mktemp("gemma3-notemplate")
    vocab = write_spm_vocab(out / "vocab.gguf", "gemma3", GEMMA_SPECIALS, bos=2, eos=1)
    size = len(read_gguf(vocab).metadata["tokenizer.ggml.tokens"])
    cfg = transformers.Gemma3TextConfig(**(GEMMA | dict(num_hidden_layers=6, vocab_size=size)))
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    peaked(model, seed=1)
    model.tie_weights()
    path = write_gguf(model, "gemma3", out / "gemma-3-tiny-it.gguf", vocab)
    assert "tokenizer.chat_template" not in read_gguf(path).metadata
    return path, vocab, load_model(path, "float32")


def test_gemma3_without_template_renders_gemma3_token_for_token(gemma3):
    path, _, loaded = gemma3
    engine = make_engine(loaded, num_kv_blocks=32)
    tok = engine.tokenizer
    assert (tok.template_name, tok.template_source) == (
        "gemma3", "built-in, file has no chat template; architecture gemma3")
    for messages in CONVERSATIONS:
        ids = engine.encode_prompt(messages)
        assert ids == reference_ids(path, GEMMA3_TEMPLATE, messages), messages
        assert ids[0] == tok.bos_id == 2 and ids.count(2) == 1  # BOS first, exactly one
    with pytest.raises(ChatTemplateError, match="must alternate"):
        engine.encode_prompt(QUESTION * 2)


def test_gemma3_raw_prompts_get_bos_token_ids_do_not(gemma3):
    _, _, loaded = gemma3
    engine = make_engine(loaded, num_kv_blocks=32)
    plain = engine.tokenizer.encode("hello world")
    assert engine.encode_prompt("hello world") == [2, *plain]  # --raw, /v1/completions, /api/generate raw
    assert engine.encode_prompt("<bos>hello world") == [2, *plain]  # a BOS in the text is not doubled
    assert engine.encode_prompt([7, 8, 9]) == [7, 8, 9]  # token ids as given
    assert engine.tokenizer.add_eos is False and engine.encode_prompt("hello")[-1] != 1


def test_show_names_the_template_and_why(gemma3):
    path, _, _ = gemma3
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    exe = [sys.executable, "-m", "localllm.cli", "show", str(path), "--prompt", QUESTION[0]["content"]]
    r = subprocess.run(exe + ["--json"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["chat_template"]["family"] == "gemma3"
    assert info["chat_template"]["source"] == "built-in, file has no chat template; architecture gemma3"
    assert info["prompt"]["token_ids"] == reference_ids(path, GEMMA3_TEMPLATE, QUESTION)
    assert info["prompt"]["leading_bos"] == 1 and info["bos_token"]["added_to_raw_prompts"]
    r = CliRunner().invoke(app, exe[3:])  # the text form, in process
    assert r.exit_code == 0, r.output
    assert "gemma3 (built-in, file has no chat template; architecture gemma3)" in r.stdout
    assert "'<bos>' (id 2; added to raw and chat prompts)" in r.stdout


@pytest.fixture(scope="module")
def gemma3_server(gemma3):
    path, _, _ = gemma3
    with running("--ctx", "256", model=str(path)) as srv:
        yield srv, httpx.get(srv.base + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_server_paths_bos_as_the_file_asks(gemma3, gemma3_server):
    """Through a real `localllm serve`: chat gets the family's template with one BOS; raw text on
    /v1/completions, /api/generate with raw and /tokenize gets the BOS; token ids go as given."""
    path, _, loaded = gemma3
    (srv, name), plain = gemma3_server, loaded.tokenizer.encode("hello world")
    with httpx.Client(base_url=srv.base, timeout=60) as c:
        r = c.post("/v1/chat/completions", json={"model": name, "messages": QUESTION, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(reference_ids(path, GEMMA3_TEMPLATE, QUESTION))
        r = c.post("/tokenize", json={"messages": QUESTION})
        assert r.json()["tokens"] == reference_ids(path, GEMMA3_TEMPLATE, QUESTION)
        r = c.post("/tokenize", json={"prompt": "hello world"})
        assert r.json()["tokens"] == [2, *plain]
        r = c.post("/v1/completions", json={"model": name, "prompt": "hello world", "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(plain) + 1
        r = c.post("/v1/completions", json={"model": name, "prompt": [7, 8, 9], "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens"] == 3
        r = c.post("/api/generate", json={"model": name, "prompt": "hello world", "raw": True, "stream": False,
                                          "options": {"num_predict": 1}})
        assert r.status_code == 200, r.text
        assert r.json()["prompt_eval_count"] == len(plain) + 1


# ---- Llama 3 and Qwen: byte-level vocabularies ---------------------------------------------------
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def test_llama3_pick_token_for_token(tmp_path):
    """Llama 3 is told from Llama 2 and SmolLM (all architecture "llama") by its header tokens;
    without <|eom_id|> it is 3.0. No add_bos_token key: llama.cpp's llama-bpe default adds BOS,
    and the template's own BOS is not doubled."""
    path = write_bpe_vocab(tmp_path / "llama3.gguf", "llama", "llama-bpe", LLAMA3_SPECIALS,
                           "<|begin_of_text|>", "<|eot_id|>", add_bos=None)
    tok = load_tok(path)
    assert tok.template_name == "llama3" and "no <|eom_id|> (Llama 3.0)" in tok.template_source
    assert tok.add_bos
    for messages in CONVERSATIONS:
        ids = chat_ids(tok, messages)
        assert ids == reference_ids(path, LLAMA3_TEMPLATE, messages), messages
        assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert tok.encode("hello world", add_special_tokens=True) == [tok.bos_id, *tok.encode("hello world")]


def test_llama3_1_and_3_2_picks(tmp_path):
    path = write_bpe_vocab(tmp_path / "llama31.gguf", "llama", "llama-bpe", [*LLAMA3_SPECIALS, "<|eom_id|>"],
                           "<|begin_of_text|>", "<|eot_id|>", add_bos=True, name="Llama 3.1 8B Instruct")
    tok = load_tok(path)
    assert tok.template_name == "llama3.1"
    text = render_chat(tok.chat_template, [{"role": "system", "content": "Be brief."}, *QUESTION],
                       bos_token=tok.bos_token)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
                    "December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user"
                    "<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|><|start_header_id|>assistant"
                    "<|end_header_id|>\n\n")
    assert chat_ids(tok, QUESTION).count(tok.bos_id) == 1
    tok32 = load_tok(path, **{"general.name": "Llama 3.2 1B Instruct"})
    assert tok32.template_name == "llama3.2"
    assert render_chat(tok32.chat_template, QUESTION, bos_token="<s>", date_string="01 Jan 2025") == (
        "<s><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\nToday Date: "
        "01 Jan 2025\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?"
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_qwen3_pick_token_for_token_with_thinking(tmp_path):
    """Qwen3 gets its template with the reasoning tags (so `--think` / enable_thinking work); its
    files say add_bos_token false, and no BOS is added."""
    path = write_bpe_vocab(tmp_path / "qwen3.gguf", "qwen3", "qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                           "<|endoftext|>", "<|im_end|>", add_bos=False, user_defined=("<think>", "</think>"))
    tok = load_tok(path)
    assert (tok.template_name, tok.template_source) == ("qwen3", "built-in, file has no chat template; architecture qwen3")
    assert reasons(tok.chat_template)
    for messages in CONVERSATIONS:
        for kwargs in ({}, {"enable_thinking": False}):
            ids = chat_ids(tok, messages, **kwargs)
            assert ids == reference_ids(path, QWEN3_TEMPLATE, messages, **kwargs), (messages, kwargs)
            assert tok.bos_id not in ids
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello")


def test_qwen2_pick(tmp_path):
    path = write_bpe_vocab(tmp_path / "qwen2.gguf", "qwen2", "qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                           "<|endoftext|>", "<|im_end|>", add_bos=False)
    tok = load_tok(path)
    assert tok.template_name == "qwen2.5"
    assert render_chat(tok.chat_template, QUESTION) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


# ---- the other picks, from metadata alone ---------------------------------------------------------
SYSTEM_AND_QUESTION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def _meta(arch: str, tokens: list[str], kind: str = "gpt2", **general) -> dict:
    return {"general.architecture": arch, "tokenizer.ggml.model": kind, "tokenizer.ggml.tokens": tokens,
            **{f"general.{k}": v for k, v in general.items()}}


@pytest.mark.parametrize("meta, name, messages, bos, eos, expected", [
    (_meta("gemma2", ["<bos>"], "llama"), "gemma", SYSTEM_AND_QUESTION[1:], "<bos>", "",
     "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"),
    (_meta("phi3", ["<|user|>"], "llama"), "phi3", SYSTEM_AND_QUESTION, "", "<|endoftext|>",
     render_chat(PHI3_TEMPLATE, SYSTEM_AND_QUESTION, eos_token="<|endoftext|>")),
    (_meta("phi3", ["<|user|>"]), "phi4-mini", SYSTEM_AND_QUESTION, "", "",
     render_chat(PHI4_TEMPLATE, SYSTEM_AND_QUESTION)),
    (_meta("phi3", ["<|im_start|>", "<|im_sep|>", "<|im_end|>"]), "phi4", SYSTEM_AND_QUESTION, "", "",
     "<|im_start|>system<|im_sep|>Be brief.<|im_end|><|im_start|>user<|im_sep|>Hi<|im_end|>"
     "<|im_start|>assistant<|im_sep|>"),
    (_meta("llama", ["<s>", "[INST]", "[/INST]"], "llama"), "mistral-v0.3", SYSTEM_AND_QUESTION, "<s>", "</s>",
     "<s>[INST] Be brief.\n\nHi[/INST]"),
    (_meta("llama", ["<s>"], "llama", name="Mistral 7B Instruct v0.2"), "mistral-v0.1", SYSTEM_AND_QUESTION[1:],
     "<s>", "</s>", "<s>[INST] Hi [/INST]"),
    (_meta("llama", ["<s>"], "llama", name="Llama 2 7B Chat"), "llama2", SYSTEM_AND_QUESTION, "<s>", "</s>",
     "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]"),
    (_meta("llama", ["<|im_start|>", "<|im_end|>"], basename="smollm2"), "chatml", SYSTEM_AND_QUESTION, "", "",
     "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
])
def test_family_picks_render_as_published(meta, name, messages, bos, eos, expected):
    choice = gguf_chat_template(meta)
    assert choice.name == name and choice.why.startswith("built-in, file has no chat template; architecture ")
    assert render_chat(choice.template, messages, bos_token=bos, eos_token=eos) == expected


def test_gpt_oss_without_a_template_gets_harmony():
    """A gpt-oss file without a template gets the one openai/gpt-oss-* publish (harmony: the
    effort, channels and tool calls its replies are read by), never ChatML; a file's own harmony
    template is named for it."""
    from localllm.family_templates import template_family
    from localllm.tool_calls import style_of

    published = (Path(__file__).parent / "data" / "gpt_oss_chat_template.jinja").read_text()
    choice = gguf_chat_template(_meta("gpt-oss", ["<|start|>", "<|channel|>", "<|message|>", "<|end|>"]))
    assert (choice.name, choice.template) == ("gpt-oss", published)
    assert choice.why == "built-in, file has no chat template; architecture gpt-oss"
    assert style_of(choice.template) == "harmony"
    text = render_chat(choice.template, SYSTEM_AND_QUESTION, reasoning_effort="low")
    assert "Reasoning: low" in text and text.endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant")
    assert template_family(published) == "gpt-oss"


def test_gemma2_refuses_a_system_prompt_as_published():
    choice = gguf_chat_template(_meta("gemma2", [], "llama"))
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        render_chat(choice.template, SYSTEM_AND_QUESTION)


def test_files_own_template_wins_and_unknown_families_say_so():
    own = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    choice = gguf_chat_template(_meta("gemma3", []) | {"tokenizer.chat_template": own})
    assert (choice.template, choice.why) == (own, "from the file")
    choice = gguf_chat_template(_meta("llama", ["<s>"], "llama", name="some model"))
    assert choice.name == "chatml" and "no family we know" in choice.why and "architecture llama" in choice.why


def test_add_eos_token_is_honoured_on_raw_prompts_only(tmp_path):
    path = write_spm_vocab(tmp_path / "eos.gguf", "gemma3", GEMMA_SPECIALS, bos=2, eos=1, add_eos=True)
    tok = load_tok(path)
    plain = tok.encode("hello world")
    assert tok.add_eos and tok.encode("hello world", add_special_tokens=True) == [2, *plain, 1]
    ids = chat_ids(tok, QUESTION)
    assert ids[0] == 2 and ids[-1] != 1  # the assistant's turn follows: no EOS after the prompt


def test_bos_added_to_chat_when_the_template_writes_none(tmp_path):
    """Phi-3's template writes no BOS; a file with add_bos_token true gets one in front of the chat
    prompt, as llama.cpp sends it (a Hugging Face model's template alone decides, as transformers)."""
    path = write_spm_vocab(tmp_path / "phi3.gguf", "phi3", ["<unk>", "<s>", "</s>", "<|user|>", "<|end|>",
                                                           "<|assistant|>"], bos=1, eos=2)
    tok = load_tok(path)
    text = render_chat(tok.chat_template, QUESTION, eos_token=tok.eos_token)
    assert tok.template_name == "phi3" and not text.startswith("<s>")
    assert chat_ids(tok, QUESTION) == [1, *tok.encode(text)]
    assert load_tok(path, **{"tokenizer.ggml.add_bos_token": False}).encode_chat(text) == tok.encode(text)
