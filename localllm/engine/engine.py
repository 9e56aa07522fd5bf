"""LLMEngine: the one door. add_request / step / abort, and a streaming generate on top."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..config import EngineConfig, kv_blocks, kv_tokens
from ..hardware import available_memory
from ..model.attention import kv_cache_dtype, kv_value_bytes
from ..model.handle import ModelHandle
from ..model.vision import ImageInputError, ImagePrompt, has_images, image_spans
from ..sampling import SamplingParams
from ..structured import Grammars
from ..tokenizer import IncrementalDetokenizer
from .block_manager import BlockManager
from .runner import ModelRunner
from .scheduler import Scheduler
from .sequence import SeqStatus, Sequence
from .speculative import AdaptiveK, DraftProposer, NgramProposer, SpecStats, spec_eligible

log = logging.getLogger(__name__)


class ContextLengthError(ValueError):
    """A prompt (plus the tokens asked for) does not fit the context."""

    def __init__(self, message: str, prompt_tokens: int, limit: int):
        super().__init__(message)
        self.prompt_tokens, self.limit = prompt_tokens, limit


@dataclass
class RequestOutput:
    request_id: str
    delta: str
    text: str
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: list[dict] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # finish_reason "error": why (a constraint's matcher failed mid-way)


class _Output:
    """Per-request text state: incremental detokenizing and stop strings held back until they
    can no longer match."""

    def __init__(self, detok: IncrementalDetokenizer, stop: list[str]):
        self.detok, self.stop = detok, stop
        self.text = ""  # everything decoded (may include held-back text)
        self.emitted = 0
        self.stopped = False

    def add(self, token_ids: list[int], final: bool) -> str:
        if token_ids:
            self.text += self.detok.add(token_ids)
        if final:
            self.text += self.detok.flush()
        if self.stop:
            start = max(0, self.emitted - max(len(s) for s in self.stop))
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[:min(hits)], True
                final = True
        end = len(self.text) if final else len(self.text) - self._held()
        delta = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return delta

    def _held(self) -> int:
        """Length of the longest tail that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    @property
    def visible(self) -> str:
        return self.text[:self.emitted]


def _matcher_error(matcher) -> str:
    from ..structured import _message

    return "the output could not be held to the constraint: " + _message(matcher.get_error())


class LLMEngine:
    def __init__(self, loaded: ModelHandle, config: EngineConfig | None = None, draft: ModelHandle | None = None):
        self.loaded = loaded
        config = config or EngineConfig()
        # before the runner (compiled packages are keyed by the layers), and every time: a model an
        # earlier engine set to 8 bits comes back to the default with a default config
        loaded.model.use_act_bits(config.act_bits)
        was, now = ("16", "8") if config.act_bits == 8 else ("8", "16")
        loaded.precision = loaded.precision.replace(f"{was}-bit matmul inputs", f"{now}-bit matmul inputs")
        if config.act_bits != 16 and loaded.model.device == "cpu":  # (the background builder builds the 16-bit step)
            config = replace(config, compile=False)
        if config.max_num_batched_tokens is None:
            config = replace(config, max_num_batched_tokens=512 if loaded.model.device == "cpu" else 2048)
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.max_model_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.kv_dtype = self._kv_dtype(loaded)
        self.num_blocks = config.num_kv_blocks or self._blocks_from_memory()
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.runner = ModelRunner(loaded.model, config.block_size, self.num_blocks, self.kv_dtype,
                                  loaded.eos_ids, *self._graph_shape(), compiled=config.compile,
                                  background_build=config.background_build, vision=loaded.vision)
        self.vision = loaded.vision
        self.eos_ids = loaded.eos_ids
        # matchers for constrained requests (llguidance), over the head's whole vocabulary
        self.grammars = Grammars(self.tokenizer.tok.to_str, self.model_config.vocab_size, sorted(self.eos_ids))
        self.proposer = self._make_proposer(draft)
        self._runners = [self.runner] + ([self.proposer.runner] if isinstance(self.proposer, DraftProposer) else [])
        self.adaptive = AdaptiveK(config.num_speculative_tokens)
        self.spec_stats = SpecStats()
        self._seqs: dict[str, Sequence] = {}
        self._outputs: dict[str, _Output] = {}
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self.stats = {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0,
                      "steps": 0, "max_batch_size": 0, "preemptions": 0}

    # ---- sizing ---------------------------------------------------------------------------
    def _kv_dtype(self, loaded: ModelHandle) -> torch.dtype:
        """The cache dtype of `loaded` under config.kv_type (auto: the loader's choice)."""
        return kv_cache_dtype(self.config.kv_type, loaded.kv_dtype)

    def _blocks_from_memory(self) -> int:
        """KV blocks for `parallel` full-length contexts, within the memory left after the weights
        (already loaded) and the peak activations of the largest step; `kv_memory_bytes`
        overrides the computation."""
        cfg, c = self.config, self.model_config
        per_block = c.kv_bytes_per_token(kv_value_bytes(self.kv_dtype)) * cfg.block_size
        device = self.loaded.model.device
        if cfg.kv_memory_bytes:
            blocks = cfg.kv_memory_bytes // per_block
        else:
            free = available_memory(device) - self._activation_peak()
            # CPU: RAM is shared with everything else the user runs, so take at most a quarter of it
            share = cfg.memory_utilization if device != "cpu" else 0.25
            blocks = min(int(free * share) // per_block,
                         kv_blocks(self.max_model_len, cfg.block_size, max(1, cfg.parallel)))
        min_blocks = kv_blocks(self.max_model_len, cfg.block_size)
        if blocks < min_blocks:
            if cfg.kv_memory_bytes:
                raise ValueError(f"--kv-memory {cfg.kv_memory_bytes / 2**30:.2f} GiB holds "
                                 f"{kv_tokens(blocks, cfg.block_size)} tokens, less than one "
                                 f"{self.max_model_len}-token context; raise it or lower --ctx")
            blocks = min_blocks  # one full-length sequence must always fit
        return int(blocks)

    def _activation_peak(self) -> int:
        """Bytes the largest step needs besides weights and KV. Measured on a GPU by a dry run;
        estimated on CPU (fp32 hidden, qkv, MLP and attention buffers for the token budget)."""
        c, T = self.model_config, self.config.max_num_batched_tokens
        per_token = 4 * (4 * c.hidden_size + 2 * c.intermediate_size
                         + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim)
        estimate = T * per_token + self.config.max_num_seqs * c.vocab_size * 4
        if self.loaded.model.device == "cpu":
            return estimate
        return max(estimate, self._measure_activation_peak())

    def _measure_activation_peak(self) -> int:
        from ..model.attention import describe_batch

        model, T, bs = self.loaded.model, self.config.max_num_batched_tokens, self.config.block_size
        dev = torch.device(model.device)
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        nblocks = -(-T // bs) + 1
        caches = model.new_kv_cache(nblocks, bs, self.kv_dtype)
        positions, meta = describe_batch(torch.arange(1, nblocks).view(1, -1), [T], [T], bs, model.attention_backend, dev)
        hidden = model(torch.zeros(T, dtype=torch.long, device=dev), positions, meta, caches)
        model.logits(hidden[-self.config.max_num_seqs:])
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del caches, hidden
        torch.cuda.empty_cache()
        return int(peak)

    def _graph_shape(self) -> tuple[int, int]:
        """(largest decode batch to capture, block-table width) for CUDA graphs; (0, 0) = off."""
        cfg = self.config
        if not cfg.compile:
            return 0, 0
        # a sequence's table may run num_speculative_tokens + 1 past the context for lookahead
        width = -(-(self.max_model_len + cfg.num_speculative_tokens + 1) // cfg.block_size)
        return min(cfg.max_num_seqs, cfg.max_graph_batch), width

    def _make_proposer(self, draft: ModelHandle | None):
        spec = self.config.speculative
        if draft is not None:
            if draft.tokenizer.fingerprint() != self.tokenizer.fingerprint():
                raise ValueError(f"draft model {draft.name or draft.source} does not share the target's "
                                 "tokenizer (vocabulary or token ids differ); pick a draft from the same family")
            bm = BlockManager(self.num_blocks, self.config.block_size, enable_prefix_caching=False)
            runner = ModelRunner(draft.model, self.config.block_size, self.num_blocks, self._kv_dtype(draft), draft.eos_ids,
                                 *self._graph_shape(), compiled=self.config.compile,
                                 background_build=self.config.background_build)
            return DraftProposer(runner, bm)
        if spec == "ngram":
            return NgramProposer()
        if spec:
            raise ValueError(f"speculative={spec!r} needs a loaded draft model (or use 'ngram')")
        return None

    # ---- requests -------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int] | list[dict] | ImagePrompt, **template_kwargs
                      ) -> list[int] | ImagePrompt:
        """A string, token ids, or chat messages -> prompt token ids. `template_kwargs` reach the
        chat template (e.g. enable_thinking=False for Qwen3). Messages with image parts
        ({"type": "image", "image": PIL image}) -> an ImagePrompt (ids and the images' spans)."""
        from ..chat import encode_prompt, render_chat

        if isinstance(prompt, ImagePrompt):
            return prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            if self.vision is None and has_images(prompt):
                raise ImageInputError(f"model {self.loaded.name or Path(self.loaded.source).name} takes no images "
                                      "(a text-only model); send text only, or use a vision model")
            if self.vision is not None:  # vision templates read content as parts (SmolVLM's only so)
                prompt = [{**m, "content": [{"type": "text", "text": m["content"]}]}
                          if isinstance(m.get("content"), str) else m for m in prompt]
            if has_images(prompt):
                text = render_chat(self.tokenizer.chat_template, prompt, bos_token=self.tokenizer.bos_token,
                                   eos_token=self.tokenizer.eos_token, **template_kwargs)
                return self._with_images(text, [p["image"] for m in prompt if isinstance(m.get("content"), list)
                                                for p in m["content"] if p.get("type") == "image"])
        return encode_prompt(self.tokenizer, self.model_config.vocab_size, prompt, **template_kwargs)

    def _with_images(self, text: str, images: list) -> ImagePrompt:
        """A rendered prompt's image placeholders expanded to each image's tokens, tokenized, with
        the images' spans."""
        from ..model.vision.images import decode_image

        v = self.vision
        parts = text.split(v.placeholder)
        if len(parts) - 1 != len(images):
            raise ImageInputError(f"the chat template wrote {len(parts) - 1} image placeholder(s) "
                                  f"({v.placeholder!r}) for {len(images)} image(s)")
        pixels = [v.prepare(decode_image(im, f"image {i + 1}") if isinstance(im, bytes) else im)
                  for i, im in enumerate(images)]
        text = parts[0] + "".join(v.expand(p) + rest for p, rest in zip(pixels, parts[1:]))
        ids = self.tokenizer.encode_chat(text)
        return ImagePrompt(ids, image_spans(ids, pixels, v.image_token_id, v.family))

    def add_request(self, prompt: str | list[int] | list[dict] | ImagePrompt, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        params.validate()
        ids = self.encode_prompt(prompt)
        images = ()
        if isinstance(ids, ImagePrompt):
            ids, images = ids.ids, ids.images
            if images and self.vision is None:
                raise ImageInputError("this model takes no images")
        if not ids:
            raise ValueError("prompt is empty")
        n = len(ids)
        limit = self.max_model_len
        if n >= limit:
            raise ContextLengthError(
                f"prompt is {n} tokens but the context is {limit} tokens (no room to generate)", n, limit)
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise ContextLengthError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} tokens "
                f"exceeds the context of {limit} tokens", n, limit)
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        capacity = self.block_manager.capacity_blocks * self.config.block_size
        if n + max_tokens > capacity:
            raise ContextLengthError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) needs {n + max_tokens} KV slots but the "
                f"whole KV cache holds {capacity}", n, capacity)
        # not under the lock: a constraint nobody prepared compiles here (the server prepares
        # each one in a worker thread first: Grammars.prepare)
        matcher = self.grammars.matcher(params.constraint) if params.constraint is not None else None
        with self._lock:
            rid = request_id or f"req-{next(self._ids)}"
            if rid in self._seqs:
                raise ValueError(f"request id {rid!r} is already in use")
            seq = Sequence(rid, ids, params, max_tokens)
            seq.matcher, seq.images = matcher, images
            self._seqs[rid] = seq
            self._outputs[rid] = _Output(IncrementalDetokenizer(self.tokenizer, ids), params.stop)
            self.scheduler.add(seq)
            self.stats["requests"] += 1
        return rid

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free everything it holds. False if it was not live."""
        with self._lock:
            seq = self._seqs.pop(request_id, None)
            self._outputs.pop(request_id, None)
            if seq is None or seq.is_finished:
                return False
            self._release(seq, "abort")
            if not self.has_unfinished():
                self._busy(False)
            return True

    def _release(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if self.proposer is not None:
            self.proposer.release(seq.request_id)
            self.adaptive.forget(seq.request_id)

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits (float32, on the CPU) at every position of a token sequence, [len(token_ids),
        vocab]: row i scores the token that follows token_ids[i] (perplexity, evaluations).

        The tokens run as one sequence through the runner's forward over the paged KV cache, as a
        prompt's prefill does: chunked by `max_num_batched_tokens`, each chunk attending to the
        cached ones, beside the blocks of whatever else is live (it runs between steps, under the
        engine's lock; no scheduled batch, so other requests do not advance). Every position is
        computed (no prefix-cache hit), and the blocks are freed afterwards, never hashed."""
        ids = self.encode_prompt(list(token_ids))
        n = len(ids)
        if not n:
            raise ValueError("nothing to score: token_ids is empty")
        capacity = self.block_manager.capacity_blocks * self.config.block_size
        if n > min(self.max_model_len, capacity):
            raise ContextLengthError(f"{n} tokens to score but the context is {self.max_model_len} tokens "
                                     f"and the KV cache holds {capacity}", n, min(self.max_model_len, capacity))
        bm, budget, rows = self.block_manager, self.config.max_num_batched_tokens, []
        with self._lock:
            seq = Sequence(f"score-{next(self._ids)}", ids, SamplingParams(), 1)
            try:
                while seq.num_computed_tokens < n:
                    k = min(n - seq.num_computed_tokens, budget)
                    if not bm.can_allocate(seq, k):
                        raise RuntimeError(f"out of KV blocks: {n} tokens to score beside the live requests")
                    bm.allocate(seq, k)
                    hidden = self.runner.forward_hidden([seq], [k])
                    rows.append(self.runner.model.logits(hidden).float().cpu())
                    seq.num_computed_tokens += k
            finally:
                bm.free_seq(seq)
        return torch.cat(rows)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- the loop -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        with self._lock:
            t0 = time.perf_counter()
            proposals = self._propose() if self.proposer is not None else {}
            batch = self.scheduler.schedule({s: len(p.tokens) for s, p in proposals.items()})
            if not batch.seqs:
                return []
            self._busy(True)
            self.stats["steps"] += 1
            self.stats["max_batch_size"] = max(self.stats["max_batch_size"], len(batch.seqs))
            self.stats["preemptions"] = self.scheduler.num_preemptions
            verify = {}
            for seq, n in zip(batch.seqs, batch.num_new_tokens):
                if not seq.counted:  # first scheduling of this request (not after a preemption)
                    seq.counted = True
                    self.stats["prompt_tokens"] += seq.num_prompt_tokens
                    self.stats["cached_tokens"] += seq.num_cached_tokens
                p = proposals.get(seq)
                if p is not None and n == 1 + len(p.tokens):
                    seq.token_ids.extend(p.tokens)  # verified (and rolled back) below
                    verify[seq] = p
            results = self.runner.step(batch.seqs, batch.num_new_tokens, verify)
            n = batch.num_new_tokens[0]
            if self.proposer is not None and len(batch.seqs) == 1 and n <= self.adaptive.k_max + 1 \
                    and batch.seqs[0].num_computed_tokens > 0:
                # what speculation costs here, for choosing k (a one-sequence decode or verify step)
                self.adaptive.observe(n - 1, time.perf_counter() - t0)
            outs = []
            for seq, n, new in zip(batch.seqs, batch.num_new_tokens, results):
                if seq in verify:
                    self._rollback(seq, verify[seq].tokens, new)
                else:
                    seq.num_computed_tokens += n
                if new is None:  # a prompt chunk: its full blocks become reusable now
                    self.block_manager.hash_full_blocks(seq)
                else:
                    outs.append(self._append(seq, new))
            if not self.has_unfinished():
                self._busy(False)
            return outs

    def _busy(self, busy: bool) -> None:
        for r in self._runners:  # a background build of the compiled step runs only while idle
            r.busy(busy)

    def _propose(self) -> dict:
        running = self.scheduler.running
        cands, ks = [], []
        for s in running:
            if s.num_tokens - s.num_computed_tokens != 1 or not spec_eligible(s.params):
                continue
            room = min(s.max_tokens - s.num_output_tokens, self.max_model_len - s.num_tokens) - 1
            k = min(self.adaptive.choose(s.request_id, len(running)), room,
                    s.params.spec_tokens if s.params.spec_tokens is not None else room)
            if k > 0:
                cands.append(s)
                ks.append(k)
        if not cands:
            return {}
        return {s: p for s, p in zip(cands, self.proposer.propose(cands, ks)) if p.tokens}

    def _rollback(self, seq: Sequence, drafts: list[int], new: list[int]) -> None:
        """Keep the KV of the pending token and the accepted drafts; drop the rest."""
        accepted = len(new) - 1
        del seq.token_ids[seq.num_tokens - len(drafts):]
        seq.num_computed_tokens = seq.num_tokens + accepted
        self.block_manager.truncate(seq, seq.num_computed_tokens)
        st = self.spec_stats
        st.proposed += len(drafts)
        st.accepted += accepted
        st.verify_steps += 1
        st.emitted += len(new)
        self.adaptive.update(seq.request_id, len(drafts), accepted)

    def _append(self, seq: Sequence, new: list[int]) -> RequestOutput:
        """Add sampled (or verified) tokens to a sequence, decide whether it is finished, make
        its output."""
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        p = seq.params
        reason, kept, complete, error = None, [], False, None
        for t in new:
            kept.append(t)
            m = seq.matcher
            if m is not None and m.is_error():  # its mask computation failed
                kept.pop()
                reason, error = "error", _matcher_error(m)
                break
            if (t in self.eos_ids and not p.ignore_eos) or t in p.stop_token_ids:
                reason = "stop"
                break
            if m is not None:
                if not m.consume_token(t):
                    # the matcher failed (one of llguidance's limits, mid-way): the constraint can
                    # no longer be kept, so the output ends here, as an error, never as a stop
                    kept.pop()
                    reason, error = "error", _matcher_error(m)
                    break
                if m.is_stopped():  # the grammar is complete and allows nothing more
                    reason, complete = "stop", True
                    break
            if seq.num_output_tokens + len(kept) >= seq.max_tokens or \
                    seq.num_tokens + len(kept) >= self.max_model_len:
                reason = "length"
                break
        seq.token_ids.extend(kept)
        # a stop inside accepted drafts leaves KV past the kept tokens: it is never reused
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
        self.block_manager.hash_full_blocks(seq)  # before a finish frees them: the next turn reuses them
        self.stats["generated_tokens"] += len(kept)
        out = self._outputs[seq.request_id]
        visible = kept[:-1] if reason == "stop" and not complete else kept  # a stop token is not text
        delta = out.add(visible, final=reason is not None)
        if out.stopped and reason != "error":
            reason = "stop"
        if reason is not None:
            self._release(seq, reason)
            self._seqs.pop(seq.request_id, None)
            self._outputs.pop(seq.request_id, None)
        return RequestOutput(seq.request_id, delta, out.visible, kept, seq.output_ids, reason is not None,
                             reason, seq.num_prompt_tokens, seq.num_cached_tokens, seq.logprobs, seq.prompt_ids,
                             error)

    def generate(self, prompt: str | list[int] | list[dict], params: SamplingParams | None = None
                 ) -> Iterator[RequestOutput]:
        """Stream one request's outputs (runs the engine loop itself; for single-user front ends)."""
        rid = self.add_request(prompt, params)
        try:
            while True:
                for out in self.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.abort(rid)  # a consumer that stops early (Ctrl-C) frees the request's blocks

    # ---- stats ----------------------------------------------------------------------------
    def cache_stats(self) -> dict:
        s = self.stats
        return {**s, "hit_rate": s["cached_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0,
                "speculative": self.spec_stats.as_dict() if self.proposer is not None else None,
                "kv_blocks_total": self.num_blocks, "kv_blocks_used": self.block_manager.num_used_blocks,
                "running": self.num_running, "waiting": self.num_waiting,
                "captured_steps": self.runner.captured.steps if self.runner.captured is not None else 0,
                "vision_encodes": self.runner.vision_encodes}

    def live_sequences(self) -> list[Sequence]:
        return [s for s in self._seqs.values() if s.status != SeqStatus.FINISHED]
