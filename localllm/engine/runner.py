"""Turns a scheduled batch into tensors, runs the model, samples.

Prefill, chunked prefill, prefix-hit extend, decode and speculative verify all take this one
path: the new tokens of every sequence are concatenated and described by positions, slot
mapping, per-sequence query/context lengths and block tables.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from localllm_kernels import cpu_attention, kv_quant

from ..model.attention import AttnMeta, describe_batch
from ..model.llama import LlamaModel
from ..model.moe import compilable
from ..sampling import apply_logit_bias, apply_penalties, filter_probs, sample_row, top_logprobs
from ..structured import allowed, draft_masks
from .compiled_step import CompiledStep
from .cuda_graphs import DecodeGraphs
from .sequence import Sequence
from .speculative import accept_greedy, accept_sampling

RELEASE_MIN_BYTES = 64 << 20  # file-mapped tables whose pages greedy steps give back (see _release_pages)


class ModelRunner:
    def __init__(self, model: LlamaModel, block_size: int, num_blocks: int, kv_dtype: torch.dtype,
                 eos_ids: set[int], graph_batch: int = 0, max_blocks_per_seq: int = 0, compiled: bool = False,
                 background_build: bool = True, vision=None, image_cache_size: int = 32):
        """The captured step, when there is one: with graph_batch > 0 on the Triton backend, decode
        steps of up to that many sequences replay CUDA graphs (localllm.engine.cuda_graphs); with
        `compiled` on CPU, decode and verify steps run the AOTInductor package of the forward
        (localllm.engine.compiled_step), built in the background the first time (with
        `background_build`: else only loaded when there; a q8_0 cache (uint8 kv_dtype) runs eagerly:
        the compiled packages are built for 16/32-bit caches). vision: the model's VisionModel
        (localllm.model.vision); the embeddings of the last `image_cache_size` images are kept by
        image hash, so a chat that keeps an image in its history encodes it once."""
        self.model = model
        self.vision = vision
        self.image_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.image_cache_size = image_cache_size
        self.vision_encodes = 0  # images run through the vision tower
        self.eos_ids = sorted(eos_ids)
        self.block_size = block_size
        self.device = model.device
        self.kv_caches = model.new_kv_cache(num_blocks, block_size, kv_dtype)
        for k, v in self.kv_caches:  # the null block (see BlockManager)
            k[0].zero_()
            v[0].zero_()
        self.default_generator = torch.Generator().manual_seed(0)
        self._row_steps = 0  # steps since one read the whole head (see _release_pages)
        self._release = sum(t.numel() * t.element_size() for t in model.mapped) >= RELEASE_MIN_BYTES
        self.captured: DecodeGraphs | CompiledStep | None = None
        if not compilable(model):  # MoE experts looped in Python (not int4 on our CPU kernel): eager
            pass
        elif graph_batch and model.attention_backend == "triton":
            self.captured = DecodeGraphs(model, self.kv_caches, graph_batch, max_blocks_per_seq,
                                         capture=str(self.device).startswith("cuda"))
        elif (compiled and self.device == "cpu" and model.attention_backend == "torch" and cpu_attention.load()
              and not kv_quant.is_q8_0(kv_dtype)):
            # (without our paged-attention op, e.g. no C++ compiler, the forward cannot be exported)
            self.captured = CompiledStep(model, self.kv_caches, background=background_build)

    def busy(self, busy: bool) -> None:
        """The engine has work, or has none left (a background build runs only then)."""
        if self.captured is not None:
            self.captured.busy(busy)

    def prepare(self, seqs: list[Sequence], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttnMeta]:
        ids, ctx_lens, tables = [], [], []
        for seq, n in zip(seqs, counts):
            first = seq.num_computed_tokens
            ids.extend(seq.token_ids[first:first + n])
            ctx_lens.append(first + n)
            tables.append(seq.block_table)
        max_blocks = max(len(t) for t in tables)
        bt = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int64)
        dev = self.device
        positions, meta = describe_batch(bt, list(counts), ctx_lens, self.block_size, self.model.attention_backend, dev)
        self.model.cover(max(ctx_lens))  # (M-RoPE positions stay below the token's index)
        if getattr(self.vision, "mrope", False) and any(s.images for s in seqs):
            positions = self._mrope_positions(seqs, counts).to(dev)
        return torch.tensor(ids, dtype=torch.int64, device=dev), positions, meta

    def _mrope_positions(self, seqs: list[Sequence], counts: list[int]) -> torch.Tensor:
        """Qwen-VL's rotary positions (M-RoPE) of the batch's new tokens: from the vision model
        for a sequence with images (the tokens after an image sit at their index plus its delta,
        its own tokens at (frame, row, column) offsets), the index otherwise. [3, T] when a chunk
        holds image tokens, else [T] (the plain RoPE path: decode steps stay captured)."""
        parts = [self.vision.positions(s.images, s.num_computed_tokens, n) if s.images
                 else torch.arange(s.num_computed_tokens, s.num_computed_tokens + n) for s, n in zip(seqs, counts)]
        if all(p.dim() == 1 for p in parts):
            return torch.cat(parts)
        return torch.cat([p.expand(3, -1) if p.dim() == 1 else p for p in parts], dim=-1)

    def inputs(self, seqs: list[Sequence], counts: list[int]) -> tuple:
        """prepare's (ids, positions, meta) and the image embeddings of the chunk (or None)."""
        ids, positions, meta = self.prepare(seqs, counts)
        embeds = self._image_rows(seqs, counts, meta) if any(s.images for s in seqs) else None
        return ids, positions, meta, embeds

    def image_embeddings(self, spans: list) -> dict[str, torch.Tensor]:
        """Embeddings [n_tokens, hidden] by image hash: from the cache, the missing ones encoded in
        one batch (one vision forward across every request of the step)."""
        todo = list({im.hash: im for im in spans if im.hash not in self.image_cache}.values())
        if todo:
            for im, e in zip(todo, self.vision.encode([im.pixels for im in todo])):
                self.image_cache[im.hash] = e
            self.vision_encodes += len(todo)
        out = {}
        for im in spans:
            self.image_cache.move_to_end(im.hash)
            out[im.hash] = self.image_cache[im.hash]
        while len(self.image_cache) > max(self.image_cache_size, len(out)):
            self.image_cache.popitem(last=False)
        return out

    def _image_rows(self, seqs: list[Sequence], counts: list[int], meta: AttnMeta
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The batch rows that are image tokens and their embeddings; the images' spans into
        `meta` for a model whose image tokens attend bidirectionally."""
        if self.vision is None:
            raise ValueError("this model takes no images")
        found = [(b, seq, n, im) for b, (seq, n) in enumerate(zip(seqs, counts))
                 for im in seq.images_in(seq.num_computed_tokens, seq.num_computed_tokens + n)]
        if not found:
            return None
        embeds = self.image_embeddings([im for *_, im in found])
        starts = [0, *torch.tensor(counts).cumsum(0).tolist()]
        rows, values, spans = [], [], {}
        tok = self.vision.image_token_id
        for b, seq, n, im in found:
            first = seq.num_computed_tokens
            where = [im.offset + j for j, t in enumerate(seq.token_ids[im.offset:im.end]) if t == tok]
            picked = [r for r, p in enumerate(where) if first <= p < first + n]  # rows in this chunk
            rows.extend(starts[b] + where[r] - first for r in picked)
            values.append(embeds[im.hash][picked])
            spans.setdefault(b, []).append((im.offset, im.end))
        if getattr(self.vision, "bidirectional", False):
            meta.spans = spans
        dev = self.device
        return torch.tensor(rows, dtype=torch.int64, device=dev), torch.cat(values).to(dev)

    @torch.inference_mode()
    def forward_hidden(self, seqs: list[Sequence], counts: list[int]) -> torch.Tensor:
        return self._forward(*self.inputs(seqs, counts))

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttnMeta,
                 embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Hidden states of the new tokens. A captured step (CUDA graphs, or the compiled CPU
        step) serves the steps it covers (never one with images: the eager forward takes those)."""
        if embeds is not None or meta.spans:
            return self.model(ids, positions, meta, self.kv_caches, embeds=embeds)
        if self.captured is not None:
            hidden = self.captured.run(ids, positions, meta)
            if hidden is not None:
                return hidden
        return self.model(ids, positions, meta, self.kv_caches)

    @torch.inference_mode()
    def sample(self, hidden: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One new token per row of `hidden` (the last position of each sequence)."""
        head = self.model.head
        if not any(s.params.needs_logits for s in seqs):
            if all(s.matcher is None for s in seqs):
                return head.greedy(hidden).tolist()
            # greedy under a constraint: the int4 ranking and exact rescoring among allowed tokens
            # (the full exact head cost greedy JSON 18% of its speed)
            V = head.exact.shape[0]
            every = torch.ones(V, dtype=torch.bool)
            mask = torch.stack([every if s.matcher is None else allowed(s.matcher, V) for s in seqs])
            return head.greedy(hidden, mask.to(hidden.device)).tolist()
        # sampling runs on CPU with the request's CPU generator: same seed, same draws on any device
        logits = head(hidden).cpu()
        out = []
        for row, seq in zip(logits, seqs):
            p = seq.params
            if seq.matcher is not None:  # before penalties and temperature: what may come next at all
                row = row.masked_fill(~allowed(seq.matcher, row.shape[-1]), float("-inf"))
            row = apply_logit_bias(row, p)
            if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
                row = apply_penalties(row.clone(), p, seq.prompt_ids, seq.output_ids)
            if p.min_tokens and seq.num_output_tokens < p.min_tokens:
                row = row.clone()
                row[self.eos_ids] = float("-inf")
            tok = sample_row(row, p, seq.generator or self.default_generator)
            if p.logprobs is not None:
                seq.logprobs.append(top_logprobs(row, tok, p.logprobs))
            out.append(tok)
        return out

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], counts: list[int], verify: dict | None = None) -> list[list[int] | None]:
        """Run one flattened batch. Returns, per sequence, the tokens to append: one sampled
        token when its pending tokens were all computed, the verified run for a speculative
        sequence (`verify[seq]` is its Proposal), None for a prompt chunk still prefilling."""
        hidden = self._forward(*self.inputs(seqs, counts))
        out: list[list[int] | None] = [None] * len(seqs)
        last, who = [], []
        end = 0
        for i, (seq, n) in enumerate(zip(seqs, counts)):
            end += n
            if verify and seq in verify:
                out[i] = self._verify(hidden[end - n:end], seq, verify[seq])
            elif seq.num_computed_tokens + n >= seq.num_tokens:
                last.append(end - 1)
                who.append(i)
        if who:
            toks = self.sample(hidden[last], [seqs[i] for i in who])
            for i, t in zip(who, toks):
                out[i] = [t]
        self._release_pages(seqs)
        return out

    def _release_pages(self, seqs: list[Sequence]) -> None:
        """Every 8th step that read only rows of the file-mapped tables (prompt chunks, greedy
        tokens), their pages go back (LlamaModel.release_mapped_pages, ~20 us): resident rows stay
        bounded by a few steps' worth. Not free: each row read after it faults its page in again
        (~10 us a row with the 16 pages the kernel maps around it; a 1B shape's greedy head call
        1.41 -> 1.74 ms right after a release), so tables under RELEASE_MIN_BYTES stay (the
        embedded model's 29 MB one: greedy decode 5% slower with it). A step computing exact
        logits reads the whole head, so while sampled requests run the pages stay."""
        if not self._release:
            return
        if any(s.params.needs_logits for s in seqs):
            self._row_steps = 0
            return
        self._row_steps += 1
        if self._row_steps % 8 == 0:
            self.model.release_mapped_pages()

    def _verify(self, rows: torch.Tensor, seq: Sequence, proposal) -> list[int]:
        head = self.model.head
        params = seq.params
        masks = None if seq.matcher is None else draft_masks(seq.matcher, proposal.tokens, head.exact.shape[0])
        if params.greedy and not params.logit_bias:
            return accept_greedy(proposal.tokens,
                                 head.greedy(rows, None if masks is None else masks.to(rows.device)).tolist())
        logits = torch.stack([apply_logit_bias(r, params) for r in head(rows).cpu()])  # a fixed shift: drafts stay valid
        if masks is not None:
            logits = logits.masked_fill(~masks, float("-inf"))
        if params.greedy:
            return accept_greedy(proposal.tokens, logits.argmax(-1).tolist())
        p = torch.stack([filter_probs(r, params) for r in logits])
        return accept_sampling(proposal.tokens, p, proposal.q, seq.generator or self.default_generator)
