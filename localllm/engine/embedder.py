"""Texts -> embeddings or relevance scores on a loaded encoder: tokenized (cut to the model's
maximum, or refused), packed many inputs per forward without padding, pooled, normalised.

Inputs are sorted by length and cut into forwards of at most `max_batch_tokens` tokens, so a
request of a thousand sentences neither runs one at a time nor builds one huge activation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.bert import Packed
from ..model.encoder_loader import LoadedEncoder
from ..model.pooling import pool, truncate

MAX_BATCH_TOKENS = 8192  # tokens per forward at most (activations: ~T * 4 * hidden * 4 bytes per layer)
# the widest activation of a forward (T x the MLP's width, fp32) at most: below glibc's 32 MiB
# ceiling for heap allocations (a bigger tensor is a fresh mmap, every page faulted in again on
# each use: 18 ms per 50 MB measured), and mostly inside the L3. all-MiniLM: 2048-token forwards,
# 1.15x the throughput of 8192 at batch 64 (BENCHMARKS.md)
ACTIVATION_BYTES = 12 << 20


def forward_tokens(hidden_size: int, intermediate_size: int, max_len: int) -> int:
    """Tokens per forward for a model of these widths: the widest activation within
    ACTIVATION_BYTES, a power of two between one full-length input and MAX_BATCH_TOKENS."""
    widest = max(intermediate_size, 3 * hidden_size) * 4
    n = MAX_BATCH_TOKENS
    while n > 256 and n * widest > ACTIVATION_BYTES:
        n //= 2
    return max(n, max_len)


class InputTooLong(ValueError):
    """An input longer than the model takes, where the request asked not to cut it."""

    def __init__(self, index: int, n: int, limit: int):
        super().__init__(f"input {index} is {n} tokens; the model takes at most {limit}")
        self.index, self.n, self.limit = index, n, limit


@dataclass
class Encoded:
    ids: list[list[int]]
    types: list[list[int]]

    @property
    def num_tokens(self) -> int:
        return sum(len(x) for x in self.ids)


class Embedder:
    def __init__(self, loaded: LoadedEncoder, max_batch_tokens: int | None = None):
        self.loaded = loaded
        self.model, self.tokenizer, self.kind = loaded.model, loaded.tokenizer, loaded.kind
        self.max_model_len = loaded.max_len
        cfg = loaded.config
        self.dimensions = cfg.hidden_size
        if max_batch_tokens is None:
            max_batch_tokens = forward_tokens(cfg.hidden_size, cfg.intermediate_size, loaded.max_len)
        self.max_batch_tokens = max(max_batch_tokens, loaded.max_len)
        # a second tokenizer that cuts pairs (the longer side first): no shared setting toggled per call
        self.pair_tokenizer = type(self.tokenizer).from_str(self.tokenizer.to_str())
        self.pair_tokenizer.enable_truncation(self.max_model_len, strategy="longest_first")
        # the tokenizer closes each input with a special token ([SEP], Qwen3-Embedding's EOS): a
        # cut keeps it; a chat model's input is cut at its end, as Ollama cuts it
        plain, full = (self.tokenizer.encode("a", add_special_tokens=b).ids for b in (False, True))
        self.keeps_last = full[-1:] != plain[-1:]

    # ---- tokenizing ------------------------------------------------------------------------------
    def tokenize(self, texts: list[str], truncate_inputs: bool = True, limit: int | None = None,
                 prompt_name: str | None = None) -> Encoded:
        """Each text with the model's special tokens ([CLS] ... [SEP]), cut to max_model_len (or
        the lower `limit`) when truncate_inputs, else refused with InputTooLong. prompt_name: one
        of the model's sentence-transformers prompts (Qwen3-Embedding's "query" instruction) put
        before each text, as sentence-transformers' encode(prompt_name=...); none named: the
        model's default prompt, if it has one."""
        name = prompt_name or self.loaded.default_prompt
        if name is not None and name not in self.loaded.prompts:
            known = ", ".join(self.loaded.prompts) or "none"
            raise ValueError(f"prompt_name {name!r} is not one of this model's prompts ({known})")
        prefix = self.loaded.prompts.get(name, "") if name else ""
        encs = self.tokenizer.encode_batch([prefix + t for t in texts] if prefix else texts)
        return self._fit([e.ids for e in encs], [e.type_ids for e in encs], truncate_inputs, limit)

    def tokenize_pairs(self, pairs: list[tuple[str, str]], truncate_inputs: bool = True) -> Encoded:
        """(query, document) pairs as a cross-encoder reads them: [CLS] q [SEP] d [SEP] with token
        types 0 then 1; too long: the longer side is cut first, as transformers' truncation=True.
        A decoder reranker: its prompt around the pair, the pair's tokens cut at the end."""
        pp = self.loaded.pair_prompt
        if pp is not None:
            room = self.max_model_len - len(pp.prefix) - len(pp.suffix)
            texts = [pp.template.format(instruction=pp.instruction, query=q, document=d) for q, d in pairs]
            ids = [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]
            for i, x in enumerate(ids):
                if len(x) > room and not truncate_inputs:
                    raise InputTooLong(i, len(x) + len(pp.prefix) + len(pp.suffix), self.max_model_len)
            ids = [pp.prefix + x[:room] + pp.suffix for x in ids]
            return Encoded(ids, [[0] * len(x) for x in ids])
        encs = (self.pair_tokenizer if truncate_inputs else self.tokenizer).encode_batch(pairs)
        return self._fit([e.ids for e in encs], [e.type_ids for e in encs], truncate_inputs)

    def _fit(self, ids: list[list[int]], types: list[list[int]], truncate_inputs: bool,
             limit: int | None = None) -> Encoded:
        limit = min(limit or self.max_model_len, self.max_model_len)
        for i, x in enumerate(ids):
            if len(x) > limit:
                if not truncate_inputs:
                    raise InputTooLong(i, len(x), limit)
                # keep the closing special token ([SEP]) as the tokenizer's own truncation does
                keep = 1 if self.keeps_last else 0
                ids[i] = x[:limit - keep] + x[len(x) - keep:]
                types[i] = types[i][:limit - keep] + types[i][len(x) - keep:]
        return Encoded(ids, types)

    def check_ids(self, ids: list[list[int]], truncate_inputs: bool = True, limit: int | None = None) -> Encoded:
        """Token ids given by the client: taken as they are (no special tokens added), checked
        against the vocabulary, cut or refused like text."""
        vocab = self.loaded.config.vocab_size
        for x in ids:
            bad = [t for t in x if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"token ids must be in 0..{vocab - 1}, got {bad[0]}")
        ids = [list(x) for x in ids]
        enc = Encoded(ids, [[0] * len(x) for x in ids])
        limit = min(limit or self.max_model_len, self.max_model_len)
        for i, x in enumerate(enc.ids):
            if len(x) > limit:
                if not truncate_inputs:
                    raise InputTooLong(i, len(x), limit)
                enc.ids[i], enc.types[i] = x[:limit], enc.types[i][:limit]
        return enc

    # ---- running ---------------------------------------------------------------------------------
    def batches(self, enc: Encoded) -> list[list[int]]:
        """Indices of the inputs per forward: sorted by length (equal lengths share an attention
        call), at most max_batch_tokens tokens each."""
        order = sorted(range(len(enc.ids)), key=lambda i: len(enc.ids[i]))
        out, cur, size = [], [], 0
        for i in order:
            n = len(enc.ids[i])
            if cur and size + n > self.max_batch_tokens:
                out.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += n
        if cur:
            out.append(cur)
        return out

    def _forward(self, enc: Encoded, idx: list[int]):
        lengths = [len(enc.ids[i]) for i in idx]
        dev = self.model.device
        ids = torch.tensor([t for i in idx for t in enc.ids[i]], dtype=torch.long, device=dev)
        packed = Packed.of(lengths, [t for i in idx for t in enc.types[i]], dev)
        return self.model(ids, packed), packed

    def embed(self, enc: Encoded, dimensions: int | None = None) -> torch.Tensor:
        """[N, dimensions or hidden] fp32 vectors in input order."""
        if any(len(x) == 0 for x in enc.ids):
            raise ValueError("an input has no tokens")
        out = torch.empty(len(enc.ids), self.dimensions)
        for idx in self.batches(enc):
            hidden, packed = self._forward(enc, idx)
            out[torch.tensor(idx)] = pool(hidden, packed.lengths, self.loaded.pooling).cpu()
        return truncate(out, dimensions)

    def score(self, enc: Encoded) -> torch.Tensor:
        """[N] relevance scores of encoded pairs: sigmoid of a one-label head's logit (0..1, as
        sentence-transformers' CrossEncoder and vLLM report them)."""
        if self.model.head is None:
            raise ValueError("this model is not a reranker (it has no classification head)")
        out = torch.empty(len(enc.ids))
        for idx in self.batches(enc):
            hidden, packed = self._forward(enc, idx)
            logits = self.model.classify(hidden, packed).float().cpu()
            out[torch.tensor(idx)] = torch.sigmoid(logits[:, 0]) if logits.shape[1] == 1 else \
                torch.softmax(logits, -1)[:, -1]
        return out
