"""Decides, each step, how many new tokens each sequence gets.

One flattened batch per step under a token budget: running sequences first (a decode token, or
the next chunk of a prompt still prefilling), then waiting sequences as far as budget, sequence
cap and free blocks allow. When blocks run out the newest running sequence is preempted (its
blocks freed, requeued, recomputed later mostly from the prefix cache).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..config import EngineConfig
from .block_manager import BlockManager
from .sequence import SeqStatus, Sequence


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @staticmethod
    def whole_images(seq: Sequence, n: int) -> int:
        """A prompt chunk of n tokens cut so it never ends inside an image's span: it ends before
        the span, or (when the chunk starts inside it or at it) runs to its end, past the budget if
        need be (an image is encoded and attended whole)."""
        first = seq.num_computed_tokens
        for im in seq.images_in(first, first + n):
            if im.end > first + n:
                return im.offset - first if im.offset > first else im.end - first
        return n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self, extra_tokens: dict[Sequence, int] | None = None) -> ScheduledBatch:
        """`extra_tokens`: tokens a running sequence needs beyond its pending ones this step
        (speculative drafts to verify)."""
        budget = self.config.max_num_batched_tokens
        seqs, counts, preempted = [], [], []
        extra_tokens = extra_tokens or {}
        for seq in list(self.running):
            if seq not in self.running:  # preempted below by an older sequence
                continue
            pending = seq.num_tokens - seq.num_computed_tokens
            n = min(pending, budget)
            if seq.images:
                n = self.whole_images(seq, n)
            if pending == 1 and budget >= 1 + extra_tokens.get(seq, 0):
                n = 1 + extra_tokens.get(seq, 0)
            if n <= 0:
                break
            while not self.bm.can_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SeqStatus.RUNNING:
                continue
            self.bm.allocate(seq, n)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if not seq.block_table:
                self.bm.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.images:
                n = self.whole_images(seq, n)
            if not self.bm.can_allocate(seq, n):
                self.bm.free_seq(seq)  # don't sit on cached blocks while waiting
                break
            self.waiting.popleft()
            self.bm.allocate(seq, n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free_seq(seq)
