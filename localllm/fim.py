"""Fill-in-the-middle: which FIM format a model was trained with (from its tokenizer's special tokens
or a GGUF's tokenizer.ggml.fim_*_token_id keys) and the prompt token ids for a prefix and a suffix.

Front ends (the server's /v1/completions `suffix`, Ollama's /api/generate `suffix`, llama.cpp's
/infill; the CLI could too) build a FimRequest and call `render`: the FIM tokens go in as ids, the
texts are tokenized on their own, as llama.cpp's format_infill does, so a file that happens to
contain "<|fim_suffix|>" cannot move the hole (each text is encoded without parsing special tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class FimError(ValueError):
    """The model cannot fill in the middle (its tokenizer has no FIM tokens)."""


@dataclass(frozen=True)
class _Family:
    name: str
    prefix: tuple[str, ...]  # token names, first found wins
    suffix: tuple[str, ...]
    middle: tuple[str, ...]  # () : the format has no middle token (Codestral: the middle follows the prefix)
    suffix_first: bool = False  # SPM order: suffix, then prefix
    bare_suffix: bool = False  # SentencePiece: the suffix without the dummy-prefix space (Meta's, Mistral's)
    pad: tuple[str, ...] = ()
    repo: tuple[str, ...] = ()
    file_sep: tuple[str, ...] = ()
    eot: tuple[str, ...] = ()


# the published formats, as llama.cpp's vocabulary loader recognises their tokens by name
FAMILIES = (
    _Family("qwen", ("<|fim_prefix|>",), ("<|fim_suffix|>",), ("<|fim_middle|>",),
            pad=("<|fim_pad|>",), repo=("<|repo_name|>",), file_sep=("<|file_sep|>",)),
    _Family("starcoder", ("<fim_prefix>",), ("<fim_suffix>",), ("<fim_middle>",),
            pad=("<fim_pad>",), repo=("<repo_name>", "<reponame>"), file_sep=("<file_sep>", "<filename>")),
    _Family("santacoder", ("<fim-prefix>",), ("<fim-suffix>",), ("<fim-middle>",), pad=("<fim-pad>",),
            repo=("<fim-repo>",), file_sep=("<fim-sep>",)),
    _Family("deepseek", ("<｜fim▁begin｜>",), ("<｜fim▁hole｜>",), ("<｜fim▁end｜>",)),
    # CodeLlama: "<PRE> {prefix} <SUF>{suffix} <MID>" (the tokens carry the space before them)
    _Family("codellama", ("▁<PRE>", "<PRE>"), ("▁<SUF>", "<SUF>"), ("▁<MID>", "<MID>"), bare_suffix=True,
            eot=("▁<EOT>", "<EOT>")),
    # Codestral (mistral-common's encode_fim): [BOS][SUFFIX]suffix[PREFIX]prefix, the middle follows
    _Family("codestral", ("[PREFIX]",), ("[SUFFIX]",), (), suffix_first=True, bare_suffix=True),
)

# GGUF keys (llama.cpp's LLM_KV_TOKENIZER_FIM_*), with the older names some converters wrote
GGUF_KEYS = {"prefix": ("fim_pre", "prefix"), "suffix": ("fim_suf", "suffix"), "middle": ("fim_mid", "middle"),
             "pad": ("fim_pad",), "repo": ("fim_rep",), "file_sep": ("fim_sep",)}


def gguf_fim_ids(meta: dict) -> dict[str, int]:
    """The FIM token ids a GGUF's metadata declares: {"prefix", "suffix", "middle", "pad", "repo", "file_sep"}."""
    out = {}
    for role, names in GGUF_KEYS.items():
        for n in names:
            v = meta.get(f"tokenizer.ggml.{n}_token_id")
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                out[role] = v
                break
    return out


@dataclass(frozen=True)
class FimFormat:
    name: str  # a FAMILIES name, or "generic" (ids from a GGUF whose token names we do not know)
    prefix_id: int
    suffix_id: int
    middle_id: int | None
    suffix_first: bool = False
    bare_suffix: bool = False
    pad_id: int | None = None
    repo_id: int | None = None
    file_sep_id: int | None = None
    eot_id: int | None = None
    source: str = "tokenizer special tokens"

    def stop_ids(self) -> list[int]:
        """Tokens that end an infill besides EOS: llama.cpp counts FIM pad/repo/sep (and CodeLlama's
        <EOT>) as end of generation; after them a model starts another file."""
        return [i for i in (self.pad_id, self.repo_id, self.file_sep_id, self.eot_id) if i is not None]


def _find(tok, names: tuple[str, ...]) -> int | None:
    for n in names:
        i = tok.token_to_id(n)
        if i is not None:
            return i
    return None


def detect(tokenizer: Any) -> FimFormat | None:
    """The FIM format of an LLMTokenizer: the GGUF's declared ids first, else the token names of the
    published formats (FAMILIES). None: the model has no FIM tokens."""
    tok = tokenizer.tok
    vocab = tok.get_vocab_size(with_added_tokens=True)
    declared = {k: v for k, v in (getattr(tokenizer, "fim_ids", None) or {}).items() if 0 <= v < vocab}
    if "prefix" in declared and "suffix" in declared:
        fmt = _declared(tok, declared)
        if fmt is not None:
            return fmt
    for fam in FAMILIES:
        pre, suf = _find(tok, fam.prefix), _find(tok, fam.suffix)
        mid = _find(tok, fam.middle) if fam.middle else None
        if pre is None or suf is None or (fam.middle and mid is None):
            continue
        return FimFormat(fam.name, pre, suf, mid, fam.suffix_first, fam.bare_suffix,
                         declared.get("pad", _find(tok, fam.pad)), declared.get("repo", _find(tok, fam.repo)),
                         declared.get("file_sep", _find(tok, fam.file_sep)), _find(tok, fam.eot))
    return None


def _declared(tok, ids: dict[str, int]) -> FimFormat | None:
    """The format of a GGUF's declared FIM ids; the family (order, spacing) from the prefix token's
    name, "generic" PSM when no family uses that name."""
    name = tok.id_to_token(ids["prefix"])
    fam = next((f for f in FAMILIES if name in f.prefix), None)
    if fam is None:
        fam = _Family("generic", (), (), ("?",))
    middle = ids.get("middle") if fam.middle else None
    if fam.middle and middle is None:
        return None  # a prefix-suffix-middle format without its middle token
    return FimFormat(fam.name, ids["prefix"], ids["suffix"], middle, fam.suffix_first, fam.bare_suffix,
                     ids.get("pad", _find(tok, fam.pad)), ids.get("repo", _find(tok, fam.repo)),
                     ids.get("file_sep", _find(tok, fam.file_sep)), _find(tok, fam.eot),
                     source="GGUF tokenizer.ggml.fim_*_token_id")


@dataclass
class FimRequest:
    """What to fill: the text before the cursor (`prefix`, then `prompt`, tokenized separately as
    llama.cpp's /infill does) and after it (`suffix`). `extra`: other files [{filename, text}] put
    before it in the repository-level format; `repo_level`: write that format's header even without
    extra files (llama.cpp's /infill does whenever the model has the tokens)."""

    prefix: str
    suffix: str
    prompt: str = ""
    extra: list[dict] = field(default_factory=list)
    repo_level: bool = False
    max_prompt_tokens: int | None = None  # extra context is cut from its start to fit (never prefix/suffix)


_SNIPPET = "\n\n--- snippet ---\n\n"  # llama.cpp's separator of extra chunks for models without <file_sep>
REPO_NAME, FILE_NAME = "myproject", "filename"  # the placeholders llama.cpp writes


def _encode(tokenizer: Any, text: str) -> list[int]:
    """`text` as plain text: special-token names inside it are text (llama.cpp's parse_special=false)."""
    return tokenizer.encode_plain(text) if text else []


_MARK = "\u263a"  # mistral-common's and Meta's marker: encoded in front of a text, then dropped


def _bare(tokenizer: Any, text: str) -> list[int]:
    """`text` without the space a SentencePiece tokenizer puts in front of every text (CodeLlama's
    and Codestral's suffix): encoded after a marker whose own tokens are then dropped."""
    if not text:
        return []
    mark = tokenizer.encode_plain(_MARK)
    ids = tokenizer.encode_plain(_MARK + text)
    if ids[:len(mark)] == mark:
        return ids[len(mark):]
    return tokenizer.encode_plain(text)


def render(tokenizer: Any, fmt: FimFormat, req: FimRequest) -> list[int]:
    """Prompt token ids for `req` in `fmt`:
    PSM  [BOS] [extra] PRE prefix+prompt SUF suffix MID
    SPM  [BOS] [extra] SUF suffix PRE prefix+prompt        (Codestral: no middle token)
    extra, with the repository tokens: REPO "myproject\\n" (SEP filename "\\n" text)... SEP "filename\\n";
    without them each file follows "\\n\\n--- snippet ---\\n\\n" (llama.cpp's layout). The BOS the
    tokenizer asks for goes first: llama.cpp's format_infill puts the extra files before it, which no
    model was trained on."""
    def enc(text: str) -> list[int]:
        return _encode(tokenizer, text)
    before = enc(req.prefix) + enc(req.prompt)
    after = _bare(tokenizer, req.suffix) if fmt.bare_suffix else enc(req.suffix)
    if fmt.suffix_first:
        core = [fmt.suffix_id, *after, fmt.prefix_id, *before]
    else:
        core = [fmt.prefix_id, *before, fmt.suffix_id, *after]
    if fmt.middle_id is not None:
        core.append(fmt.middle_id)
    extra: list[int] = []
    repo = fmt.repo_id is not None and fmt.file_sep_id is not None
    if repo and (req.extra or req.repo_level):
        extra = [fmt.repo_id, *enc(REPO_NAME + "\n")]
    for chunk in req.extra:
        if repo:
            extra += [fmt.file_sep_id, *enc((chunk.get("filename") or "tmp") + "\n")]
        else:
            extra += enc(_SNIPPET)
        extra += enc(chunk.get("text") or "")
    if repo and (req.extra or req.repo_level):
        extra += [fmt.file_sep_id, *enc(FILE_NAME + "\n")]
    bos = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    if fmt.name == "codestral" and tokenizer.bos_id is not None:
        bos = [tokenizer.bos_id]  # mistral-common always writes it
    if req.max_prompt_tokens is not None:
        room = max(0, req.max_prompt_tokens - len(bos) - len(core))
        extra = extra[len(extra) - room:] if len(extra) > room else extra
    return bos + extra + core
