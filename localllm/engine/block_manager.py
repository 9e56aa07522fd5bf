"""Paged KV blocks: allocation, reference counts, and the prefix cache.

A full block is named by a hash chained over its parent's hash and its token ids (and the hashes
of the images whose spans it holds part of: the same placeholder ids behind two different
images must not share KV, as in vLLM). A freed
block keeps its contents and hash in an LRU list until the space is needed, so a later request
with the same prefix (the next turn of a chat, a shared system prompt) reuses it. A hit also
compares the stored token ids: a hash collision can never hand out the wrong KV.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple = ()  # its key: token ids, then (image hash, offset in the span) of images in it


def chain_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn=chain_hash):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.cached: dict[int, int] = {}  # hash -> block id
        # ref_count == 0 blocks, least recently used first; contents kept until reallocated.
        # Block 0 is never handed out: padded gathers point at it, and the runner zeroes it, so
        # masked-out padding can never inject NaNs from uninitialized memory.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))

    # ---- accounting -----------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.capacity_blocks - len(self.free)

    @property
    def capacity_blocks(self) -> int:
        return self.num_blocks - 1

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_key(self, seq: Sequence, i: int) -> tuple:
        """What names block i of a sequence: its token ids, and for each image in it, the image's
        hash and where the block starts within its span."""
        bs = self.block_size
        key = tuple(seq.token_ids[i * bs:(i + 1) * bs])
        if seq.images:
            key += tuple((im.hash, i * bs - im.offset) for im in seq.images_in(i * bs, (i + 1) * bs))
        return key

    # ---- allocation -------------------------------------------------------------------
    def _take_free(self) -> int:
        bid, _ = self.free.popitem(last=False)
        b = self.blocks[bid]
        if b.hash is not None and self.cached.get(b.hash) == bid:
            del self.cached[b.hash]  # evict its cached contents
        b.hash, b.token_ids, b.ref_count = None, (), 1
        return bid

    def match_prefix(self, seq: Sequence) -> int:
        """Reuse cached blocks for the longest known prefix of a new sequence; returns the
        number of tokens served from the cache. At least the last token is always left to
        compute: a full hit must still produce logits."""
        assert not seq.block_table
        if not self.enable_prefix_caching:
            return 0
        bs, tokens = self.block_size, seq.token_ids
        parent = None
        for i in range((len(tokens) - 1) // bs):
            chunk = self.block_key(seq, i)
            h = self.hash_fn(parent, chunk)
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].token_ids != chunk:
                break
            b = self.blocks[bid]
            if b.ref_count == 0:
                del self.free[bid]
            b.ref_count += 1
            seq.block_table.append(bid)
            seq.block_hashes.append(h)
            parent = h
        seq.num_hashed_blocks = len(seq.block_table)
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * bs
        return seq.num_cached_tokens

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= len(self.free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make the block table cover the sequence's next `num_new_tokens` tokens."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > len(self.free):
            raise RuntimeError("out of KV blocks")  # the scheduler checks can_allocate first
        for _ in range(need):
            seq.block_table.append(self._take_free())

    def free_seq(self, seq: Sequence) -> None:
        """Release a sequence's blocks. Tail blocks are queued for eviction first; blocks that
        never got a hash (partial, or caching off) go before any cached block."""
        for bid in reversed(seq.block_table):
            b = self.blocks[bid]
            b.ref_count -= 1
            assert b.ref_count >= 0, "block freed twice"
            if b.ref_count == 0:
                self.free[bid] = None
                if b.hash is None:
                    self.free.move_to_end(bid, last=False)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll a sequence back to its first `num_tokens` tokens (speculative rejection)."""
        keep = self.blocks_needed(num_tokens)
        for bid in seq.block_table[keep:]:
            b = self.blocks[bid]
            b.ref_count -= 1
            if b.ref_count == 0:
                if b.hash is not None and self.cached.get(b.hash) == bid:
                    del self.cached[b.hash]
                b.hash, b.token_ids = None, ()
                self.free[bid] = None
                self.free.move_to_end(bid, last=False)
        del seq.block_table[keep:]
        full = num_tokens // self.block_size
        if seq.num_hashed_blocks > full:
            seq.num_hashed_blocks = full
            del seq.block_hashes[full:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, num_tokens)

    def hash_full_blocks(self, seq: Sequence) -> None:
        """Register every block whose KV is now complete (prompt or generated tokens)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(seq.num_hashed_blocks, full):
            chunk = self.block_key(seq, i)
            h = self.hash_fn(parent, chunk)
            b = self.blocks[seq.block_table[i]]
            b.hash, b.token_ids = h, chunk
            if h not in self.cached:
                self.cached[h] = b.block_id
            seq.block_hashes.append(h)
            parent = h
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def check_invariants(self, live: list[Sequence]) -> None:
        """For tests: ref counts equal table references; free list == unreferenced blocks."""
        refs = [0] * self.num_blocks
        for s in live:
            for bid in s.block_table:
                refs[bid] += 1
        for b in self.blocks[1:]:
            assert b.ref_count == refs[b.block_id], (b, refs[b.block_id])
            assert (b.ref_count == 0) == (b.block_id in self.free), b
        for h, bid in self.cached.items():
            assert self.blocks[bid].hash == h
