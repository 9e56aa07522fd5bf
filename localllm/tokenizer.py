"""Tokenizer wrapper (built from tokenizer.json or a GGUF vocab) and the incremental detokenizer."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

# Pre-tokenizer regexes of the byte-level BPE families llama.cpp knows by `tokenizer.ggml.pre`.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (gpt-oss; llama.cpp's "gpt-4o"): words split at case changes, contractions kept on, digits in threes
_GPT4O_REGEX = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])
# Mistral NeMo / Small 3 (llama.cpp's "tekken"): o200k's case-change words without contractions, one digit
_TEKKEN_REGEX = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
    r"\p{N}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])
# a GGUF's tokenizer.ggml.pre -> the split its tokenizer.json makes before the byte-level BPE, named
# as llama.cpp's llama-vocab.cpp groups them (several names, one pre-tokenizer)
_PRE_SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral"),
                               _LLAMA3_REGEX),  # (dbrx: cl100k's split, the same as Llama 3's)
               **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "kormo"), _QWEN2_REGEX),
               **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_REGEX), "tekken": _TEKKEN_REGEX}
_DIGIT_SPLITS = ("smollm", "starcoder", "refact")  # GPT-2's split with every digit apart
# names llama.cpp gives GPT-2's own split
_GPT2_SPLITS = ("default", "gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "exaone4", "mellum", "roberta-bpe")
# gpt-oss (harmony): a reply ends at <|return|>, or at <|call|> (a tool call); its <|end|> closes one
# message (the reasoning) and the reply goes on, so it is no end of turn there (llama.cpp's rule too)
HARMONY_EOG = ("<|return|>", "<|call|>")
# harmony's message markup, written out in replies (reasoning.HarmonySplitter reads the channels from
# it, as llama.cpp renders these for its parser)
HARMONY_MARKUP = ("<|start|>", "<|end|>", "<|channel|>", "<|message|>", "<|constrain|>")
# byte-level vocabularies llama.cpp adds BOS to when the file does not say (its Llama 3 group;
# Llama 3.x GGUFs carry no tokenizer.ggml.add_bos_token)
_BOS_BY_DEFAULT = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                   "jina-v5-nano", "tekken", "chameleon")


def _token_content(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


@dataclass
class TokenizerInfo:
    tokenizer: Tokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos: bool = False
    chat_template: str | None = None
    extra_eos_ids: set[int] = field(default_factory=set)
    add_eos: bool = False
    # chat prompts get the BOS add_bos asks for even when the template writes none (llama.cpp's
    # way, for GGUF files); a Hugging Face model's template alone decides (transformers' way)
    chat_adds_bos: bool = False
    template_name: str = "chatml"
    template_source: str = "built-in default: the model ships no chat template"
    fim_ids: dict[str, int] = field(default_factory=dict)  # a GGUF's declared FIM tokens (fim.GGUF_KEYS)
    # special tokens decode() writes out even when it skips the others (harmony's markup)
    rendered: frozenset[str] = frozenset()


class LLMTokenizer:
    """Encode/decode plus the special tokens and chat template a model ships with."""

    def __init__(self, info: TokenizerInfo):
        self.tok = info.tokenizer
        self.bos_token, self.eos_token = info.bos_token, info.eos_token
        self.bos_id = self.tok.token_to_id(info.bos_token) if info.bos_token else None
        self.eos_id = self.tok.token_to_id(info.eos_token) if info.eos_token else None
        self.add_bos, self.add_eos, self.chat_adds_bos = info.add_bos, info.add_eos, info.chat_adds_bos
        self.chat_template = info.chat_template
        self.template_name, self.template_source = info.template_name, info.template_source
        self.eos_ids = set(info.extra_eos_ids)
        if self.eos_id is not None:
            self.eos_ids.add(self.eos_id)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
        rendered = {self.tok.token_to_id(n) for n in info.rendered} - {None}
        self._skipped = frozenset(self.special_ids - rendered) if rendered else None
        self.fim_ids = dict(info.fim_ids)
        self._special_names = [self.tok.id_to_token(i) for i in self.special_ids]
        self._plain: Tokenizer | None = None  # a copy that reads special-token names as text (encode_plain)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds the BOS / EOS the model asks for
        (add_bos / add_eos), a BOS only where the text does not already start with one."""
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            ids = self._with_bos(ids)
            if self.add_eos and self.eos_id is not None:
                ids = ids + [self.eos_id]
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` read as text only: a special token's name in it ("<|fim_suffix|>" in a
        source file) is its characters, never the token (llama.cpp's parse_special=false). No BOS/EOS."""
        if not any(n and n in text for n in self._special_names):
            return self.tok.encode(text, add_special_tokens=False).ids
        if self._plain is None:  # built on first need; a race only builds it twice
            plain = Tokenizer.from_str(self.tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain.encode(text, add_special_tokens=False).ids

    def encode_chat(self, text: str) -> list[int]:
        """Token ids of a rendered chat prompt. Its template writes the BOS where the model wants
        one; a GGUF model also gets add_bos's BOS in front when the template writes none (as
        llama.cpp does), never a second one. No EOS: the assistant's turn follows."""
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return self._with_bos(ids) if self.chat_adds_bos else ids

    def _with_bos(self, ids: list[int]) -> list[int]:
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            return [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens and self._skipped is not None:  # the rendered ones kept
            return self.tok.decode([i for i in ids if i not in self._skipped], skip_special_tokens=False)
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def fingerprint(self) -> tuple:
        """What two models must share for one to draft for the other."""
        vocab = self.tok.get_vocab(with_added_tokens=True)
        probe = "Hello, world! 12345 ünïcödé 你好 <|im_end|>"
        return (len(vocab), tuple(self.tok.encode(probe).ids), self.eos_id)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path, extra_eos_ids: set[int] | None = None) -> LLMTokenizer:
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
        try:
            tok = Tokenizer.from_file(str(tj))
        except Exception as e:
            raise ValueError(f"{tj}: cannot parse tokenizer ({e})") from None
        cfg = {}
        tc = path / "tokenizer_config.json"
        if tc.is_file():
            cfg = json.loads(tc.read_text(encoding="utf-8"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        source = "from tokenizer_config.json"
        jinja = path / "chat_template.jinja"
        if template is None and jinja.is_file():
            template, source = jinja.read_text(encoding="utf-8"), "from chat_template.jinja"
        # without the keys, what the tokenizer's post-processor adds (Llama-style ones add BOS)
        plain = tok.encode("a", add_special_tokens=False).ids
        full = tok.encode("a", add_special_tokens=True).ids
        add_bos, add_eos = cfg.get("add_bos_token"), cfg.get("add_eos_token")
        if add_bos is None:
            add_bos = full[:1] != plain[:1]
        if add_eos is None:
            add_eos = full[-1:] != plain[-1:]
        eot, rendered = _harmony(tok, set(extra_eos_ids or ()))
        info = TokenizerInfo(
            tok, _token_content(cfg.get("bos_token")), _token_content(cfg.get("eos_token")),
            bool(add_bos), template, eot, bool(add_eos), rendered=rendered)
        if template is not None:
            from .family_templates import template_family

            info.template_name, info.template_source = template_family(template), source
        return cls(info)

    @classmethod
    def from_gguf(cls, meta: dict, source: str = "GGUF file") -> LLMTokenizer:
        from .family_templates import gguf_chat_template

        kind = meta.get("tokenizer.ggml.model")
        if kind == "gpt2":
            info = _gguf_byte_level(meta)
        elif kind == "llama":
            info = _gguf_sentencepiece(meta)
        else:
            raise ValueError(f"{source}: tokenizer model {kind!r} is not supported "
                             "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)")
        choice = gguf_chat_template(meta)  # the file's own, else its family's
        info.chat_template, info.template_name, info.template_source = choice.template, choice.name, choice.why
        info.add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        info.chat_adds_bos = True
        from .fim import gguf_fim_ids

        info.fim_ids = gguf_fim_ids(meta)
        return cls(info)

    def save_hf(self, out: Path) -> None:
        """Write tokenizer.json + tokenizer_config.json (HF layout)."""
        self.tok.save(str(out / "tokenizer.json"))
        cfg = {
            "bos_token": self.bos_token, "eos_token": self.eos_token, "add_bos_token": self.add_bos,
            "add_eos_token": self.add_eos,
            "chat_template": self.chat_template, "model_max_length": 1 << 30,
            "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


# GGUF token types (llama.cpp's llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
# end-of-turn markers llama.cpp also recognises by name when a file has no eot_token_id
_EOT_NAMES = ("<end_of_turn>", "<|im_end|>", "<|end|>", "<|eot_id|>")


def _gguf_token_name(meta: dict, tokens: list[str], key: str) -> str | None:
    i = meta.get(key)
    return tokens[i] if i is not None and 0 <= i < len(tokens) else None


def _gguf_add_special_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control (3) and user-defined (4) tokens are matched whole in the raw text, before the model."""
    tok.add_tokens([AddedToken(tokens[i], special=(ty == _CONTROL), normalized=False)
                    for i, ty in enumerate(types) if ty in (_CONTROL, _USER_DEFINED)])


def _gguf_byte_level(meta: dict) -> TokenizerInfo:
    tokens = list(meta["tokenizer.ggml.tokens"])  # decoded once (the header keeps it undecoded)
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre in _PRE_SPLITS:
        split = pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in _DIGIT_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        if pre not in _GPT2_SPLITS:  # llama.cpp warns and does the same
            logging.getLogger("localllm").warning(
                "warning: tokenizer.ggml.pre %r is no pre-tokenizer we know: GPT-2's split is used, so the tokens "
                "may not be the ones the model was trained on", pre)
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    _gguf_add_special_tokens(tok, tokens, types)
    eot = {int(meta["tokenizer.ggml.eot_token_id"])} if "tokenizer.ggml.eot_token_id" in meta else set()
    eot, rendered = _harmony(tok, eot)
    return TokenizerInfo(
        tok, _gguf_token_name(meta, tokens, "tokenizer.ggml.bos_token_id"),
        _gguf_token_name(meta, tokens, "tokenizer.ggml.eos_token_id"),
        bool(meta.get("tokenizer.ggml.add_bos_token", pre in _BOS_BY_DEFAULT)), meta.get("tokenizer.chat_template"),
        eot, rendered=rendered,
    )


def _harmony(tok: Tokenizer, eot: set[int]) -> tuple[set[int], frozenset[str]]:
    """A harmony vocabulary's (gpt-oss's) end-of-generation ids added to `eot` (<|end|> taken out:
    a message ends there, not the reply) and the markup decode() writes out; as given otherwise."""
    if tok.token_to_id(HARMONY_EOG[0]) is None:
        return eot, frozenset()
    ids = {t: tok.token_to_id(t) for t in (*HARMONY_EOG, "<|end|>")}  # (the vocabulary's own lookup)
    return (eot | {ids[t] for t in HARMONY_EOG if ids[t] is not None}) - {ids["<|end|>"]}, frozenset(HARMONY_MARKUP)


def _spm_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's BPE encoding, which repeatedly joins the adjacent
    pair whose concatenation is the highest-scoring piece: every split of a normal piece into two
    normal pieces, ranked by the joined piece's score (ties: lower id first)."""
    ids = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == _NORMAL:
            ids.setdefault(t, i)
    ranked = [(-scores[i], i, piece, k) for piece, i in ids.items() if len(piece) > 1
              for k in range(1, len(piece)) if piece[:k] in ids and piece[k:] in ids]
    ranked.sort()
    return [(piece[:k], piece[k:]) for _, _, piece, k in ranked]


def _gguf_sentencepiece(meta: dict) -> TokenizerInfo:
    """llama.cpp's "llama" vocabulary: SentencePiece BPE with byte fallback, as a `tokenizers` BPE."""
    tokens = list(meta["tokenizer.ggml.tokens"])  # decoded once (the header keeps it undecoded)
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    # no scores: assume the file lists pieces best-first, as SentencePiece BPE models do
    scores = meta.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    unk = _gguf_token_name(meta, tokens, "tokenizer.ggml.unknown_token_id")
    if unk is None and "<unk>" in vocab:
        unk = "<unk>"
    # merges some converters also write are not read: llama.cpp ranks by score here too
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_spm_merges(tokens, types, scores), unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    # llama.cpp's default is True; Gemma files say False
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # A normalizer, not Metaspace: like llama.cpp, "▁" goes before every text fragment (also after
    # a special token) even when it already starts with a space
    norm = [normalizers.Replace(" ", "\u2581")]
    if prefix:
        norm.append(normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(norm)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:  # drop the space the prefix put at the start
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    _gguf_add_special_tokens(tok, tokens, types)
    if "tokenizer.ggml.eot_token_id" in meta:
        eot = {int(meta["tokenizer.ggml.eot_token_id"])}
    else:  # older converters mark no end-of-turn token: Gemma's <end_of_turn> ends a chat turn too
        eot = {i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == _CONTROL and t in _EOT_NAMES}
    return TokenizerInfo(
        tok, _gguf_token_name(meta, tokens, "tokenizer.ggml.bos_token_id"),
        _gguf_token_name(meta, tokens, "tokenizer.ggml.eos_token_id"),
        # llama.cpp adds BOS to a SentencePiece vocab that does not say otherwise
        bool(meta.get("tokenizer.ggml.add_bos_token", True)), meta.get("tokenizer.chat_template"), eot,
    )


def wordpiece_from_gguf(meta: dict) -> Tokenizer:
    """llama.cpp's "bert" vocabulary (WordPiece in phantom-space form: "▁" marks a word-initial
    piece, a continuation has none) as the `tokenizers` WordPiece BERT checkpoints ship, with
    [CLS] ... [SEP] added around each text (pairs: [CLS] a [SEP] b [SEP], token types 0 then 1)."""
    from tokenizers import processors

    tokens = list(meta["tokenizer.ggml.tokens"])  # decoded once (the header keeps it undecoded)
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    vocab: dict[str, int] = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        piece = t if ty == _CONTROL else t[1:] if t.startswith("\u2581") else "##" + t
        vocab.setdefault(piece, i)
    unk = _gguf_token_name(meta, tokens, "tokenizer.ggml.unknown_token_id") or "[UNK]"
    cls = _gguf_token_name(meta, tokens, "tokenizer.ggml.bos_token_id") or "[CLS]"
    sep = _gguf_token_name(meta, tokens, "tokenizer.ggml.seperator_token_id") or \
        _gguf_token_name(meta, tokens, "tokenizer.ggml.eos_token_id") or "[SEP]"
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    lower = bool(meta.get("tokenizer.ggml.normalizer.lowercase", True))  # llama.cpp lowercases by default
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=lower)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, tokens.index(cls)), (sep, tokens.index(sep))])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    return tok


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a small window of recent tokens and holds back text that ends in an incomplete
    UTF-8 sequence (U+FFFD), so a stream never shows broken characters and the joined deltas
    equal the full decode."""

    def __init__(self, tokenizer: LLMTokenizer, prompt_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-6:]) if prompt_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset:self.read_offset])
        text = dec(self.ids[self.prefix_offset:])
        if text.endswith("\ufffd") or len(text) <= len(prefix):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]

    def flush(self) -> str:
        """Whatever is held back at the end (e.g. a truly invalid byte sequence)."""
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix):] if len(text) > len(prefix) else ""
