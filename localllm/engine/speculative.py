"""Speculative decoding: proposals (n-gram lookup or a small draft model), verification rules,
and the adaptive choice of k.

The target scores the pending token plus k proposals in one k+1-token "extend" through the
normal flattened batch. Greedy keeps the longest agreeing run plus the target's own next token;
sampling accepts proposal x with probability min(1, p(x)/q(x)) and on rejection draws from
norm(max(p - q, 0)), so the output distribution is exactly the target's. Rejected tokens' KV
is dropped by truncating lengths and block tables (no copies).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sampling import SamplingParams, draw, filter_probs
from .block_manager import BlockManager
from .sequence import Sequence


@dataclass
class Proposal:
    tokens: list[int]
    q: torch.Tensor | None = None  # [k, V] proposal distributions; None: deterministic (one-hot)


@dataclass
class SpecStats:
    proposed: int = 0
    accepted: int = 0
    verify_steps: int = 0
    emitted: int = 0  # tokens produced by verify steps (accepted + the target's own)

    def as_dict(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "mean_accepted_length": self.emitted / self.verify_steps if self.verify_steps else 0.0,
                "verify_steps": self.verify_steps}


# ---- verification -------------------------------------------------------------------------------
def accept_greedy(drafts: list[int], target: list[int]) -> list[int]:
    """target[i] = the target's argmax after the pending token and drafts[:i]."""
    out = []
    for d, t in zip(drafts, target):
        out.append(t)
        if d != t:
            return out
    out.append(target[len(drafts)])  # all accepted: the bonus token
    return out


def accept_sampling(drafts: list[int], p: torch.Tensor, q: torch.Tensor | None,
                    generator: torch.Generator | None) -> list[int]:
    """p: [k+1, V] target probabilities (after temperature/top-k/top-p), q: [k, V] or None for
    deterministic proposals. Returns accepted drafts plus one token from the target."""
    out = []
    for i, x in enumerate(drafts):
        qx = 1.0 if q is None else float(q[i, x])
        px = float(p[i, x])
        u = float(torch.rand((), generator=generator))
        if qx > 0 and u * qx < px:  # u < p/q without dividing
            out.append(x)
            continue
        residual = p[i].clone()
        if q is None:
            residual[x] = 0.0
        else:
            residual = (residual - q[i]).clamp_min_(0.0)
        total = residual.sum()
        if total <= 0:  # p == q: any rejection is a zero-probability event; fall back to p
            residual, total = p[i], p[i].sum()
        out.append(draw(residual / total, generator))
        return out
    out.append(draw(p[len(drafts)], generator))
    return out


# ---- adaptive k ---------------------------------------------------------------------------------
@dataclass
class AdaptiveK:
    """Per-request k, chosen for the most tokens per second: a verify with k drafts at the
    request's acceptance rate a yields (1 - a^(k+1)) / (1 - a) tokens on average and costs
    cost(k) plain decode steps (measured by the engine on single-sequence steps; a prior until
    then). When no k beats plain decode the request decodes plainly (k = 0), and is probed
    again with k = 1 every `probe_every` steps. Large batches do not speculate: verify tokens
    crowd out other requests' work."""

    k_max: int
    probe_every: int = 32
    acceptance: dict[str, float] = field(default_factory=dict)
    off: dict[str, int] = field(default_factory=dict)  # steps since the request stopped speculating
    step_s: dict[int, float] = field(default_factory=dict)  # EMA of one-sequence step seconds by k

    def observe(self, k: int, seconds: float) -> None:
        """A single-sequence step that verified k drafts (0: a plain decode step) took `seconds`."""
        old = self.step_s.get(k)
        self.step_s[k] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def cost(self, k: int) -> float:
        if 0 in self.step_s and k in self.step_s:
            return self.step_s[k] / self.step_s[0]
        return 1.0 + 0.15 * k  # a prior: verify rows cost a fraction of a step until measured

    @staticmethod
    def expected_tokens(a: float, k: int) -> float:
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    def choose(self, rid: str, batch_size: int) -> int:
        if batch_size > 16:
            return 0
        if rid in self.off:
            self.off[rid] += 1
            if self.off[rid] < self.probe_every:
                return 0
            del self.off[rid]
            return 1
        a = self.acceptance.get(rid, 0.5)
        cap = max(1, self.k_max // (1 + batch_size // 4))
        best_k, best = 0, 1.0
        for k in range(1, cap + 1):
            gain = self.expected_tokens(a, k) / self.cost(k)
            if gain > best:
                best_k, best = k, gain
        if best_k == 0:
            self.off[rid] = 0
        return best_k

    def update(self, rid: str, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.acceptance[rid] = 0.7 * self.acceptance.get(rid, 0.5) + 0.3 * accepted / proposed

    def forget(self, rid: str) -> None:
        self.acceptance.pop(rid, None)
        self.off.pop(rid, None)


# ---- proposers ----------------------------------------------------------------------------------
class NgramProposer:
    """Prompt lookup: continue the latest earlier occurrence of the context's last n tokens."""

    def __init__(self, n_max: int = 4, n_min: int = 1):
        self.n_max, self.n_min = n_max, n_min

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [Proposal(self._lookup(s.token_ids, k)) for s, k in zip(seqs, ks)]

    def _lookup(self, tokens: list[int], k: int) -> list[int]:
        n_tok = len(tokens)
        for n in range(min(self.n_max, n_tok - 1), self.n_min - 1, -1):
            tail = tokens[-n:]
            # scan backwards for the latest match that has a continuation
            for start in range(n_tok - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + k]
        return []

    def release(self, rid: str) -> None:
        pass


class DraftProposer:
    """A small model with its own paged KV cache proposes k tokens per sequence, batched.

    Each target sequence has a mirror sequence in the draft's block manager; before proposing,
    the mirror is truncated to the prefix it shares with the target (rejected proposals vanish)
    and catches up on the tokens it has not seen."""

    def __init__(self, runner, block_manager: BlockManager):
        self.runner = runner  # ModelRunner over the draft model
        self.bm = block_manager
        self.mirrors: dict[str, Sequence] = {}

    def _sync(self, seq: Sequence) -> Sequence:
        m = self.mirrors.get(seq.request_id)
        if m is None:
            m = Sequence(seq.request_id, list(seq.prompt_ids), seq.params, seq.max_tokens)
            m.generator = seq.generator
            self.mirrors[seq.request_id] = m
        common = 0
        for a, b in zip(m.token_ids, seq.token_ids):
            if a != b:
                break
            common += 1
        if m.num_computed_tokens > common:
            self.bm.truncate(m, common)
        m.token_ids = list(seq.token_ids)
        return m

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        mirrors = [self._sync(s) for s in seqs]
        want = dict(zip(mirrors, ks))
        drafts: dict[Sequence, list[int]] = {m: [] for m in mirrors}
        qs: dict[Sequence, list[torch.Tensor]] = {m: [] for m in mirrors}
        active = [m for m in mirrors if want[m] > 0]
        while active:
            counts = [m.num_tokens - m.num_computed_tokens for m in active]
            fits = [self.bm.can_allocate(m, n) for m, n in zip(active, counts)]
            active = [m for m, ok in zip(active, fits) if ok]
            counts = [n for n, ok in zip(counts, fits) if ok]
            if not active:
                break
            for m, n in zip(active, counts):
                self.bm.allocate(m, n)
            hidden = self.runner.forward_hidden(active, counts)
            last = torch.tensor(counts).cumsum(0) - 1
            rows = hidden[last]
            greedy = [m.params.greedy for m in active]
            # sampled on CPU with the request's CPU generator: same seed, same draws on any device
            logits = self.runner.model.head(rows).cpu() if not all(greedy) else None
            tokens = self.runner.model.head.greedy(rows).tolist() if all(greedy) else None
            nxt = []
            for i, (m, n) in enumerate(zip(active, counts)):
                m.num_computed_tokens += n
                if tokens is not None:
                    tok = tokens[i]
                elif m.params.greedy:
                    tok = int(logits[i].argmax())
                else:
                    q = filter_probs(logits[i], m.params)
                    tok = draw(q, m.generator)
                    qs[m].append(q)
                m.token_ids.append(tok)
                drafts[m].append(tok)
                if len(drafts[m]) < want[m]:
                    nxt.append(m)
            active = nxt
        return [Proposal(drafts[m], torch.stack(qs[m]) if qs[m] else None) for m in mirrors]

    def release(self, rid: str) -> None:
        m = self.mirrors.pop(rid, None)
        if m is not None:
            self.bm.free_seq(m)


def spec_eligible(params: SamplingParams) -> bool:
    """Penalties change the target distribution token by token: no speculation for them. (A
    constraint's masks are computed per draft position and rolled back: structured.draft_masks.)"""
    return (params.repetition_penalty == 1.0 and not params.presence_penalty and not params.frequency_penalty
            and params.logprobs is None and not params.min_tokens and params.spec_tokens != 0)
