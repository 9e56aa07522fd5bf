"""The chat template of a GGUF file: its own, or, when it carries none, its family's.

Many published GGUF conversions have no `tokenizer.chat_template`. ChatML is right only for the
models trained on it; a Gemma or Llama 3 model prompted with it answers garbage. So a file
without a template gets the template its family was published with, picked from the
architecture and, where one architecture covers several families ("llama": Llama 2, Llama 3,
Mistral, SmolLM), from the vocabulary's own special tokens, as llama.cpp tells them apart.

The templates are the publishers' strings, shipped as package data (localllm/templates/):
  gemma         google/gemma-2-2b-it (the same as gemma-7b-it: Gemma 1 and 2)
  gemma3        google/gemma-3-1b-it (and 270m-it, 4b-it, ...)
  llama2        meta-llama/Llama-2-7b-chat-hf
  llama3        meta-llama/Meta-Llama-3-8B-Instruct
  llama3.1      meta-llama/Llama-3.1-8B-Instruct (3.3-70B-Instruct ships the same)
  llama3.2      meta-llama/Llama-3.2-3B-Instruct
  mistral-v0.1  mistralai/Mistral-7B-Instruct-v0.1
  mistral-v0.3  mistralai/Mistral-7B-Instruct-v0.3
  qwen2.5       Qwen/Qwen2.5-7B-Instruct
  qwen3         Qwen/Qwen3-0.6B (reasoning: <think>, enable_thinking)
  phi3          microsoft/Phi-3-mini-4k-instruct
  phi4-mini     microsoft/Phi-4-mini-instruct
  phi4          microsoft/phi-4
  gpt-oss       openai/gpt-oss-20b (harmony: channels, reasoning effort, tool calls; -120b ships the same)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from .chat import DEFAULT_TEMPLATE


@dataclass(frozen=True)
class TemplateChoice:
    name: str  # the family's short name ("gemma3", "chatml", ...)
    template: str
    why: str  # where it comes from, for `localllm show`


@cache
def builtin_template(name: str) -> str:
    """One of the shipped templates by its short name."""
    try:
        return resources.files("localllm").joinpath("templates", f"{name}.jinja").read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"no built-in chat template named {name!r}") from None


def template_family(template: str | None) -> str:
    """A short name for a template by the turn markers it writes."""
    if not template:
        return "chatml"
    for mark, name in (("<|channel|>", "gpt-oss"), ("<|im_sep|>", "phi4"), ("<|im_start|>", "chatml"), ("<|start_header_id|>", "llama3"),
                       ("[INST]", "mistral/llama2"), ("<start_of_turn>", "gemma"), ("<|user|>", "phi3")):
        if mark in template:
            return name
    return "custom"


def gguf_chat_template(meta: dict) -> TemplateChoice:
    """The file's own template, else its family's, else ChatML (saying why)."""
    own = meta.get("tokenizer.chat_template")
    if own:
        return TemplateChoice(template_family(own), own, "from the file")
    arch = meta.get("general.architecture", "unknown")
    picked = _family(meta, arch)
    if picked is None:
        return TemplateChoice("chatml", DEFAULT_TEMPLATE, f"built-in default: the file has no chat template and "
                                                          f"architecture {arch} with this vocabulary is no family we know")
    name, evidence = picked
    template = DEFAULT_TEMPLATE if name == "chatml" else builtin_template(name)
    return TemplateChoice(name, template, f"built-in, file has no chat template; {evidence}")


def _family(meta: dict, arch: str) -> tuple[str, str] | None:
    """(template name, the evidence) for a file without a template."""
    tokens = meta.get("tokenizer.ggml.tokens") or ()  # searched in place: no vocabulary-sized set
    kind = meta.get("tokenizer.ggml.model")
    on_arch = f"architecture {arch}"
    if arch in ("gemma3", "gemma3n"):
        return "gemma3", on_arch
    if arch in ("gemma", "gemma2"):
        return "gemma", on_arch
    if arch == "gpt-oss":
        return "gpt-oss", on_arch
    if arch in ("qwen3", "qwen3moe"):
        return "qwen3", on_arch
    if arch in ("qwen2", "qwen2moe"):
        return "qwen2.5", on_arch
    if arch == "phi3":  # Phi-3 has a SentencePiece vocabulary, Phi-4 and Phi-4-mini byte-level ones
        if kind == "llama":
            return "phi3", f"{on_arch}, SentencePiece vocabulary"
        if "<|im_sep|>" in tokens:
            return "phi4", f"{on_arch}, vocabulary has <|im_sep|>"
        return "phi4-mini", f"{on_arch}, byte-level vocabulary without <|im_sep|>"
    if arch in ("llama", "mistral"):
        if "<|start_header_id|>" in tokens and "<|eot_id|>" in tokens:
            if "<|eom_id|>" not in tokens:  # Llama 3.1 named a reserved token <|eom_id|> (tool calls)
                return "llama3", f"{on_arch}, vocabulary has <|start_header_id|> and no <|eom_id|> (Llama 3.0)"
            if re.search(r"\b3\.2\b", _names(meta)):
                return "llama3.2", f"{on_arch}, Llama 3 vocabulary, named 3.2"
            return "llama3.1", f"{on_arch}, vocabulary has <|start_header_id|> and <|eom_id|> (Llama 3.1+)"
        if "[INST]" in tokens:  # Mistral's v3 tokenizer made the instruction markers tokens
            return "mistral-v0.3", f"{on_arch}, vocabulary has [INST]"
        if re.search(r"\bmixtral|\bmistral", _names(meta)):
            return "mistral-v0.1", f"{on_arch}, named Mistral, vocabulary without [INST]"
        if re.search(r"\bllama[- ]?2\b", _names(meta)):
            return "llama2", f"{on_arch}, named Llama 2"
    if "<|im_start|>" in tokens and "<|im_end|>" in tokens:  # SmolLM, Hermes, ...: trained on ChatML
        return "chatml", f"{on_arch}, vocabulary has <|im_start|> and <|im_end|>"
    return None


def _names(meta: dict) -> str:
    return " ".join(str(meta.get(f"general.{k}") or "") for k in ("name", "basename", "finetune", "version")).lower()
