"""SamplingParams (validated) and the sampler that turns logits into tokens."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from localllm_kernels import cpu_sampler

from .model.layers import top_indices
from .structured import Constraint

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # int64 (OpenAI) and uint64 (vLLM) seeds
# as vLLM: a positive temperature below this samples at it (1e-199 overflowed the logits to inf and
# the probabilities to NaN), and a repetition penalty below it is refused (it divides logits)
MIN_TEMPERATURE = 0.01
MIN_REPETITION_PENALTY = 0.01


class SamplingError(ValueError):
    """An invalid sampling value; the message names the parameter."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int | None = 256  # None: up to the context length
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0: only the chosen)
    min_tokens: int = 0
    spec_tokens: int | None = None  # speculative tokens per step (None: the engine's; 0: off)
    constraint: Constraint | None = None  # output held to a JSON schema / regex / choice / grammar
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI: -100..100)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.validate()

    def validate(self) -> None:
        def num(name, v, lo=None, hi=None, lo_open=False):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise SamplingError(name, f"must be a finite number, got {v!r}")
            if lo is not None and (v < lo or (lo_open and v == lo)):
                raise SamplingError(name, f"must be {'>' if lo_open else '>='} {lo}, got {v}")
            if hi is not None and v > hi:
                raise SamplingError(name, f"must be <= {hi}, got {v}")

        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
                raise SamplingError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        num("temperature", self.temperature, 0, 100)
        num("top_p", self.top_p, 0, 1, lo_open=True)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise SamplingError("top_k", f"must be an integer >= 0 (0 or -1 disables it), got {self.top_k!r}")
        num("min_p", self.min_p, 0, 1)
        num("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, 100)
        num("presence_penalty", self.presence_penalty, -2, 2)
        num("frequency_penalty", self.frequency_penalty, -2, 2)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise SamplingError("seed", f"must be an integer, got {self.seed!r}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise SamplingError("seed", f"must be in -2^63..2^64-1, got {self.seed}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingError("stop", "must be a non-empty string or a list of non-empty strings")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise SamplingError("logprobs", f"must be an integer in 0..20, got {self.logprobs!r}")
        if self.spec_tokens is not None and (not isinstance(self.spec_tokens, int) or not 0 <= self.spec_tokens <= 16):
            raise SamplingError("spec_tokens", f"must be an integer in 0..16, got {self.spec_tokens!r}")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise SamplingError("constraint", "must be a Constraint (localllm.structured.Constraint.make)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise SamplingError("logit_bias", "must be a map of token id -> bias")
            for tid, bias in self.logit_bias.items():
                if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
                    raise SamplingError("logit_bias", f"token ids must be integers >= 0, got {tid!r}")
                num("logit_bias", bias, -100, 100)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise SamplingError("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_logits(self) -> bool:
        """False when the argmax of the raw logits (among a constraint's allowed tokens) is the
        answer: greedy, no penalties, logprobs or bias."""
        return not (self.greedy and self.repetition_penalty == 1.0 and self.presence_penalty == 0
                    and self.frequency_penalty == 0 and self.logprobs is None and not self.logit_bias)


def generator_seed(seed: int) -> int:
    """What a request's generator is seeded with. torch's CPU generator keeps only the low 32 bits
    of its seed (0, 2^32 and 2^63 draw the same numbers), so a seed outside 0..2^32-1 is hashed
    from its full value into that range instead of being cut; seeds inside it are used as given."""
    if 0 <= seed < 1 << 32:
        return seed
    digest = hashlib.blake2b(str(seed).encode(), digest_size=4, person=b"localllm-seed").digest()
    return int.from_bytes(digest, "little")


def apply_logit_bias(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The request's logit_bias added to a row (a new tensor; ids beyond the row are the engine's
    to refuse, so they are skipped here rather than crash a shared batch)."""
    if not params.logit_bias:
        return logits
    ids = [t for t in params.logit_bias if t < logits.shape[-1]]
    out = logits.clone()
    out[ids] += torch.tensor([params.logit_bias[t] for t in ids], dtype=out.dtype)
    return out


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    """Repetition penalty as transformers (prompt + output); presence/frequency as OpenAI (output)."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output_ids:
        ids, counts = torch.tensor(output_ids, dtype=torch.long).unique(return_counts=True)
        logits[ids] -= params.presence_penalty + params.frequency_penalty * counts.to(logits.dtype)
    return logits


def nucleus(logits: torch.Tensor, params: SamplingParams, span: float = 8.0) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The tokens a draw can pick after temperature, top-k, top-p and min-p, with their
    probabilities (summing to 1): (ids, probs), most likely first, or (None, probs) over the
    whole vocabulary when no filter applies.

    Why sparse: top-p keeps a prefix of the tokens in falling order, and on a real model that
    prefix lies among the tokens within `span` temperatures of the best (at least e^-8 as
    likely; SmolLM2, T 0.7: a median of 15, the nucleus at 0.95 a median of 3, at most 56), so
    only those are sorted and only the normaliser reads the whole row: a dense pipeline
    (softmax, torch's full sort, scatter, renormalise, cumsum over 49k tokens) cost 0.7 ms a
    token. When they fall short of top_p, the 4096 most likely are ranked, then the whole row
    (a flat distribution: high temperature, random weights)."""
    x = logits.float()
    V = x.shape[-1]
    t = max(params.temperature, MIN_TEMPERATURE)
    inv_t = 1.0 / t
    top_k = params.top_k if 0 < params.top_k < V else 0
    if not top_k and params.top_p >= 1.0:
        probs = torch.softmax(x * inv_t, -1)
        if params.min_p > 0:
            probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
            probs = probs / probs.sum()
        return None, probs
    if top_k:  # only the top-k can be drawn: they are the candidates and the normaliser
        m = x.max()
        tiers = [lambda: (top_indices(x[None], top_k)[0], False)]
    else:
        if x.device.type == "cpu" and cpu_sampler.load():  # one pass on one thread, ~45 us (sampler.cpp)
            near, (m, z) = torch.ops.localllm.softmax_top(x, inv_t, span)
        else:
            m = x.max()
            near, z = (x >= m - span * t).nonzero()[:, 0], torch.exp((x - m) * inv_t).sum()
        most = min(4096, V)  # argpartition's k must lie inside the row (small vocabularies)
        # (candidates, already in falling order)
        tiers = [lambda: (near, False),
                 lambda: (torch.from_numpy(np.argpartition(-x.numpy(), most - 1)[:most]), False),  # 0.1-0.6 ms
                 lambda: (torch.from_numpy(np.argsort(-x.numpy())), True)]  # numpy's introsort: 0.7-2 ms
        if near.shape[-1] > 4096:  # flat (random weights, high temperatures): the 4096 best all but
            tiers = tiers[2:]  # always fall short of top_p too, so the whole row at once (~0.8 ms less)
    for tier in tiers:
        idx, ranked = tier()
        if ranked:  # (sorting the ranked row again took 0.74 ms)
            vals = x[idx]
        else:
            vals, o = x[idx].sort(descending=True)
            idx = idx[o]
        if top_k:
            z = torch.exp((vals - m) * inv_t).sum()
        probs = torch.exp((vals - m) * inv_t) / z
        cum = probs.cumsum(-1)
        if params.top_p >= 1.0 or top_k or cum[-1] > params.top_p or idx.shape[-1] == V:
            break
    if params.top_p < 1.0:
        n = int((cum - probs <= params.top_p).sum())  # a token stays while the mass before it is <= top_p
        idx, probs = idx[:n], probs[:n]
    if params.min_p > 0:
        n = int((probs >= params.min_p * probs[0]).sum())  # sorted: a prefix survives
        idx, probs = idx[:n], probs[:n]
    return idx, probs / probs.sum()


def filter_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`nucleus` as a dense row of probabilities over the vocabulary (speculative acceptance)."""
    idx, probs = nucleus(logits, params)
    return probs if idx is None else torch.zeros(logits.shape[-1]).index_put_((idx,), probs)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from probabilities (summing to ~1) by inverting the cumulative distribution with
    one uniform draw: torch.multinomial spent 1.4 ms a token over a 49k vocabulary, this ~60 us."""
    cum = probs.double().cumsum(-1)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cum[-1]
    i = int(torch.searchsorted(cum, u.reshape(1), right=True))  # first i with cum[i] > u: p[i] > 0
    if i >= probs.shape[-1]:  # u rounded up to the total
        i = int(probs.nonzero()[-1])
    return i


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.greedy:
        return int(logits.argmax())
    idx, probs = nucleus(logits, params)
    i = draw(probs, generator)
    return i if idx is None else int(idx[i])


def top_logprobs(logits: torch.Tensor, token: int, k: int) -> dict:
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = lp.topk(k) if k > 0 else None
    return {
        "token_id": token, "logprob": float(lp[token]),
        "top": [] if top is None else list(zip(top.indices.tolist(), top.values.tolist())),
    }
